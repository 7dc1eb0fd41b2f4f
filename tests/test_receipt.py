"""A request's budget runs from when the router received it (design.md, `Plane-Deadline-Ms`),
not from when the router got round to it: `plane.router.receipt` stamps each request as
nats-py reads it, and the router's admission starts the clock there."""

from __future__ import annotations

import asyncio
import json
import time

from nats.aio.msg import Msg

from plane.contract.subjects import Header
from plane.router.receipt import mark_received, received_s, stamp_receipt
from tests.plane_fixtures import NAMES, calibrated, client, plane


async def test_a_request_is_stamped_when_read_not_when_handled() -> None:
    """Two requests read together; the first one's handler holds the subscription for
    200 ms: the second's stamp is from its reading, ~200 ms before its handling."""
    async with plane(models=()) as stack, client(stack.url) as nc:
        seen: list[tuple[float, float]] = []  # (stamp, handled at)

        async def slow(msg: Msg) -> None:
            seen.append((received_s(msg, -1.0), time.monotonic()))
            if len(seen) == 1:
                await asyncio.sleep(0.2)

        sub = stamp_receipt(await nc.subscribe("receipt.test", cb=slow))
        await nc.publish("receipt.test", b"1")
        await nc.publish("receipt.test", b"2")
        async with asyncio.timeout(5):
            while len(seen) < 2:
                await asyncio.sleep(0.01)
        await sub.unsubscribe()
        (stamp1, handled1), (stamp2, handled2) = seen
        assert 0 <= handled1 - stamp1 < 0.1
        assert handled2 - stamp2 >= 0.19  # it waited behind the first, and that shows
        assert stamp2 < handled1 + 0.1  # read while the first was handled


async def test_a_request_that_waited_out_its_budget_in_the_router_is_refused() -> None:
    """The same request, handled by the real router at once and after waiting 200 ms in its
    hands: placed the first time; refused (`deadline`) the second, where it used to be
    placed with a fresh budget and answered after its caller had given up."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        inbox = nc.new_inbox()
        sub = await nc.subscribe(f"{inbox}.*")
        for waited_s, rid in ((0.0, "fresh"), (0.2, "waited")):
            msg = Msg(_client=nc, subject=NAMES.infer("calibrated"), reply=f"{inbox}.{rid}",
                      data=calibrated(1000),
                      headers={Header.DEADLINE_MS: "100", Header.REQUEST_ID: rid})
            mark_received(msg, time.monotonic() - waited_s)
            await router.requests.on_request(msg)
            answer = await sub.next_msg(timeout=5)
            h = answer.headers or {}
            if rid == "fresh":
                assert Header.STATUS not in h or h[Header.STATUS] == "200", h
            else:
                assert h[Header.STATUS] == "429" and h[Header.REASON] == "deadline", h
                assert "deadline" in json.loads(answer.data)["error"]
