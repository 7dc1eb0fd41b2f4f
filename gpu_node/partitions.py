"""SM partitions: how a GPU is cut into slots, and the lane (stream + event) each slot runs on.

Decided once, when the backend is built:

- The partition size is the hardware's minimum green-context partition (8 SMs on Hopper),
  or `--sms-per-slot` rounded up to what the hardware allows. Default slots per GPU = SMs //
  partition size (132 // 8 = 16 on an H200).
- Where torch has green contexts with streams (`torch.cuda.green_contexts.GreenContext`),
  each slot gets its own green context of that many SMs and launches on a stream created in
  it. We do not take that on trust: two contexts are made first and a kernel records which SMs
  each one ran on (`kernels.probe.sm_ids`). If their SM sets overlap, or are not confined to
  the partition, slots use plain streams and the plan says why. (torch 2.13 makes every
  context by splitting the *whole* device, so two contexts of 8 SMs may well be the same 8.)
- Otherwise each slot launches on its own plain CUDA stream, and the plan says so.

Imports only torch and kernels/, so that scripts/gpu_check.py can use it on a bare GPU box.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

GREEN_CONTEXT = "green-context"
STREAM = "stream"
NONE = "none"

_NULL_CONTEXT = contextlib.nullcontext()


def partition_granularity(cc_major: int) -> tuple[int, int]:
    """(minimum SMs, step) of an SM partition, from the CUDA driver's guideline for
    cuDevSmResourceSplitByCount: 2/2 on compute 6.x and 7.x, 4/2 on 8.x, 8/8 on 9.0+."""
    if cc_major >= 9:
        return 8, 8
    if cc_major == 8:
        return 4, 2
    return 2, 2


@dataclass(frozen=True)
class PartitionPlan:
    kind: str  # GREEN_CONTEXT | STREAM | NONE
    sm_count: int
    sms_per_slot: int  # after rounding to the hardware's granularity
    slots: int  # default slots on this device: sm_count // sms_per_slot
    note: str  # one line for the start-up log: what was chosen and why

    def describe(self) -> str:
        return (
            f"{self.slots} slots x {self.sms_per_slot} of {self.sm_count} SMs, "
            f"{self.kind}: {self.note}"
        )


def plan_partitions(
    *, sm_count: int, cc_major: int, sms_per_slot: int | None, green: bool, note: str
) -> PartitionPlan:
    """Pure: the partition size and default slot count for a device. Raises ValueError when
    `sms_per_slot` cannot fit the device."""
    minimum, step = partition_granularity(cc_major)
    if sms_per_slot is None:
        size = minimum
    elif sms_per_slot < 1:
        raise ValueError(f"--sms-per-slot must be at least 1, got {sms_per_slot}")
    else:
        size = max(minimum, -(-sms_per_slot // step) * step)
        if size != sms_per_slot:
            note = f"--sms-per-slot {sms_per_slot} rounded up to {size}; {note}"
    if size > sm_count:
        raise ValueError(f"--sms-per-slot {size} is more than the GPU's {sm_count} SMs")
    return PartitionPlan(
        kind=GREEN_CONTEXT if green else STREAM,
        sm_count=sm_count,
        sms_per_slot=size,
        slots=max(1, sm_count // size),
        note=note,
    )


# --------------------------------------------------------------------------------------------
# Lanes: where a slot's work runs
# --------------------------------------------------------------------------------------------


class Lane(Protocol):
    kind: str

    def stream_context(self) -> contextlib.AbstractContextManager[Any]: ...

    def record_done(self) -> None: ...

    def wait(self) -> None: ...


class HostLane:
    """CPU backends: every call is synchronous, there is nothing to wait for."""

    kind = NONE

    def stream_context(self) -> contextlib.AbstractContextManager[Any]:
        return _NULL_CONTEXT

    def record_done(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaLane:
    """One slot's stream (plain, or in its own green context) and its reusable done-event."""

    def __init__(self, stream: torch.cuda.Stream, *, kind: str, owner: object = None) -> None:
        self.kind = kind
        self.stream = stream
        # The green context owns the stream: keep it alive as long as the lane.
        self._owner = owner
        self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it bare

    def stream_context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def record_done(self) -> None:
        self._done.record(self.stream)

    def wait(self) -> None:
        self._done.synchronize()


# --------------------------------------------------------------------------------------------
# Green contexts, behind feature checks
# --------------------------------------------------------------------------------------------


def green_context_support() -> tuple[bool, str]:
    """Whether this torch can make green contexts with their own streams, and why not."""
    if not hasattr(torch._C, "_CUDAGreenContext"):
        return False, f"torch {torch.__version__} was built without green contexts"
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        return False, f"torch {torch.__version__} has no torch.cuda.green_contexts"
    if not hasattr(GreenContext, "Stream"):
        return False, f"torch {torch.__version__} green contexts have no Stream()"
    return True, "green contexts available"


def create_green_context(num_sms: int, device_index: int) -> tuple[Any, str]:
    """A green context of `num_sms` SMs with balanced work queues where torch and the driver
    allow them; returns it with a word on which options took."""
    from torch.cuda.green_contexts import GreenContext

    try:
        ctx = GreenContext.create(
            num_sms=num_sms, workqueue_scope="balanced", device_id=device_index
        )
        return ctx, "balanced work queues"
    except (TypeError, RuntimeError) as e:  # older torch, or a driver without work queues
        first = e
    try:
        return GreenContext.create(num_sms=num_sms, device_id=device_index), (
            f"shared work queues ({type(first).__name__}: {first})"
        )
    except TypeError:  # torch 2.10: create(num_sms, device_id)
        legacy: Any = GreenContext.create  # torch 2.10's signature: create(num_sms, device_id)
        return legacy(num_sms, device_index), "shared work queues"


def observe_sms(lane: CudaLane, *, programs: int, spin_us: int = 20) -> set[int]:
    """The SMs that a grid of `programs` spinning programs ran on, launched on `lane`."""
    from kernels.probe import sm_ids

    with lane.stream_context():
        out = torch.zeros(programs, dtype=torch.int32, device="cuda")
        sm_ids(out, spin_us=spin_us)
    lane.stream.synchronize()
    return set(out.tolist())


def check_green_partition(sms_per_slot: int, device_index: int, sm_count: int) -> tuple[bool, str]:
    """Make two green contexts and check that their SM sets are disjoint and no bigger than
    asked. Returns whether slots can use green contexts, and why (for the plan's note)."""
    lanes = []
    try:
        for _ in range(2):
            ctx, how = create_green_context(sms_per_slot, device_index)
            lanes.append(CudaLane(ctx.Stream(), kind=GREEN_CONTEXT, owner=ctx))
        seen = [observe_sms(lane, programs=4 * sm_count) for lane in lanes]
    except RuntimeError as e:
        return False, f"green contexts failed ({e}); plain streams"
    if max(len(s) for s in seen) > sms_per_slot:
        used = max(len(s) for s in seen)
        return False, (
            f"green contexts did not confine kernels ({used} SMs used of {sms_per_slot}); "
            "plain streams"
        )
    if seen[0] & seen[1]:
        return False, (
            f"torch {torch.__version__} green contexts share SMs ({len(seen[0] & seen[1])} "
            "in common: each is split from the whole device); plain streams"
        )
    return True, f"disjoint SM sets verified, {how}"
