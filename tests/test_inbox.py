"""The order in which a router reads its requests (`plane.router.inbox`): in order while it
keeps up; once behind, ticket holders first, then the newest, the stale refused unread one
between two decisions; the loop let turn every TURN_EVERY_S of a run. Messages go through a
real server into a real subscription; the inbox's clock is ours, so the waits are exact."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time

import nats
import nats.errors
import pytest
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from plane.contract.embedded import EmbeddedNats
from plane.contract.messages import FINAL_REFUSALS, Reason
from plane.contract.publish import publish
from plane.contract.soon_flush import use_soon_flush
from plane.contract.subjects import Header
from plane.contract.taken_as_read import take_as_read
from plane.router.inbox import (
    INTERVAL_S,
    TARGET_S,
    TURN_EVERY_S,
    Inbox,
    stale,
    turn,
    turn_due,
)
from plane.router.requests import RequestPath
from tests.ledger import Answer, Ledger
from tests.plane_fixtures import NAMES, calibrated, client, plane, status


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def fill(nc: Client, sub: Subscription, subject: str,
               bodies: list[tuple[str, dict[str, str] | None]]) -> None:
    """Publish `bodies` in order and wait until the subscription holds them all."""
    for body, headers in bodies:
        await nc.publish(subject, body.encode(), headers=headers)
    await nc.flush()
    async with asyncio.timeout(5):
        while sub.pending_msgs < len(bodies):
            await asyncio.sleep(0.005)


async def requests_in_inbox(nc: Client, subject: str, clock: Clock,
                            headers: list[dict[str, str]]) -> tuple[Subscription, Subscription]:
    """`calibrated` requests with `headers`, in order, held by a subscription on `subject`
    that an Inbox on `clock` reads; and the subscription their answers come to."""
    sub = await nc.subscribe(subject)
    Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
    reply = nc.new_inbox()
    answers = await nc.subscribe(reply)
    for h in headers:
        await nc.publish(subject, calibrated(1000), reply=reply, headers=h)
    await nc.flush()
    async with asyncio.timeout(5):
        while sub.pending_msgs < len(headers):
            await asyncio.sleep(0.005)
    return sub, answers


def marked(msg: Msg) -> bool:
    """The inbox's test of a promise, for these tests: the header alone (the router's own,
    `RequestPath.read_first`, checks that the plane issued it:
    `test_the_router_reads_first_only_what_holds_a_promise_of_the_plane`)."""
    h = msg.headers or {}
    return Header.TICKET in h or Header.FORWARDED_BY in h


async def take(sub: Subscription, clock: Clock, step_s: float) -> Msg:
    clock.now += step_s
    return await sub.next_msg(timeout=1)


async def test_a_router_that_keeps_up_reads_in_order() -> None:
    async with plane(models=()) as stack, client(stack.url) as nc:
        clock = Clock()
        sub = await nc.subscribe("inbox.order")
        Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
        await fill(nc, sub, "inbox.order", [(str(i), None) for i in range(6)])
        # Each read 1 ms after the last: the oldest's wait stays under TARGET_S... and then
        # over it for less than INTERVAL_S (a queue that forms and clears): in order.
        got = [await take(sub, clock, 0.001) for _ in range(6)]
        assert [m.data.decode() for m in got] == [str(i) for i in range(6)]
        assert [stale(m) for m in got] == [None] * 6
        await fill(nc, sub, "inbox.order", [("a", None), ("b", None)])
        first = await take(sub, clock, TARGET_S + 0.001)  # waited past TARGET_S, not for long
        second = await take(sub, clock, 0.001)
        assert (first.data, second.data) == (b"a", b"b")
        assert stale(first) is None and stale(second) is None


async def test_behind_it_reads_the_newest_first_and_refuses_the_stale_one_at_a_time() -> None:
    async with plane(models=()) as stack, client(stack.url) as nc:
        clock = Clock()
        sub = await nc.subscribe("inbox.behind")
        inbox = Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
        await fill(nc, sub, "inbox.behind", [(str(i), None) for i in range(8)])
        assert inbox.behind_s() == 0.0
        # The oldest has waited 30 ms: over TARGET_S, but only just found so: still in order.
        m0 = await take(sub, clock, 0.030)
        assert m0.data == b"0" and stale(m0) is None
        # INTERVAL_S later it has been over for long enough: behind. The head (waited 55 ms,
        # over the 50 ms bound) is refused unread; then the newest is read; then the next
        # stale one; and so on, one refusal between two reads.
        clock.now += INTERVAL_S + 0.005
        got = []
        for _ in range(7):
            if len(got) == 6:  # one left: still behind
                assert abs(inbox.behind_s() - (INTERVAL_S + 0.005)) < 1e-9
            m = await take(sub, clock, 0.0)
            got.append((m.data.decode(), stale(m)))
        assert [body for body, _ in got] == ["1", "7", "2", "6", "3", "5", "4"]
        marks = dict(got)
        assert [b for b, mark in got if mark is not None] == ["1", "2", "3", "4"]
        waited, behind = marks["1"]  # type: ignore[misc]
        assert abs(waited - 0.055) < 1e-9 and abs(behind - (INTERVAL_S + 0.005)) < 1e-9
        # The queue cleared: not behind any more, however long nothing comes after it
        # (`plane status` said "behind for 1360 ms" of a router idle after one slow read).
        clock.now += 1.0
        assert inbox.behind_s() == 0.0


async def test_behind_a_caller_that_said_it_waits_is_decided_in_the_stale_turn() -> None:
    """A request whose caller said it waits for its start (`Plane-Wait-Ms`) longer than it
    has waited is read, oldest first, in the turn a stale one would be refused in, unmarked;
    past its own wait (or with a wait that is not valid) it is refused as any stale one."""
    async with plane(models=()) as stack, client(stack.url) as nc:
        clock = Clock()
        sub = await nc.subscribe("inbox.waits")
        Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
        await fill(nc, sub, "inbox.waits", [
            ("0", None), ("w1", {Header.WAIT_MS: "1000"}), ("w2", {Header.WAIT_MS: "60"}),
            ("w3", {Header.WAIT_MS: "1e3"}), ("4", None), ("5", None)])
        assert (await take(sub, clock, 0.030)).data == b"0"  # over TARGET_S: in order
        clock.now += INTERVAL_S + 0.050  # behind; each has waited 100 ms
        got = [await take(sub, clock, 0.0) for _ in range(5)]
        assert [m.data for m in got] == [b"w1", b"5", b"w2", b"4", b"w3"]
        assert [stale(m) is not None for m in got] == [False, False, True, False, True]


async def test_behind_ticket_holders_are_read_first_and_never_refused_for_their_wait() -> None:
    async with plane(models=()) as stack, client(stack.url) as nc:
        clock = Clock()
        sub = await nc.subscribe("inbox.holders")
        Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
        ticket = {Header.TICKET: "t1"}
        forwarded = {Header.FORWARDED_BY: "r2"}
        await fill(nc, sub, "inbox.holders", [
            ("0", None), ("h1", ticket), ("1", None), ("2", None), ("f1", forwarded),
            ("3", None)])
        # In order while keeping up, a holder at the head included (its bookkeeping follows).
        assert (await take(sub, clock, 0.001)).data == b"0"
        assert (await take(sub, clock, 0.001)).data == b"h1"
        clock.now += 0.1  # every one left has waited 100 ms: over the bound
        m1 = await take(sub, clock, 0.0)  # found over TARGET_S: still in order
        assert m1.data == b"1" and stale(m1) is None
        clock.now += INTERVAL_S + 0.001
        # Behind: the forwarded request first (a holder, though it came later), unmarked.
        f1 = await take(sub, clock, 0.0)
        assert f1.data == b"f1" and stale(f1) is None
        rest = [await take(sub, clock, 0.0) for _ in range(2)]
        assert [m.data for m in rest] == [b"2", b"3"]
        assert stale(rest[0]) is not None and stale(rest[1]) is None


async def test_past_its_pending_limit_the_inbox_still_queues_ticket_holders() -> None:
    """A queue at its pending limit (`max_pending`) drops a newcomer (nats-py answers it,
    `RequestPath.overflowed`) but still queues a ticket holder, as many as the limit again:
    dropped, a holder was answered without its promise (it cannot be told apart there)."""
    async with plane(models=()) as stack, client(stack.url) as nc:
        clock = Clock()
        sub = await nc.subscribe("inbox.full", pending_msgs_limit=4)
        Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
        await fill(nc, sub, "inbox.full", [(str(i), None) for i in range(4)])
        for body, h in [("n", None), *((f"h{i}", {Header.TICKET: f"t{i}"}) for i in range(6)),
                        ("n2", None)]:
            await nc.publish("inbox.full", body.encode(), headers=h)
        await nc.flush()
        await asyncio.sleep(0.2)
        got = []
        while sub.pending_msgs:
            got.append((await take(sub, clock, 0.001)).data.decode())
        assert got == ["0", "1", "2", "3", "h0", "h1", "h2", "h3"], got


async def test_the_router_reads_first_only_what_holds_a_promise_of_the_plane() -> None:
    """`RequestPath.read_first`, the router's own test: a ticket it issued, a forward on its
    own subject. A ticket-shaped string no router issued, or the forward's mark on the public
    subject, is a caller's claim: read in turn like any newcomer's (and refused for its wait
    when stale)."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        held = asyncio.create_task(nc.request(NAMES.infer("calibrated"), calibrated(400_000),
                                              timeout=5, headers={Header.DEADLINE_MS: "2000"}))
        await asyncio.sleep(0.1)  # it holds the only slot
        refused = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                   headers={Header.DEADLINE_MS: "2000"})
        ticket = (refused.headers or {})[Header.TICKET]
        public = NAMES.infer("calibrated")
        own = NAMES.router_infer(router.cfg.router_id, "calibrated")

        def msg(subject: str, headers: dict[str, str] | None) -> Msg:
            return Msg(nc, subject=subject, headers=headers)

        read_first = router.requests.read_first
        assert read_first(msg(public, {Header.TICKET: ticket}))
        assert not read_first(msg(public, {Header.TICKET: f"{router.cfg.router_id}-"
                                                         "0123456789abcdef"}))
        assert not read_first(msg(public, {Header.TICKET: "t1"}))
        assert not read_first(msg(public, {Header.FORWARDED_BY: "r2"}))
        assert read_first(msg(own, {Header.FORWARDED_BY: "r2"}))
        assert not read_first(msg(public, None))
        assert status(await held) == 200


