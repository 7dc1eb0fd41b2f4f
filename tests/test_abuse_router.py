"""The router against an outside probe (issue 16): a message that would exceed the server's
max_payload, a connection the server closed, a flood, an estimate a burst polluted, tickets
that could be guessed, and adverts or heartbeats that name what they should not. Real
nats-server, real router and nodes; each case failed before its fix."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from plane.contract.budget import ServiceWindow
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.messages import DoneEvent, Heartbeat, NodeAdvert, SlotAdvert, json_encoder
from plane.contract.subjects import Header
from plane.router.admission import TICKET_HEX, ticket_owner
from plane.router.inflight import InFlight
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated, header, plane, status

pytestmark = pytest.mark.slow


# A bound on the inbox's wait past `flood`'s blocked loop (see there).
UNREAD_BOUND = {"max_inbox_wait_ms": 1000}


async def flood(nc: NATS, n: int, *, work_us: int = 0, unread_s: float = 0.0) -> Ledger:
    """`n` calibrated requests published at once (deadline 2 s) on a ledger; with `unread_s`
    the loop is then blocked that long, so they wait unread in the router's socket (the
    router runs in this process). The router's `max_inbox_wait_ms` must exceed `unread_s`
    (`UNREAD_BOUND`): else it sees its loop stood still and refuses them all unread as
    waited past it (`plane.router.stall`), not as a burst read back to back."""
    ledger = await Ledger(nc).start()
    for _ in range(n):
        await ledger.send(NAMES.infer("calibrated"), calibrated(work_us), 2000)
    await nc.flush()
    if unread_s:
        time.sleep(unread_s)  # noqa: ASYNC251 - the point: the router reads nothing meanwhile
    return ledger


async def test_body_that_would_overflow_the_servers_max_payload_is_413(tmp_path: Path) -> None:
    """A server with a 64 KiB max_payload and the router's default 64 KiB body limit: a
    valid body just under 64 KiB plus the router's headers used to exceed max_payload on the
    slot publish, the server closed the router's connection and the router served nothing
    after. Now the router's body limit fits what the server carries: 413, and it serves on."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    server = EmbeddedNats(NatsServerSpec(extra_args=["-c", str(conf)]))
    async with server as srv, plane(srv.url, models=("calibrated",), slots=2,
                                    backend="torch") as stack:
        router = stack.routers[0]
        nc = await nats.connect(srv.url)
        try:
            body = b'{"duration_us": 0' + b" " * 65_480 + b"}"
            m = await nc.request(NAMES.infer("calibrated"), body, timeout=5)
            assert status(m) == 413, m.headers
            ok = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
            assert status(ok) == 200
            assert not router.nc.is_closed and not router.lost.is_set()
        finally:
            await nc.close()


