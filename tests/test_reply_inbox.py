"""Requests and their replies through one inbox subscription (plane/contract/reply_inbox.py),
against a real nats-server: requests sent at once (`send`) get their own replies, headers and
all, when waited on later (`reply`, as a router waits on its forwards); a subject nobody
serves raises nats-py's NoRespondersError, a silent one its TimeoutError; and a wait given
up, or cancelled, leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from plane.contract.reply_inbox import ReplyInbox


async def test_requests_sent_at_once_get_their_own_replies_later(nc: Client) -> None:
    async def owner(m: Msg) -> None:  # answers each request with what it was sent
        await nc.publish(m.reply, m.data, headers={"Plane-Forwarded-By": "taken"})

    await nc.subscribe("inbox.owner", cb=owner)
    inbox = ReplyInbox(nc)
    sent = [await inbox.send("inbox.owner", str(i).encode(), {"Plane-Request-Id": str(i)})
            for i in range(20)]
    answers = [await inbox.reply(f, 5) for f in reversed(sent)]
    assert [a.data for a in answers] == [str(i).encode() for i in reversed(range(20))]
    assert all((a.headers or {}).get("Plane-Forwarded-By") == "taken" for a in answers)
    assert (await inbox.request("inbox.owner", b"x", {}, 5)).data == b"x"
    assert not inbox._waiting


async def test_nobody_serves_a_silent_one_and_a_wait_given_up(nc: Client) -> None:
    inbox = ReplyInbox(nc)
    with pytest.raises(NoRespondersError):
        await inbox.reply(await inbox.send("inbox.nobody", b"x", {}), 5)
    await nc.subscribe("inbox.silent")  # a subscriber that never answers
    with pytest.raises(NatsTimeout):
        await inbox.request("inbox.silent", b"x", {}, 0.2)
    waiting = asyncio.ensure_future(inbox.reply(await inbox.send("inbox.silent", b"x", {}), 5))
    await asyncio.sleep(0.05)
    assert len(inbox._waiting) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not inbox._waiting  # the token went with the wait