async def test_a_run_of_reads_lets_the_loop_turn_every_turn_every_s() -> None:
    async with plane(models=()) as stack, client(stack.url) as nc:
        clock = Clock()
        sub = await nc.subscribe("inbox.turns")
        Inbox(sub, max_wait_s=0.05, read_first=marked, clock=clock)
        await fill(nc, sub, "inbox.turns", [(str(i), None) for i in range(6)])
        step = TURN_EVERY_S * 0.4
        turns = [turn_due(await take(sub, clock, step)) for _ in range(6)]
        # The first read follows a wait for messages (the loop turned); then every
        # TURN_EVERY_S of reads back to back, one is marked.
        assert turns == [False, False, False, True, False, False]
        await fill(nc, sub, "inbox.turns", [("after", None)])
        # The queue was emptied: its task waited for this one, so the loop turned.
        assert not turn_due(await take(sub, clock, 0.01))


async def a_read_set_off_during_a_turn(url: str) -> bool:
    """A done-event in the socket as a backlog turns (`turn`): read as it is read, it wakes a
    parked holder, who publishes. Whether that publish was written when the turn ended."""
    router = await nats.connect(url)
    try:
        use_soon_flush(router)
        woken = asyncio.get_running_loop().create_future()
        take_as_read(await router.subscribe("done"), lambda msg: woken.set_result(None))
        await router.flush()

        async def holder() -> None:
            await woken
            await publish(router, "slot", b"placed", {"Plane-Request-Id": "r1"})

        parked = asyncio.create_task(holder())
        await asyncio.sleep(0)  # it waits on its future
        # The backlog's run: the loop blocked while the node's done-event reaches our socket
        # (sent here on a blocking socket, so that nothing of it is read before the turn).
        publish_blocking(url, "done", b"{}")
        sock = router._transport._io_writer.transport.get_extra_info("socket")  # type: ignore[union-attr]
        readable, _, _ = select.select([sock], [], [], 10)  # the loop blocked, as by a backlog
        assert readable, "the done-event did not reach the router's socket"
        await turn()
        written = parked.done() and not router._pending
        await parked
        return written
    finally:
        await router.close()


