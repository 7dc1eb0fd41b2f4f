"""Forwards sent at once, their one answer to a callback (plane/router/forward_replies.py),
against a real nats-server: the answer reaches the future `send` returned, headers and all;
a forward to a subject nobody serves gets the server's no-responders status (the owner is
gone); and a wait given up leaves nothing behind."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.headers import is_no_responders
from plane.router.forward_replies import ForwardReplies


async def test_each_forward_gets_its_own_answer(nc: Client) -> None:
    async def owner(m: Msg) -> None:  # answers each forward with what it was sent
        await nc.publish(m.reply, m.data, headers={"Plane-Forwarded-By": "taken"})

    await nc.subscribe("fwd.owner", cb=owner)
    forwards = ForwardReplies(nc)
    await forwards.start()
    try:
        sent = [await forwards.send("fwd.owner", str(i).encode(), {"Plane-Request-Id": str(i)})
                for i in range(20)]
        answers = await asyncio.wait_for(asyncio.gather(*sent), 5)
        assert [a.data for a in answers] == [str(i).encode() for i in range(20)]
        assert all((a.headers or {}).get("Plane-Forwarded-By") == "taken" for a in answers)
        assert len(forwards) == 0
    finally:
        await forwards.stop()


async def test_a_forward_nobody_serves_and_a_wait_given_up(nc: Client) -> None:
    forwards = ForwardReplies(nc)
    await forwards.start()
    try:
        gone = await asyncio.wait_for(await forwards.send("fwd.nobody", b"x", {}), 5)
        assert is_no_responders(gone.headers) and gone.data == b""
        await nc.subscribe("fwd.silent")  # a subscriber that never answers
        silent = await forwards.send("fwd.silent", b"x", {})
        assert len(forwards) == 1
        try:
            await asyncio.wait_for(silent, 0.2)
            raise AssertionError("a silent owner answered")
        except TimeoutError:
            pass
        assert len(forwards) == 0  # the token went with the wait
    finally:
        await forwards.stop()
