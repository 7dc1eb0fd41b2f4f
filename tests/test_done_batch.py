"""A node's done-events of one loop turn as one message (gpu_node/done_batch.py), against a
real nats-server: the turn's acks, then its done-events (several as one batch, one alone on
its slot's subject), then the answers they free, in the turn's one write; and a plane whose
slots finish together sends batches that its router reads: every request answered 200 at
one closed-loop caller per slot, each done-event heard once."""

from __future__ import annotations

import asyncio
from collections import Counter

import nats

from gpu_node.done_batch import DoneBatch
from plane.contract.embedded import EmbeddedNats
from plane.contract.messages import DoneEvent, read_done
from plane.contract.publish import command
from plane.contract.soon_flush import use_soon_flush
from plane.contract.subjects import Header, Names
from tests.plane_fixtures import NAMES, calibrated, client, listen, plane, status, wait_until

T = Names("t")


def event(k: int, rid: str) -> DoneEvent:
    return DoneEvent(request_id=rid, node="n1", model="calibrated", k=k, status=200,
                     service_us=10 + k)


async def test_a_turns_done_events_go_as_one_message_between_its_acks_and_its_answers(
        nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        dones = DoneBatch(nc, T, "calibrated", "n1")
        soon = use_soon_flush(nc)
        got = await listen(nc, "t.>")
        await asyncio.sleep(0.05)
        writes = soon.writes
        for k in range(3):  # one turn: three slots finish, each acks, then sends its event
            await nc.publish(f"t.ack.{k}", b"+ACK")
            dones.send(event(k, f"r{k}"), T.done("calibrated", "n1", k),
                       command(nc, f"t.answer.{k}", b"ok", {Header.REQUEST_ID: f"r{k}"}))
        await wait_until(lambda: len(got) >= 7, 5, "7 messages")
        assert [m.subject for m in got] == [
            "t.ack.0", "t.ack.1", "t.ack.2", T.done_batch("calibrated", "n1"),
            "t.answer.0", "t.answer.1", "t.answer.2"]
        assert read_done(got[3].data, batch=True) == [event(k, f"r{k}") for k in range(3)]
        assert [m.headers for m in got[4:]] == [{Header.REQUEST_ID: f"r{k}"} for k in range(3)]
        assert soon.writes == writes + 1  # all in the turn's one write
        assert (dones.messages, dones.events) == (1, 3)

        # A turn with one: on its slot's subject, as a slot's event always was.
        dones.send(event(2, "r3"), T.done("calibrated", "n1", 2),
                   command(nc, "t.answer.2", b"ok", None))
        await wait_until(lambda: len(got) >= 9, 5, "2 more messages")
        assert [m.subject for m in got[7:]] == [T.done("calibrated", "n1", 2), "t.answer.2"]
        assert not T.is_done_batch(got[7].subject)
        assert read_done(got[7].data, batch=False) == [event(2, "r3")]
        assert (dones.messages, dones.events) == (2, 4)
    finally:
        await nc.close()


async def test_sent_while_reconnecting_arrives_after_the_reconnect() -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        try:
            dones = DoneBatch(nc, T, "calibrated", "n1")
            got = await listen(nc, "t.>")
            await srv.stop()
            await wait_until(lambda: not nc.is_connected, 5, "the client to see the loss")
            for k in range(2):  # one turn, while the connection is down
                dones.send(event(k, f"r{k}"), T.done("calibrated", "n1", k),
                           command(nc, f"t.answer.{k}", b"ok", None))
            await asyncio.sleep(0.05)  # the turn's end has come: they wait in nats-py's buffer
            await srv.start()
            await wait_until(lambda: len(got) >= 3, 10, "the batch and answers after reconnect")
            assert [m.subject for m in got] == [
                T.done_batch("calibrated", "n1"), "t.answer.0", "t.answer.1"]
        finally:
            await nc.close()


async def test_slots_that_finish_together_send_batches_the_router_reads() -> None:
    """4 closed-loop callers on 4 slots: the node's slots finish in one turn often (the
    batches), the router frees each slot from them (no 429: a slot known busy while its
    caller had its answer would be refused), and every request's done-event comes once."""
    async with plane(models=("calibrated",), slots=4, backend="torch") as stack, \
            client(stack.url) as nc:
        heard = await listen(nc, NAMES.done_all())
        statuses: Counter[int] = Counter()
        ids: list[str] = []

        async def caller() -> None:
            for _ in range(150):
                msg = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5,
                                       headers={Header.DEADLINE_MS: "2000"})
                statuses[status(msg)] += 1
                ids.append((msg.headers or {})[Header.REQUEST_ID])

        await asyncio.gather(*(caller() for _ in range(4)))
        assert statuses == {200: 600}
        dones = stack.nodes[0].dones
        assert dones.events >= 600 and dones.messages < dones.events  # batches were sent
        assert any(NAMES.is_done_batch(m.subject) for m in heard)
        await wait_until(lambda: len(heard) >= dones.messages, 5, "every done message")
        events = Counter(ev.request_id for m in heard
                         for ev in read_done(m.data, batch=NAMES.is_done_batch(m.subject)))
        assert all(events[rid] == 1 for rid in ids), [r for r in ids if events[r] != 1][:5]
