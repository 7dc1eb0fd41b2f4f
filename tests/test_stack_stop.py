"""How a `PlaneStack` (what `plane up` runs) stops: its nodes drain side by side, each
answering what it runs, once."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from plane.contract.config import ConnectOptions
from plane.contract.subjects import Header
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import NAMES, calibrated, client, slots_running, wait_until

WORK_US = 1_500_000  # long beside a stop's other steps: both nodes drain it at once


def draining(stack: PlaneStack) -> int:
    """How many of the stack's nodes have begun to stop (their slots withdrawn)."""
    return sum(1 for node in stack.nodes
               if node.slots and all(s.withdrawn_for == "shutdown" for s in node.slots))


async def test_a_stacks_nodes_drain_side_by_side_and_answer_what_they_run_once() -> None:
    # The stack stopped its nodes one after another, each waiting for its running requests
    # (a stream: up to its drain timeout) before the next began: `plane up` with several
    # models took the sum of their drains to exit.
    stack = PlaneStack(StackConfig(connect=ConnectOptions(url=None), models=("calibrated",),
                                   nodes_per_model=2, slots=1, backend="torch"))
    await stack.start()
    stopped = False
    try:
        async with client(stack.url) as nc:
            got: list[Msg] = []

            async def keep(msg: Msg) -> None:
                got.append(msg)

            inbox = nc.new_inbox()
            await nc.subscribe(f"{inbox}.*", cb=keep)
            for i in range(2):
                await nc.publish(NAMES.infer("calibrated"), calibrated(WORK_US),
                                 reply=f"{inbox}.{i}",
                                 headers={Header.DEADLINE_MS: "10000",
                                          Header.REQUEST_ID: f"long-{i}"})
            await wait_until(lambda: slots_running(stack) == 2, 10, "both nodes running one")
            stop = asyncio.create_task(stack.stop())
            await wait_until(lambda: draining(stack) >= 1, 10, "a node draining")
            await asyncio.sleep(0.3)  # far less than the other's drain, serial
            side_by_side = draining(stack)
            await stop  # its server last: the answers came before it stopped
            stopped = True
        assert side_by_side == 2
        assert sorted((m.subject.rsplit(".", 1)[1], (m.headers or {}).get(Header.STATUS))
                      for m in got) == [("0", "200"), ("1", "200")]
    finally:
        if not stopped:
            await stack.stop()
