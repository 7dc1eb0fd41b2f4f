"""The Triton backends: `triton` (compiled, on a CUDA GPU) and `interpret` (Triton's CPU
interpreter, for tests). Both run the kernels in kernels/ through a slot's preallocated
buffers; they differ only in device, lanes and how `calibrated` waits.

Request path of a slot on CUDA, with nothing allocated:
  pack features into the pinned input -> on the slot's stream: copy in, launch, copy the score
  back into the pinned output, record the done-event -> wait on the event -> read the score.

Imports only torch, triton and kernels/ (no plane.*), so scripts/gpu_check.py can use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from gpu_node.device_wait import CALIBRATED, RISK, DeviceWork, EventWork, TimedWork
from gpu_node.partitions import (
    GREEN_CONTEXT,
    NONE,
    STREAM,
    CudaLane,
    GreenPartitions,
    HostLane,
    Lane,
    PartitionPlan,
    green_partitions,
    plan_partitions,
)
from gpu_node.pinned import RowPacker, Staged
from kernels.calibrated import MAX_DURATION_US, calibrated
from kernels.launch import capture_graph
from kernels.probe import probe
from kernels.risk import FEATURES, RiskWeights, risk

MAX_BATCH = 16  # rows in each slot's buffers (run_risk uses row 0)
PROBE_SIZE = 256  # int32 elements per health probe
CPU_SLOTS = 2
# Plain streams share the GPU's hardware work queues (8 by default), so a long kernel on one
# slot's stream could hold up another's. Asked for before the CUDA context exists.
CUDA_MAX_CONNECTIONS = "32"


class KernelSlot:
    """One slot: its lane, its weights on the device, its buffers, all made once."""

    def __init__(
        self, weights: RiskWeights, lane: Lane, device: torch.device, *, spin_programs: int
    ) -> None:
        self._w = weights
        self._lane = lane
        self._on_cuda = device.type == "cuda"
        self._spin_programs = spin_programs
        self.x = Staged((MAX_BATCH, FEATURES), torch.float32, device)  # features in
        self.y = Staged((MAX_BATCH,), torch.float32, device)  # scores out
        self.spun = Staged((spin_programs,), torch.int64, device)  # calibrated: ns spun
        self.probe_in = Staged((PROBE_SIZE,), torch.int32, device)
        self.probe_out = Staged((PROBE_SIZE,), torch.int32, device)
        self._packer = RowPacker(self.x, FEATURES)
        self.risk_graph: torch.cuda.CUDAGraph | None = None  # made by warm_up on CUDA
        self.calibrated_graph: torch.cuda.CUDAGraph | None = None  # likewise
        self.duration = Staged((1,), torch.int64, device)  # calibrated: µs to spin
        # How each kind of request runs: "launches", "a CUDA graph", or why not (the log).
        self.risk_path = self.calibrated_path = "launches"
        # Whether `start_*` serve requests, their ends awaited on the event loop: on CUDA once
        # `warm_up` has checked them against `run_*`; off a GPU, `calibrated` is a timed wait.
        self.launches = frozenset() if self._on_cuda else frozenset({CALIBRATED})
        self.wait_path = "on the slot's thread" if self._on_cuda else "on the event loop"
        self._tokens = itertools.cycle(range(1, 1 << 20))
        self.probe_in.host.copy_(torch.arange(PROBE_SIZE, dtype=torch.int32) * 7919)
        self.probe_in.upload_no_sync()
        if self._on_cuda:
            torch.cuda.synchronize(device)  # buffers filled before any stream reads them

    @property
    def lane(self) -> Lane:
        return self._lane

    def buffers(self) -> tuple[Staged, ...]:
        return (self.x, self.y, self.spun, self.duration, self.probe_in, self.probe_out)

    def lane_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._lane.stream_context()

    def bind_thread(self) -> None:
        self._lane.bind_thread()

    def run_risk(self, features: Sequence[float]) -> float:
        self._packer.pack(features)
        with self._lane.stream_context():
            self._launch_risk()
            self._lane.record_done()
        self._lane.wait()
        return float(self.y.host_np[0])

    def _launch_risk(self) -> None:
        """The packed risk request's work, on the current stream: its graph, or launches."""
        if self.risk_graph is not None:
            self.risk_graph.replay()
        else:
            self._risk_launches()

    def _risk_launches(self) -> None:
        """A risk request's device work, on the current stream: features in, the kernel, the
        score back into the pinned output."""
        self.x.upload_no_sync()
        risk(self.x.dev, self._w, out=self.y.dev, n_rows=1)
        self.y.download_no_sync()

    def _capture_risk(self) -> str:
        """The risk request's launches as one CUDA graph, replayed per request: one launch
        from the host instead of three (Triton's launcher alone is tens of µs of Python, and
        16 slots share one GIL). The buffers never move, so the graph's pointers stay good.
        Kept only when its score equals the launches' own, bit for bit, on a test row.
        Returns how the slot runs risk requests, or why not a graph (the start-up log)."""
        assert isinstance(self._lane, CudaLane)
        row = [((i * 37) % 11 - 5) / 4 for i in range(FEATURES)]
        want = self.run_risk(row)
        try:
            self.risk_graph = capture_graph(self._risk_launches, self._lane.stream)
        except RuntimeError as e:
            return f"launches (capture failed: {e})"
        got = self.run_risk(row)
        if got != want:
            self.risk_graph = None
            return f"launches (the graph scored {got!r} where the launches scored {want!r})"
        return "a CUDA graph"

    def run_calibrated(self, duration_us: int) -> None:
        if not self._on_cuda:
            # The interpreter cannot read a GPU timer: a timed wait, as on the torch backend.
            if duration_us > 0:
                time.sleep(duration_us / 1e6)
            return
        with self._lane.stream_context():
            self._launch_calibrated(duration_us)
            self._lane.record_done()
        self._lane.wait()

    def _launch_calibrated(self, duration_us: int) -> None:
        """A calibrated request's work, on the current stream: its graph, or launches."""
        if not 0 <= duration_us <= MAX_DURATION_US:  # the kernel reads it unchecked
            raise ValueError(f"calibrated: duration_us={duration_us} outside "
                             f"0..{MAX_DURATION_US}")  # fmt: skip
        self.duration.host_np[0] = duration_us
        if self.calibrated_graph is not None:
            self.calibrated_graph.replay()
        else:
            self._calibrated_launches()

    def start_calibrated(self, duration_us: int) -> DeviceWork:
        if not self._on_cuda:
            return TimedWork(duration_us / 1e6)
        with self._lane.stream_context():
            self._launch_calibrated(duration_us)
            return EventWork(self._cuda_lane().mark(), duration_us / 1e6)

    def start_risk(self, features: Sequence[float]) -> DeviceWork:
        if not self._on_cuda:  # the interpreter computes on this CPU (not in `launches`)
            self.run_risk(features)
            return TimedWork(0.0)
        self._packer.pack(features)
        with self._lane.stream_context():
            self._launch_risk()
            return EventWork(self._cuda_lane().mark(), 0.0)  # µs of work: poll at once

    def risk_score(self) -> float:
        return float(self.y.host_np[0])

    def _cuda_lane(self) -> CudaLane:
        assert isinstance(self._lane, CudaLane)
        return self._lane

    def _check_loop_waits(self) -> str:
        """`start_*` against `run_*` (warm-up, on the slot's thread, after the graphs): kept
        only when a launched risk request scores what `run_risk` scores, bit for bit, and a
        launched calibrated one spins for its duration. Returns how requests are awaited, or
        why on the slot's thread (the start-up log)."""
        row = [((i * 53) % 13 - 6) / 5 for i in range(FEATURES)]
        try:
            want = self.run_risk(row)
            _spin_until_done(self.start_risk(row))
            if (got := self.risk_score()) != want:
                return f"on the slot's thread (launched, risk scored {got!r}, not {want!r})"
            _spin_until_done(self.start_calibrated(50))
            if not 50_000 <= self.spun_ns() < 50_000 + 5_000_000:
                return f"on the slot's thread (launched, calibrated spun {self.spun_ns()} ns)"
        except Exception as e:  # any failure: the thread's way, as before
            return f"on the slot's thread (launched: {type(e).__name__}: {e})"
        self.launches = frozenset({RISK, CALIBRATED})
        return "on the event loop"

    def _calibrated_launches(self) -> None:
        """A calibrated request's device work: its duration in, the spin, the ns spun out."""
        self.duration.upload_no_sync()
        calibrated(self.duration.dev, out=self.spun.dev, programs=self._spin_programs)
        self.spun.download_no_sync()

    def _capture_calibrated(self) -> str:
        """A calibrated request as one graph, as `_capture_risk`; kept only if a replay spins
        for the duration it is given (50 µs, then 0)."""
        assert isinstance(self._lane, CudaLane)
        try:
            self.calibrated_graph = capture_graph(self._calibrated_launches, self._lane.stream)
        except RuntimeError as e:
            return f"launches (capture failed: {e})"
        for duration_us in (50, 0):
            self.run_calibrated(duration_us)
            if not duration_us * 1000 <= self.spun_ns() < duration_us * 1000 + 5_000_000:
                self.calibrated_graph = None
                return f"launches (the graph spun {self.spun_ns()} ns for {duration_us} µs)"
        return "a CUDA graph"

    def request_paths(self) -> str:
        """How this slot runs each kind of request (for the start-up log)."""
        return (f"risk requests: {self.risk_path}, calibrated requests: {self.calibrated_path},"
                f" awaited {self.wait_path}")

    def warm_up(self) -> None:
        """Run each kernel once, so that compiling (or the interpreter's rewrite) happens
        before the slot takes its first request, and a broken lane fails here. On CUDA, then
        capture the risk request as a graph (`risk_path` says whether it took, and why not)."""
        self.run_risk([0.0] * FEATURES)
        self.run_calibrated(0)
        if not self.probe():
            raise RuntimeError("slot warm-up: the probe kernel returned a wrong result")
        if self._on_cuda:
            self.risk_path = self._capture_risk()
            self.calibrated_path = self._capture_calibrated()
            self.wait_path = self._check_loop_waits()

    def spun_ns(self) -> int:
        """How long the last calibrated request's slowest program spun (CUDA only)."""
        return int(self.spun.host_np.max())

    def probe(self) -> bool:
        """True when a fresh token round-trips through the device. A device failure raises."""
        token = next(self._tokens)
        with self._lane.stream_context():
            probe(self.probe_in.dev, token, out=self.probe_out.dev)
            self.probe_out.download_no_sync()
            self._lane.record_done()
        self._lane.wait()
        return bool((self.probe_out.host_np - self.probe_in.host_np == token).all())