async def test_router_reports_a_connection_closed_for_good() -> None:
    """nats-py does not reconnect after some server errors: the router must say so (its
    `lost` event, on which `plane router` exits non-zero) instead of lingering deaf."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack:
        router = stack.routers[0]
        assert not router.lost.is_set()
        await router.nc.close()
        await asyncio.wait_for(router.lost.wait(), 2.0)


async def test_a_flood_is_shed_at_once_and_each_request_answered_once() -> None:
    """More requests in hand (awaiting their PubAck, parked, forwarded) than `max_routing`:
    the rest are refused 429 on arrival, with no state per request, and every request still
    gets exactly one answer. (A limit of one: any request handled while a placement awaits
    the broker's answer is shed. Work of 0 us frees the slots at once, so that placements,
    and their waits for the broker, come all through the flood: with 20 ms of work only the
    first two were placed, and a loop that let their PubAcks in before the next request,
    as a slow host's turns do, shed nothing.)"""
    async with plane(models=("calibrated",), slots=2, backend="torch",
                     router_overrides={"max_routing": 1, **UNREAD_BOUND}) as stack:
        nc = await nats.connect(stack.url)
        try:
            # Fewer than the subscription's pending limit (512), so none is dropped by nats-py
            # (answered with a fresh id: the drop leaves no headers, see design.md). Unread
            # until all are in the socket: read back to back, as a flood is.
            ledger = await flood(nc, 500, work_us=0, unread_s=0.2)
            await ledger.settle(20)
            assert ledger.unanswered() == [] and ledger.answered_twice() == []
            shed = stack.metrics.shed.labels("calibrated")._value.get()
            assert shed > 0, ledger.statuses()
            assert ledger.statuses()[200] > 0
            # Shed or not, each answer carries the caller's own request id.
            wrong = [i for i, a in ledger.answers.items()
                     if a[0].request_id != Ledger.request_id(i)]
            assert wrong == [], [ledger.answers[i][0].headers for i in wrong[:3]]
        finally:
            await nc.close()


def test_cycle_estimate_ages_out() -> None:
    """Samples a burst polluted (cycles of seconds) leave the estimate within its max age,
    even with no new sample; a window that does not age keeps them."""
    aging = ServiceWindow(prior_us=1000, max_age_s=2.0)
    for i in range(50):
        aging.add(600_000, now_s=10.0 + i * 0.001)
    assert aging.p99_us == 600_000
    aging.expire(11.0)
    assert aging.p99_us == 600_000  # not yet two seconds old
    aging.expire(12.1)
    assert aging.count == 0 and aging.p99_us == 1000 and aging.mean_us == 1000
    aging.add(1500, now_s=12.2)
    assert aging.p50_us == 1500


async def test_a_done_event_held_up_past_the_deadline_is_not_a_cycle() -> None:
    """A node's done-event that waited out a failover (its server died; the event sat in
    its reconnect buffer) comes seconds after the placement although the node answered
    within the deadline: the slot was free all along. Learnt as a cycle, those seconds
    refused every request `deadline` for the window's age (seen in the cluster test: "takes
    about 5017941 us (p99)" against a 1 s deadline)."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack:
        router = stack.routers[0]
        ms = router.models["calibrated"]
        now = time.monotonic()

        def placed(rid: str, ago_s: float) -> InFlight:
            return InFlight(request_id=rid, model="calibrated", reply="_INBOX.x", node="n",
                            key="n/0", placed_s=now - ago_s, tenant="default", subject="s",
                            stream="S", deadline_s=now - ago_s + 1.0,
                            answer_by_s=now - ago_s + 1.05, placing=False)

        def done(rid: str) -> DoneEvent:
            return DoneEvent(request_id=rid, node="n", model="calibrated", k=0, status=200,
                             service_us=1000)

        before = ms.window.count
        router._placed_done(ms, placed("held-up", 5.0), done("held-up"), now)
        assert ms.window.count == before
        router._placed_done(ms, placed("on-time", 0.004), done("on-time"), now)
        assert ms.window.count == before + 1


async def test_estimate_heals_after_a_burst() -> None:
    """After a burst that leaves the router's cycle estimate polluted, requests whose
    deadline fits the real service time are placed again within a few seconds (refusals add
    no samples: an estimate that never ages would refuse them for good)."""
    async with plane(models=("calibrated",), slots=2, backend="torch") as stack:
        router = stack.routers[0]
        ms = router.models["calibrated"]
        now = time.monotonic()
        for _ in range(256):  # what a loop seconds behind measured
            ms.window.add(900_000, now)
        assert ms.window.p99_us == 900_000
        nc = await nats.connect(stack.url)
        try:
            headers = {Header.DEADLINE_MS: "300"}
            first = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                     headers=headers)
            assert status(first) == 429 and header(first, Header.REASON) == "deadline"
            t_end = time.monotonic() + 5.0
            while True:
                m = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                     headers=headers)
                if status(m) == 200:
                    break
                assert time.monotonic() < t_end, "estimate never healed"
                await asyncio.sleep(0.1)
        finally:
            await nc.close()


def test_tickets_cannot_be_guessed() -> None:
    from plane.router.admission import new_ticket

    a, b = new_ticket("router0"), new_ticket("router0")
    assert a != b and ticket_owner(a) == "router0" == ticket_owner(b)
    assert len(a.rpartition("-")[2]) == TICKET_HEX
    assert ticket_owner("router0-1") is None and ticket_owner("router0-2") is None
    assert ticket_owner("r-host-00112233445566zz") is None


async def test_refusal_tickets_are_random() -> None:
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack:
        nc = await nats.connect(stack.url)
        try:
            msgs = await asyncio.gather(*(
                nc.request(NAMES.infer("calibrated"), calibrated(200_000), timeout=5,
                           headers={Header.DEADLINE_MS: "5000"}) for _ in range(4)))
            tickets = [header(m, Header.TICKET) for m in msgs if status(m) == 429]
            assert len(tickets) >= 2 and all(t is not None for t in tickets)
            assert all(ticket_owner(t or "") == "router0" for t in tickets)
            assert len(set(tickets)) == len(tickets)
        finally:
            await nc.close()


async def test_adverts_cannot_point_the_router_at_other_subjects() -> None:
    """A heartbeat from anyone naming a JetStream API subject as a slot: the router must never
    publish there (it places only on the subject the plane's names give a slot), and a
    heartbeat on one node's subject cannot speak for another node."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack:
        router = stack.routers[0]
        nc = await nats.connect(stack.url)
        try:
            evil = f"$JS.API.STREAM.PURGE.{NAMES.slots_stream}"
            calls: list[bytes] = []

            async def seen(m: nats.aio.msg.Msg) -> None:
                calls.append(m.data)

            spy = await nc.subscribe(evil, cb=seen)
            advert = NodeAdvert(node="evil", model="calibrated", backend="torch", at_ms=0,
                                slots=[SlotAdvert(k=0, subject=evil)])
            hb = Heartbeat(node="evil", at_ms=0, adverts=[advert])
            await nc.publish(NAMES.health("evil"), json_encoder.encode(hb))
            # The same advert on another node's heartbeat subject, under a well-formed name.
            good = NodeAdvert(node="ghost", model="calibrated", backend="torch", at_ms=0,
                              slots=[SlotAdvert(k=0, subject=NAMES.slot("calibrated", "ghost",
                                                                         0))])
            await nc.publish(NAMES.health("evil"),
                             json_encoder.encode(Heartbeat(node="ghost", at_ms=0,
                                                           adverts=[good])))
            await nc.flush()
            await asyncio.sleep(0.2)
            keys = set(router.models["calibrated"].slots)
            assert keys == {"node0-calibrated/0"}, keys
            for _ in range(10):
                m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
                assert status(m) == 200
            await nc.flush()
            assert calls == []
            await spy.unsubscribe()
            info = await nc.jetstream().stream_info(NAMES.slots_stream)
            assert info.config.name == NAMES.slots_stream
        finally:
            await nc.close()


async def test_a_restarted_router_knows_the_slots_before_it_takes_requests() -> None:
    """A router that joined the queue group before hearing the nodes' heartbeats answered
    its first requests 503 `no-capacity` after every restart (the soak saw hundreds)."""
    from plane.contract.config import RouterConfig
    from plane.router import Router

    async with plane(models=("calibrated",), slots=2, backend="torch") as stack:
        await stack.routers[0].stop()
        nc = await nats.connect(stack.url)
        router_nc = await nats.connect(stack.url)
        try:
            router = Router(router_nc, RouterConfig(router_id="router9"))
            await router.start()
            try:
                m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
                assert status(m) == 200, (status(m), header(m, Header.REASON))
            finally:
                await router.stop()
        finally:
            await router_nc.close()
            await nc.close()


async def test_a_stopping_router_answers_every_request_it_was_handed() -> None:
    """Requests the server has delivered to a router but the router has not read yet (in its
    socket and in the subscription's queue) when it is told to stop: nats-py's unsubscribe
    discards them and no one else can answer them (the soak lost one request per few router
    SIGTERMs). The router drains instead: each gets exactly one answer."""
    async with plane(models=("calibrated",), slots=2, backend="torch",
                     router_overrides=UNREAD_BOUND) as stack:
        router = stack.routers[0]
        nc = await nats.connect(stack.url)
        try:
            ledger = await flood(nc, 300, unread_s=0.2)
            await router.stop()
            await ledger.settle(10)
            assert ledger.unanswered() == [], (len(ledger.unanswered()), ledger.statuses())
            assert ledger.answered_twice() == []
        finally:
            await nc.close()


async def test_requests_past_the_pending_limit_are_refused_not_lost() -> None:
    """A burst read faster than the router handles it: past `max_pending` requests waiting
    in the subscription, nats-py drops a message (its default limit is half a million, which
    a burst turned into RSS that stayed); the router answers each dropped one 429 at once
    from its subject and reply. Every request gets exactly one answer."""
    async with plane(models=("calibrated",), slots=2, backend="torch",
                     router_overrides={"max_pending": 16, **UNREAD_BOUND}) as stack:
        nc = await nats.connect(stack.url)
        try:
            ledger = await flood(nc, 2000, unread_s=0.3)
            await ledger.settle(20)
            assert ledger.unanswered() == [] and ledger.answered_twice() == []
            shed = [i for i in ledger.answers if ledger.status(i) == 429
                    and not (ledger.first(i).msg.headers or {}).get(Header.REQUEST_ID, "")
                    .startswith("ledger-")]
            assert shed, ledger.statuses()  # answered from the drop: a fresh request id
            assert ledger.statuses()[200] > 0
        finally:
            await nc.close()
