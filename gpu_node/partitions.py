"""SM partitions: how a GPU is cut into slots, and the lane (stream + event) each slot runs on.

Decided once, when the backend is built:

- The partition size is the hardware's minimum green-context partition (8 SMs on Hopper),
  or `--sms-per-slot` rounded up to what the hardware allows. Default slots per GPU = SMs //
  partition size (132 // 8 = 16 on an H200).
- The CUDA driver splits the device into that many disjoint groups at once
  (gpu_node.sm_split), each a green context, and each slot launches on a stream of its own in
  its group. We do not take that on trust: a kernel records which SMs each group's programs
  ran on (`kernels.probe.sm_ids`). If the sets overlap, or are not confined to the group,
  slots use plain streams and the plan says why. (torch's own `GreenContext.create` splits
  the *whole* device for every context: on an H200, torch 2.11, every one was the same 8 SMs.)
- Otherwise each slot launches on its own plain CUDA stream, and the plan says so.

Imports only torch, ctypes and kernels/, so that scripts/gpu_check.py can use it on a bare
GPU box.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_node.sm_split import SmGroup, SplitError, split_device

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


def count_slots(n: int) -> str:
    """`n` slot(s), for a log line: "1 slot", "16 slots"."""
    return f"{n} slot" if n == 1 else f"{n} slots"


@dataclass(frozen=True)
class PartitionPlan:
    kind: str  # GREEN_CONTEXT | STREAM | NONE
    sm_count: int
    sms_per_slot: int  # after rounding to the hardware's granularity
    slots: int  # default slots on this device: sm_count // sms_per_slot
    note: str  # one line for the start-up log: what was chosen and why

    def describe(self, slots: int | None = None) -> str:
        """`slots` (None: the default, `self.slots`) of this plan's partitions; a count the
        node was given says the device's own default too."""
        n = self.slots if slots is None else slots
        default = "" if n == self.slots else f" (the device's default: {self.slots})"
        return (
            f"{count_slots(n)}{default} x {self.sms_per_slot} of {self.sm_count} SMs, "
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

    def bind_thread(self) -> None: ...

    def record_done(self) -> None: ...

    def wait(self) -> None: ...


class HostLane:
    """CPU backends: every call is synchronous, there is nothing to wait for."""

    kind = NONE

    def stream_context(self) -> contextlib.AbstractContextManager[Any]:
        return _NULL_CONTEXT

    def bind_thread(self) -> None:
        pass

    def record_done(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaLane:
    """One slot's stream (plain, or in its own green context) and its reusable done-event.

    The event is a blocking one: a slot's thread that waits for its work sleeps until the
    GPU is done. A default event's wait spins a core for as long as the work runs (the
    driver spins while a process has fewer contexts than the host has cores): sixteen slots
    of 20 ms work would keep sixteen cores busy doing nothing, the cores the router, the
    broker and the node's loop need. A sleeping wait costs a wake-up instead;
    scripts/gpu_check.py times both (section 4)."""

    def __init__(
        self, stream: torch.cuda.Stream, *, kind: str, owner: object = None, blocking: bool = True
    ) -> None:
        self.kind = kind
        self.stream = stream
        # The green context owns the stream: keep it alive as long as the lane.
        self._owner = owner
        self.blocking = blocking
        self._bound: int | None = None  # the thread whose current stream is this one

    @property
    def blocking(self) -> bool:
        return self._blocking

    @blocking.setter
    def blocking(self, value: bool) -> None:
        """Whether waits sleep (True) or spin; set between requests only."""
        self._blocking = value
        self._done = torch.cuda.Event(blocking=value)  # type: ignore[no-untyped-call]
        self._loop_done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # (queried only)

    def stream_context(self) -> contextlib.AbstractContextManager[Any]:
        """Launches inside go to this lane's stream. On the thread `bind_thread` bound, a
        no-op: `torch.cuda.stream` costs a device query and two stream switches, held under
        the GIL, per request (seen in the node's GIL profile on an H200, docs/perf)."""
        if threading.get_ident() == self._bound:
            return _NULL_CONTEXT
        return torch.cuda.stream(self.stream)

    def bind_thread(self) -> None:
        """Make this lane's stream (and its device) current for good on the calling thread:
        the slot's own thread, once, before its first call."""
        torch.cuda.set_device(self.stream.device)
        torch.cuda.set_stream(self.stream)
        self._bound = threading.get_ident()

    def record_done(self) -> None:
        self._done.record(self.stream)

    def wait(self) -> None:
        self._done.synchronize()

    def mark(self) -> torch.cuda.Event:
        """An event recorded after the work launched so far, for the loop to `query`
        (`gpu_node.device_wait.EventWork`): its own, apart from the one the slot's thread
        waits on, since a probe may run there meanwhile."""
        self._loop_done.record(self.stream)
        return self._loop_done


# --------------------------------------------------------------------------------------------
# Green contexts from the driver's split, verified where kernels run
# --------------------------------------------------------------------------------------------


class GreenPartitions:
    """The device cut into disjoint SM groups (gpu_node.sm_split); slot k runs on group
    k % groups, on a stream of its own (slots past the group count share a group's SMs)."""

    def __init__(self, groups: list[SmGroup]) -> None:
        self.groups = groups
        # One lane per group, made for the start-up check and handed to the first slot that
        # asks for that group (a stream is not given back: none is made only to be dropped).
        self.first = [CudaLane(g.stream(), kind=GREEN_CONTEXT, owner=g) for g in groups]
        self._handed: set[int] = set()

    def lane(self, k: int) -> CudaLane:
        i = k % len(self.groups)
        if i not in self._handed:
            self._handed.add(i)
            return self.first[i]
        group = self.groups[i]
        return CudaLane(group.stream(), kind=GREEN_CONTEXT, owner=group)


def observe_sms(lane: CudaLane, *, programs: int, spin_us: int = 20) -> set[int]:
    """The SMs that a grid of `programs` spinning programs ran on, launched on `lane`."""
    from kernels.probe import sm_ids

    with lane.stream_context():
        out = torch.zeros(programs, dtype=torch.int32, device="cuda")
        sm_ids(out, spin_us=spin_us)
    lane.stream.synchronize()
    return set(out.tolist())


def green_partitions(
    device_index: int, sms_per_slot: int, groups: int, sm_count: int
) -> tuple[GreenPartitions | None, str]:
    """Split the device into `groups` groups of `sms_per_slot` SMs, then launch a grid of
    4 programs per SM on each and record where they ran: the groups are used only when every
    group stays within its SMs and no two share one. Returns them (or None) and why, for the
    plan's note."""
    try:
        made = split_device(device_index, sms_per_slot, groups)
        parts = GreenPartitions(made)
        seen = [observe_sms(lane, programs=4 * sm_count) for lane in parts.first]
    except Exception as e:  # a probe at start: any failure means plain streams
        what = str(e) if isinstance(e, SplitError) else f"{type(e).__name__}: {e}"
        return None, f"green contexts failed ({what}); plain streams"
    over = [(len(s), g.sm_count) for s, g in zip(seen, made, strict=True) if len(s) > g.sm_count]
    if over:
        return None, (
            f"green contexts did not confine kernels ({over[0][0]} SMs used of "
            f"{over[0][1]}); plain streams"
        )
    shared = sum(len(a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    if shared:
        return None, f"green contexts share SMs ({shared} in common); plain streams"
    return parts, (
        f"driver split into {len(made)} disjoint groups of {made[0].sm_count} SMs, "
        "verified where kernels ran"
    )
