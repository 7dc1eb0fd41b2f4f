# mypy: disable-error-code="untyped-decorator, no-untyped-def"
# (Triton types kernel arguments itself, as pointers, scalars and constexprs; annotations would
# only be ignored by it.)
"""Health probes: a tiny kernel that proves a slot can launch, read, write and copy back.

`probe` adds a fresh token to a known input, so a stale result (a launch that silently did
nothing) cannot pass. `sm_ids` (CUDA only) records which SM each program ran on: it is how the
GPU backend and scripts/gpu_check.py verify that SM partitions are really disjoint.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import interpreting, launch_lock

PROBE_BLOCK = 128


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def probe_reference(x: torch.Tensor, token: int) -> torch.Tensor:
    """[N] int32 -> [N] int32: x + token. Moves 8 bytes per element (read x, write out)."""
    return x + token


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["token"])  # a new token must not mean a new compile
def _probe_kernel(
    x_ptr,  # *i32 [n]: a known pattern
    out_ptr,  # *i32 [n]: x + token
    n,  # number of elements
    token,  # i32 changed on every probe, so a stale output never passes
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + offs, x + token, mask=ok)


@triton.jit(do_not_specialize=["spin_ns"])
def _sm_id_kernel(
    out_ptr,  # *i32 [programs]: the SM that ran each program
    spin_ns,  # keep each program resident this long, so the grid spreads over every SM
):
    pid = tl.program_id(0)
    sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
    )
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    now = start
    while now - start < spin_ns:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    tl.store(out_ptr + pid, sm)


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


def probe(x: torch.Tensor, token: int, *, out: torch.Tensor) -> torch.Tensor:
    """out[:] = x + token (int32, same device, same length). Does not synchronise."""
    if x.dtype != torch.int32 or out.dtype != torch.int32:
        raise ValueError("probe: x and out must be int32")
    if x.dim() != 1 or out.shape != x.shape or not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"probe: x and out must be contiguous vectors of one length, got "
                         f"{tuple(x.shape)} and {tuple(out.shape)}")  # fmt: skip
    if x.device != out.device:
        raise ValueError(f"probe: x is on {x.device} but out is on {out.device}")
    if not -(2**30) <= token < 2**30:
        raise ValueError("probe: token must fit comfortably in int32")
    n = x.shape[0]
    if n == 0:
        return out
    with launch_lock():
        _probe_kernel[(triton.cdiv(n, PROBE_BLOCK),)](x, out, n, token, BLOCK=PROBE_BLOCK)
    return out


def sm_ids(out: torch.Tensor, *, spin_us: int = 20) -> torch.Tensor:
    """Launch len(out) programs on the current CUDA stream; each writes its SM id to out."""
    if interpreting() or out.device.type != "cuda":
        raise ValueError("sm_ids reads %smid with inline assembly: CUDA only, not interpreted")
    if out.dtype != torch.int32 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("sm_ids: out must be a contiguous int32 vector")
    _sm_id_kernel[(out.shape[0],)](out, spin_us * 1000, num_warps=1)
    return out