def publish_blocking(url: str, subject: str, payload: bytes) -> None:
    """A core NATS publish on a plain socket, its PONG awaited: no event loop runs."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.recv(4096)  # INFO
        s.sendall(b'CONNECT {"verbose":false}\r\nPUB ' + subject.encode()
                  + b" %d\r\n" % len(payload) + payload + b"\r\nPING\r\n")
        got = b""
        while b"PONG" not in got:
            got += s.recv(4096)


def on_uvloop(url: str) -> bool:
    return uvloop.run(a_read_set_off_during_a_turn(url))


async def test_a_turn_lets_what_a_read_sets_off_run_to_its_write(
        nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backlog resumes only once the done-event read in the turn has woken the holder, the
    holder has published and the publish is on the socket, on the loop the tests use and on
    the one the plane runs (uvloop). A turn of one round leaves it all for later (the backlog
    runs first at each step)."""
    for _ in range(3):
        assert await a_read_set_off_during_a_turn(nats_server.url)
        assert await asyncio.to_thread(on_uvloop, nats_server.url)
    monkeypatch.setattr("plane.router.inbox.TURN_ROUNDS", 1)
    assert not await asyncio.to_thread(on_uvloop, nats_server.url)
    assert not await a_read_set_off_during_a_turn(nats_server.url)