class KernelBackend:
    """`triton` on a CUDA device, or `interpret` on the CPU. The partition plan is decided
    here, once; `make_slot(k)` then only builds lanes and buffers."""

    def __init__(self, *, interpret: bool, seed: int = 0, sms_per_slot: int | None = None) -> None:
        self.name = "interpret" if interpret else "triton"
        self._weights_host = RiskWeights.from_seed(seed)
        self._green: GreenPartitions | None = None
        self.request_paths = ""  # CUDA: how the last slot made runs its requests (the log)
        if interpret:
            self.device = torch.device("cpu")
            self.plan = PartitionPlan(
                kind=NONE, sm_count=0, sms_per_slot=0, slots=CPU_SLOTS,
                note="Triton interpreter on the CPU, one launch at a time",
            )  # fmt: skip
        else:
            if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_MAX_CONNECTIONS)
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.plan, self._green = _plan_cuda(self.device, sms_per_slot)
        self.partition = self.plan.kind
        self._weights = self._weights_host.to(self.device)

    def describe(self, slots: int | None = None) -> str:
        where = "cpu" if self.device.type == "cpu" else torch.cuda.get_device_name(self.device)
        paths = f"; {self.request_paths}" if self.request_paths else ""
        return f"{self.name} on {where}: {self.plan.describe(slots)}{paths}"

    def default_slots(self) -> int:
        return self.plan.slots

    def make_slot(self, k: int) -> KernelSlot:
        slot = KernelSlot(
            self._weights,
            self._lane(k),
            self.device,
            spin_programs=max(1, self.plan.sms_per_slot),
        )
        slot.warm_up()
        if self.device.type == "cuda":
            self.request_paths = slot.request_paths()
        return slot

    def _lane(self, k: int) -> Lane:
        if self.plan.kind == NONE:
            return HostLane()
        if self.plan.kind == GREEN_CONTEXT:
            assert self._green is not None
            return self._green.lane(k)
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return CudaLane(stream, kind=STREAM)


