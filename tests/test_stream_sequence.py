"""`stream_sequence` reads a JetStream message's stream sequence as nats-py's metadata does,
from both forms of the ack subject, and from a message a real server delivered."""

from __future__ import annotations

import nats
import pytest
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from plane.contract.embedded import EmbeddedNats
from plane.contract.ownership import stream_sequence


def message(reply: str) -> Msg:
    return Msg(_client=None, subject="plane.slot.risk.n.0", reply=reply)  # type: ignore[arg-type]


@pytest.mark.parametrize("reply", [
    "$JS.ACK.PLANE_SLOTS.c0.1.4711.12.1733400000000000000.0",  # without a domain
    "$JS.ACK.hub.ACCHASH.PLANE_SLOTS.c0.2.4711.12.1733400000000000000.3.rand",  # with one
    "$JS.ACK._.ACCHASH.PLANE_SLOTS_2.c0.1.4711.1.1733400000000000000.0",
])
def test_it_reads_what_nats_py_reads(reply: str) -> None:
    msg = message(reply)
    assert stream_sequence(msg) == msg.metadata.sequence.stream == 4711


@pytest.mark.parametrize("reply", ["", "_INBOX.abc", "$JS.ACK.too.short"])
def test_a_message_that_is_not_jetstreams_is_refused_as_nats_py_refuses_it(reply: str) -> None:
    with pytest.raises(NotJSMessageError):
        stream_sequence(message(reply))


async def test_a_delivered_message() -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="SEQ", subjects=["seq.>"])
            for i in range(3):
                ack = await js.publish("seq.x", str(i).encode())
            sub = await js.pull_subscribe("seq.x", durable="d")
            msgs = await sub.fetch(3, timeout=5)
            assert [stream_sequence(m) for m in msgs] == [
                m.metadata.sequence.stream for m in msgs] == [ack.seq - 2, ack.seq - 1, ack.seq]
        finally:
            await nc.close()
