# mypy: disable-error-code="untyped-decorator, no-untyped-def"
# (Triton types kernel arguments itself, as pointers, scalars and constexprs; annotations would
# only be ignored by it.)
"""The `calibrated` model: keep the slot's SMs busy for the requested microseconds.

For budgets and benchmarks on a GPU: every program spins on the GPU's global nanosecond timer
(PTX `%globaltimer`, read with inline assembly) until the duration has passed, then writes how
long it spun. The Triton interpreter cannot run inline assembly, so on the CPU backends a
calibrated request is a timed wait off the event loop instead (see gpu_node.compute), and the
kernel is checked only on a GPU (scripts/gpu_check.py).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from kernels.launch import interpreting, launch_lock

MAX_DURATION_US = 10_000_000  # 10 s: far past any deadline; a bigger request is a mistake


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def calibrated_reference(duration_us: int) -> int:
    """Spin on the host clock for `duration_us`; returns the nanoseconds actually spun.

    Moves no bytes; the kernel writes one int64 per program (its own spin time).
    """
    start = time.perf_counter_ns()
    end = start + duration_us * 1000
    now = start
    while now < end:
        now = time.perf_counter_ns()
    return now - start


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["duration_ns"])
def _spin_kernel(
    out_ptr,  # *i64 [programs]: nanoseconds each program spun
    duration_ns,  # how long to spin, ns (not specialised: no recompile per duration)
    duration_us_ptr,  # *i64 [1]: the duration in µs, read on the device (DURATION_IN_MEMORY)
    DURATION_IN_MEMORY: tl.constexpr,
):
    if DURATION_IN_MEMORY:
        duration_ns = tl.load(duration_us_ptr) * 1000
    pid = tl.program_id(0)
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    now = start
    while now - start < duration_ns:
        # is_pure=False: a fresh read every iteration, never hoisted out of the loop.
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    tl.store(out_ptr + pid, now - start)


# --------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------


def calibrated(
    duration_us: int | torch.Tensor, *, out: torch.Tensor, programs: int = 1
) -> torch.Tensor:
    """Launch `programs` spinning programs for `duration_us` on the current CUDA stream.

    `duration_us` is an int, or a one-element int64 CUDA tensor that the kernel reads when it
    runs: the launch is then the same for every duration, so a CUDA graph can hold it (a
    slot's, gpu_node.kernel_backend). Such a duration is not checked on the host (that would
    wait for the device): it must lie in 0..MAX_DURATION_US.
    out: int64 CUDA tensor with >= `programs` elements; program i writes its spin time (ns)
    to out[i]. Does not synchronise. Returns `out`.
    """
    if isinstance(duration_us, torch.Tensor):
        if duration_us.dtype != torch.int64 or duration_us.numel() != 1:
            raise ValueError("calibrated: a duration tensor must be one int64 (µs)")
        ns, at, in_memory = 0, duration_us, True
    elif not 0 <= duration_us <= MAX_DURATION_US:
        raise ValueError(f"calibrated: duration_us={duration_us} outside 0..{MAX_DURATION_US}")
    else:
        ns, at, in_memory = duration_us * 1000, out, False  # `at` unread
    if programs < 1:
        raise ValueError(f"calibrated: programs={programs} must be at least 1")
    if interpreting():
        raise ValueError(
            "calibrated: the spin kernel reads the GPU timer with inline assembly, which the "
            "Triton interpreter cannot run; CPU backends wait with time.sleep instead"
        )
    if out.device.type != "cuda":
        raise ValueError(f"calibrated: out must be a CUDA tensor, got {out.device}")
    if out.dtype != torch.int64 or out.dim() != 1 or out.shape[0] < programs:
        raise ValueError(f"calibrated: out must be an int64 vector of >= {programs} elements")
    if in_memory and at.device != out.device:
        raise ValueError(f"calibrated: the duration tensor must be on {out.device}")
    with launch_lock():
        _spin_kernel[(programs,)](out, ns, at, DURATION_IN_MEMORY=in_memory, num_warps=4)
    return out
