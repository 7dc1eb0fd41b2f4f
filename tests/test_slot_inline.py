"""A slot runs its calls on the event loop while they are known short (`Slot._call`,
`NodeConfig.inline_work_us`), on its own thread otherwise; against a real plane."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from gpu_node.compute import SlotRunner
from gpu_node.slot import INLINE_AFTER, INLINE_WORK_US_CPU
from plane.contract.messages import FaultCommand, json_encoder
from tests.plane_fixtures import NAMES, calibrated, client, plane, status


class Where:
    """A runner that notes on which thread each call ran."""

    def __init__(self, inner: SlotRunner) -> None:
        self._inner = inner
        self.threads: list[str] = []

    def run_calibrated(self, duration_us: int) -> None:
        self.threads.append(threading.current_thread().name)
        self._inner.run_calibrated(duration_us)

    def run_risk(self, features: Sequence[float]) -> float:
        self.threads.append(threading.current_thread().name)
        return self._inner.run_risk(features)

    def probe(self) -> bool:
        return self._inner.probe()

    def lane_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._inner.lane_context()

    def bind_thread(self) -> None:
        self._inner.bind_thread()


async def test_short_calls_run_on_the_loop_and_long_or_faulty_ones_on_the_thread() -> None:
    # A limit far above a 0 us call, so that a busy host (a call's thread preempted between
    # its start and its end) does not make a short call look long.
    # (Calibrated requests go through `_call` only with device waits on the slot's thread:
    # on the loop they are launched and awaited, `tests/test_device_wait.py`.)
    async with plane(models=("calibrated",), slots=1, backend="torch", allow_faults=True,
                     node_overrides={"inline_work_us": 2_000, "device_waits": "thread"}) \
            as stack, \
            client(stack.url) as nc:
        slot = stack.nodes[0].slots[0]
        assert slot.inline_work_us == 2_000
        where = Where(slot.runner._inner)
        slot.runner._inner = where
        loop_thread = threading.current_thread().name

        async def call(us: int) -> None:
            m = await nc.request(NAMES.infer("calibrated"), calibrated(us), timeout=5)
            assert status(m) == 200, m.headers

        for _ in range(INLINE_AFTER + 5):
            await call(0)
        assert where.threads[0] != loop_thread  # unknown at first: the thread
        assert where.threads[INLINE_AFTER + 1:] == [loop_thread] * 4  # then known short
        # Work asked for beyond the limit goes to the thread, and so do the calls after it
        # (it took longer than the limit) until the slot's calls are short again.
        where.threads.clear()
        await call(5_000)
        await call(0)
        assert loop_thread not in where.threads
        for _ in range(INLINE_AFTER + 1):
            await call(0)
        assert where.threads[-1] == loop_thread
        # An injected fault (a call may hang) never runs on the loop.
        cmd = FaultCommand(k=0, mode="slow", extra_us=1)
        assert (await nc.request(NAMES.fault(stack.nodes[0].cfg.node_id),
                                 json_encoder.encode(cmd), timeout=5)).data == b"ok"
        where.threads.clear()
        await call(0)
        assert where.threads == [slot.thread._name]


async def test_on_a_cpu_by_default_on_a_gpu_only_when_asked() -> None:
    """None (the default): 50 us on a CPU backend; a GPU's slots stay on their threads
    (a hung kernel there must stay one slot's fault), which `_inline_work_us` decides from
    the backend's partition kind."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack:
        node = stack.nodes[0]
        assert node.cfg.inline_work_us is None
        assert node.slots[0].inline_work_us == INLINE_WORK_US_CPU
        node.backend.partition = "green-context"  # as a CUDA backend's plan says
        assert node._inline_work_us() == 0