async def test_the_router_refuses_a_stale_request_unread_with_its_wait() -> None:
    """A request the inbox marks stale reaches the real router: a 429 at once, final
    (`overloaded`: go elsewhere, no ticket to come back with), whose Retry-After is as long as
    it waited (longer than the router has been behind), the count of
    `plane_router_behind_total`, and nothing after it."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        clock = Clock()
        sub, answers = await requests_in_inbox(
            nc, "inbox.stale", clock, [{Header.REQUEST_ID: rid} for rid in ("a", "b", "c")])
        await take(sub, clock, 0.03)  # found over TARGET_S: in order
        clock.now += 0.5  # behind for 500 ms
        msg = await take(sub, clock, 0.0)
        assert stale(msg) is not None
        msg.subject = NAMES.infer("calibrated")  # as if it came on the router's subject
        await router.requests.on_request(msg)
        answer = await answers.next_msg(timeout=5)
        h = answer.headers or {}
        assert h[Header.STATUS] == "429" and h[Header.REASON] == "overloaded", h
        assert Reason(h[Header.REASON]) in FINAL_REFUSALS  # the SDK does not come back
        assert h[Header.REQUEST_ID] == "b"
        assert int(h[Header.RETRY_AFTER_MS]) == 530  # waited 530 ms; behind for 500
        assert Header.TICKET not in h
        assert "behind" in json.loads(answer.data)["error"]
        assert router.metrics.behind.labels("calibrated")._value.get() == 1
        # Its caller's wait is in the refusal decision time (it was left out: the slowest
        # refusals missing from the board's p99; found from outside).
        waits = router.metrics.registry.get_sample_value(
            "plane_router_decision_seconds_sum",
            {"model": "calibrated", "outcome": "refused-behind"})
        assert waits is not None and abs(waits - 0.53) < 0.01, waits
        with pytest.raises(nats.errors.TimeoutError):  # exactly one answer
            await answers.next_msg(timeout=0.3)


async def test_a_stale_request_past_its_own_deadline_is_refused_deadline() -> None:
    """Refused unread after its deadline had passed in the inbox: 429 `deadline` (go
    elsewhere now), the Retry-After still the router's; one within its deadline (the model's
    default, 1 s for `calibrated`) is refused `overloaded`, as any request refused unread."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        clock = Clock()
        asked = {"a": None, "b": "100", "c": None, "d": None}
        sub, answers = await requests_in_inbox(nc, "inbox.deadline", clock, [
            {Header.REQUEST_ID: rid} | ({Header.DEADLINE_MS: deadline} if deadline else {})
            for rid, deadline in asked.items()])
        await take(sub, clock, 0.03)  # "a", found over TARGET_S: in order
        clock.now += 0.3  # behind for 300 ms
        got = [await take(sub, clock, 0.0) for _ in range(3)]  # stale "b", newest "d", stale "c"
        assert [m.headers[Header.REQUEST_ID] for m in got] == ["b", "d", "c"]  # type: ignore[index]
        for msg in (got[0], got[2]):
            assert stale(msg) is not None
            msg.subject = NAMES.infer("calibrated")
            await router.requests.on_request(msg)
        first, second = [await answers.next_msg(timeout=5) for _ in range(2)]
        h1, h2 = first.headers or {}, second.headers or {}
        assert (h1[Header.REQUEST_ID], h1[Header.STATUS], h1[Header.REASON]) == (
            "b", "429", "deadline"), h1
        assert int(h1[Header.RETRY_AFTER_MS]) == 330  # waited 330 ms, past its 100
        assert "past its deadline of 100 ms" in json.loads(first.data)["error"]
        assert (h2[Header.REQUEST_ID], h2[Header.STATUS], h2[Header.REASON]) == (
            "c", "429", "overloaded"), h2
        assert router.metrics.behind.labels("calibrated")._value.get() == 2
        with pytest.raises(nats.errors.TimeoutError):  # exactly one answer each
            await answers.next_msg(timeout=0.3)


