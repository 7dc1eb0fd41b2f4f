"""The hot path's publish with headers (plane/contract/publish.py) against a real nats-server:
what arrives is what nats-py's own publish delivers; a line break in a value becomes a space,
as nats-py makes it; a bad subject and an oversized body are refused with a clear error;
while the connection is down it falls back to nats-py, whose reconnect buffer delivers it.
A ready header block (`replies.error_block`, the router's refusals) is the same bytes as
`header_block` of the error's dict, and publishes (and falls back) as that dict does."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import BadSubjectError, MaxPayloadError

from plane.contract import replies
from plane.contract.embedded import EmbeddedNats
from plane.contract.header_lines import parse_header_lines
from plane.contract.messages import Reason, Status
from plane.contract.publish import header_block, publish
from plane.contract.subjects import Header
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


@pytest.mark.parametrize("extras", [
    {},
    {"retry_after_ms": 1},
    {"retry_after_ms": 2501, "ticket": "t.abc-1"},
    {"ticket": "t.abc-2"},
])
@pytest.mark.parametrize("trace", [{}, {"traceparent": HEADERS["traceparent"]},
                                   {"tracestate": "a=1\r\nb=2"}])
def test_an_error_block_is_the_block_of_the_error_headers(
        extras: dict[str, object], trace: dict[str, str]) -> None:
    message = "all 2 slots busy:\tcome back"  # a tab: not printable, made a space
    body, headers = replies.error_reply("r-9", Status.BUSY, Reason.BUSY, message,
                                        **extras)  # type: ignore[arg-type]
    block_body, block = replies.error_block("r-9", Status.BUSY, Reason.BUSY, message,
                                            extra=trace, **extras)  # type: ignore[arg-type]
    # Plane-Server-Time is the wall clock in ms: read it off the block, then compare it all.
    stamp = parse_header_lines(block[len(b"NATS/1.0\r\n"):])[Header.SERVER_TIME]
    headers[Header.SERVER_TIME] = stamp
    assert block_body == body
    assert block == header_block({**headers, **trace})


async def test_a_ready_header_block_arrives_as_its_headers(nc: Client) -> None:
    got = await listen(nc, "pub.block")
    await publish(nc, "pub.block", b"b", header_block(HEADERS), reply="_INBOX.b.1")
    await _until(got, 1)
    assert (got[0].data, got[0].reply, got[0].headers) == (b"b", "_INBOX.b.1", HEADERS)


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
            await publish(nc, "pub.later", b"block", header_block(HEADERS))  # the same
            await srv.start()
            await _until(got, 2)
            assert [(m.data, m.headers) for m in got] == [(b"kept", HEADERS),
                                                         (b"block", HEADERS)]
        finally:
            await nc.close()
