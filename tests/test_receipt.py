"""A request's budget runs from when the router received it (design.md, `Plane-Deadline-Ms`),
not from when the router got round to it: `plane.contract.inline` stamps each message with
the time its bytes had reached the host (waiting in the socket counts), and the router's
admission starts the clock there."""

from __future__ import annotations

import json
import time

from nats.aio.msg import Msg

from plane.contract.inline import Inline, mark_received, received_s
from plane.contract.subjects import Header
from tests.plane_fixtures import NAMES, calibrated, client, plane, wait_until


async def test_a_burst_is_stamped_when_it_came_not_when_its_turn_came() -> None:
    """200 messages of 1 KiB sent at once (many 32 KiB chunks for the parser), each handled
    in 2 ms on the read loop: the last is handled ~0.4 s after it came, and its stamp says
    so (without the count of bytes waiting behind each chunk, the last chunk's messages
    were stamped when their chunk began, a few ms before their handling)."""
    async with plane(models=()) as stack, client(stack.url) as nc, client(stack.url) as pub:
        seen: list[tuple[float, float]] = []  # (stamp, handled at)

        def slow(msg: Msg) -> None:
            seen.append((received_s(msg, -1.0), time.monotonic()))
            time.sleep(0.002)  # holds the read loop, as a busy router does

        await Inline.of(nc).subscribe("receipt.test", slow)
        await nc.flush()
        sent_s = time.monotonic()
        for i in range(200):
            await pub.publish("receipt.test", b"%04d" % i + b"x" * 1020)
        await pub.flush()
        await wait_until(lambda: len(seen) == 200, 10, "the burst")
        stamps = [stamp for stamp, _ in seen]
        assert all(sent_s - 0.01 <= stamp for stamp in stamps)
        assert stamps == sorted(stamps)
        last_stamp, last_handled = seen[-1]
        assert last_handled - seen[0][1] >= 0.35  # 199 x 2 ms on the read loop
        assert last_handled - last_stamp >= 0.3  # and the wait shows in the stamp


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