def _plan_cuda(
    device: torch.device, sms_per_slot: int | None
) -> tuple[PartitionPlan, GreenPartitions | None]:
    props: Any = torch.cuda.get_device_properties(device)
    sm_count = int(props.multi_processor_count)
    # Size first (pure, raises on a bad --sms-per-slot), then see whether the driver's green
    # contexts really give each slot SMs of its own.
    plan = plan_partitions(
        sm_count=sm_count, cc_major=int(props.major), sms_per_slot=sms_per_slot,
        green=False, note="",
    )  # fmt: skip
    assert device.index is not None
    green, why = green_partitions(device.index, plan.sms_per_slot, plan.slots, sm_count)
    plan = plan_partitions(
        sm_count=sm_count, cc_major=int(props.major), sms_per_slot=sms_per_slot,
        green=green is not None, note=why,
    )  # fmt: skip
    if green is not None and len(green.groups) < plan.slots:  # the driver made fewer
        plan = dataclasses.replace(plan, slots=len(green.groups))
    return plan, green


def _spin_until_done(work: DeviceWork, timeout_s: float = 10.0) -> None:
    """Wait for launched work off the loop (the warm-up's check): a short sleep per look."""
    give_up = time.monotonic() + timeout_s
    while not work.done():
        if time.monotonic() > give_up:
            raise TimeoutError("launched work not done within 10 s")
        time.sleep(0.0001)