async def burst_at_a_slowed_router(nc: Client, n: int, deadline_ms: int,
                                   headers: dict[str, str] | None = None) -> Ledger:
    """`n` requests at once at the real router, its decisions slowed to 3 ms each (its CPU as
    the plane's limit); each answered exactly once."""
    decide = RequestPath._route_one

    async def slow(self: RequestPath, msg: Msg) -> None:
        end = time.perf_counter() + 0.003
        while time.perf_counter() < end:
            pass
        await decide(self, msg)

    ledger = await Ledger(nc).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RequestPath, "_route_one", slow)
        for _ in range(n):
            await ledger.send(NAMES.infer("calibrated"), calibrated(0), deadline_ms, headers)
        await nc.flush()
        await ledger.settle(30)
    assert ledger.unanswered() == [] and ledger.answered_twice() == []
    return ledger


def refused_unread(ledger: Ledger) -> list[Answer]:
    return [a for i in ledger.answers if (a := ledger.first(i)).status == 429
            and "behind" in json.loads(a.msg.data)["error"]]


async def test_a_router_behind_on_a_flood_answers_each_request_once() -> None:
    """A slowed router, 200 requests at once: it falls behind, refuses unread (429
    `overloaded`, "behind", a Retry-After of at least the bound) what waited past
    `max_inbox_wait_ms`, places the newest, and every request gets exactly one answer."""
    async with plane(models=("calibrated",), slots=4, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        ledger = await burst_at_a_slowed_router(nc, 200, 2000)
        unread = refused_unread(ledger)
        assert unread, ledger.statuses()
        assert ledger.statuses()[200] > 0, ledger.statuses()
        wait_ms = router.cfg.max_inbox_wait_ms
        assert all(int(a.headers[Header.RETRY_AFTER_MS]) >= wait_ms for a in unread)
        assert all(Header.TICKET not in a.headers and a.reason == "overloaded" for a in unread)
        assert router.metrics.behind.labels("calibrated")._value.get() == len(unread)


async def test_a_burst_whose_callers_said_they_wait_is_decided_not_refused_for_its_wait() -> None:
    """The same slowed router, 120 requests at once whose callers each said they wait up to
    5 s for their start (`Plane-Wait-Ms`, as a batch consumer's would): the router falls
    behind, but refuses none of them unread for its wait in its inbox: each is decided,
    exactly once: started within its wait, or refused as a decision refuses (a waiter holds a
    promise, and past the promises a slot may hold the book says `overloaded`). Refused
    unread, each would say "behind"."""
    async with plane(models=("calibrated",), slots=4, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        ledger = await burst_at_a_slowed_router(nc, 120, 8000, {Header.WAIT_MS: "5000"})
        assert not refused_unread(ledger)
        assert router.metrics.behind.labels("calibrated")._value.get() == 0
        assert ledger.statuses()[200] >= 60, ledger.statuses()
        assert all(a.status == 200 or (a.reason == "busy") == (Header.TICKET in a.headers)
                   for a in map(ledger.first, ledger.answers))
