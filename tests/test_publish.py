"""The hot path's publish with headers (plane/contract/publish.py) against a real nats-server:
what arrives is what nats-py's own publish delivers; a line break in a value becomes a space,
as nats-py makes it; a bad subject and an oversized body are refused with a clear error;
while the connection is down it falls back to nats-py, whose reconnect buffer delivers it."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import BadSubjectError, MaxPayloadError

from plane.contract.embedded import EmbeddedNats
from plane.contract.publish import header_block, publish
from tests.plane_fixtures import listen, wait_until

HEADERS = {"Plane-Request-Id": "r-1", "Plane-Deadline-Ms": "250", "Nats-TTL": "11s",
           "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
           "Plane-Note": "spaces inside: kept, and a colon"}


async def _until(got: list[Msg], n: int) -> None:
    await wait_until(lambda: len(got) >= n, 5, f"{n} messages")


async def test_what_arrives_is_what_nats_py_delivers(nc: Client) -> None:
    got = await listen(nc, "pub.test")
    await nc.publish("pub.test", b"body", reply="_INBOX.a.1", headers=HEADERS)
    await publish(nc, "pub.test", b"body", HEADERS, reply="_INBOX.a.1")
    await publish(nc, "pub.test", b"", {"Plane-Request-Id": "r-2"})
    await _until(got, 3)
    theirs, ours, empty = got
    assert (ours.subject, ours.reply, ours.data) == (theirs.subject, theirs.reply, theirs.data)
    assert ours.headers == theirs.headers == HEADERS
    assert (empty.reply, empty.data, empty.headers) == ("", b"", {"Plane-Request-Id": "r-2"})
    assert nc.stats["out_msgs"] >= 3


async def test_a_line_break_in_a_value_becomes_a_space_as_nats_py_makes_it(nc: Client) -> None:
    sneaky = {"Plane-Request-Id": "r-1\r\nPlane-Status: 200"}
    assert header_block(sneaky) == b"NATS/1.0\r\nPlane-Request-Id: r-1  Plane-Status: 200\r\n\r\n"
    got = await listen(nc, "pub.sneaky")
    await nc.publish("pub.sneaky", b"", headers=sneaky)
    await publish(nc, "pub.sneaky", b"", sneaky)
    await _until(got, 2)
    assert got[0].headers == got[1].headers == {"Plane-Request-Id": "r-1  Plane-Status: 200"}


async def test_bad_subjects_and_oversized_bodies_are_refused(nc: Client) -> None:
    for subject, reply in (("", ""), ("a b", ""), ("ok", "bad\r\nreply")):
        with pytest.raises(BadSubjectError):
            await publish(nc, subject, b"x", HEADERS, reply=reply)
    with pytest.raises(MaxPayloadError):
        await publish(nc, "pub.big", b"x" * (nc.max_payload + 1), HEADERS)


async def test_published_while_reconnecting_arrives_after_the_reconnect() -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        try:
            got = await listen(nc, "pub.later")  # resubscribed before the buffer is sent
            await srv.stop()
            for _ in range(200):
                if not nc.is_connected:
                    break
                await asyncio.sleep(0.01)
            assert not nc.is_connected
            await publish(nc, "pub.later", b"kept", HEADERS)  # into nats-py's buffer
            await srv.start()
            await _until(got, 1)
            assert [(m.data, m.headers) for m in got] == [(b"kept", HEADERS)]
        finally:
            await nc.close()
