"""The SDK against a scripted responder on a real nats-server: retries, tickets, node
avoidance, deadlines and typed errors, without needing a router."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from plane.client import Client, ClientConfig, SyncClient
from plane.contract.backoff import RetryPolicy
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import BadRequest, DeadlineExceeded, Rejected, Unavailable
from plane.contract.messages import Reason, Status
from plane.contract.replies import error_reply, now_ms, ok_headers
from plane.contract.subjects import Header, Names

Reply = tuple[bytes, dict[str, str]] | None  # None: stay silent
Script = Callable[[int, dict[str, str]], Reply]


@dataclass
class FakeRouter:
    """Answers `plane.infer.*` as `script(n, request_headers)` says; records what it saw."""

    nc: NATS
    script: Script = lambda n, h: None
    seen: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        self.seen.append(headers)
        reply = self.script(len(self.seen), headers)
        if reply is not None:
            await self.nc.publish(msg.reply, reply[0], headers=reply[1])


@pytest.fixture
async def router(nc: NATS) -> AsyncIterator[FakeRouter]:
    fake = FakeRouter(nc)
    sub = await nc.subscribe(Names().infer_all(), cb=fake.handle)
    yield fake
    await sub.unsubscribe()


@pytest.fixture
async def plane(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    config = ClientConfig(policy=RetryPolicy(max_attempts=4), seed=7)
    async with Client.connect(nats_server.url, config) as client:
        yield client


def busy(h: dict[str, str], *, after_ms: int, ticket: str = "t1", skew_ms: int = 0,
         reason: Reason = Reason.BUSY) -> Reply:
    body, headers = error_reply(h[Header.REQUEST_ID], Status.BUSY, reason, "all slots busy",
                                retry_after_ms=after_ms, ticket=ticket)
    headers[Header.SERVER_TIME] = str(now_ms() + skew_ms)
    return body, headers


def ok(h: dict[str, str]) -> Reply:
    return b'{"duration_us": 1}', ok_headers(h[Header.REQUEST_ID], "n2", 3, 1234)


async def test_ok_reports_where_it_ran(router: FakeRouter, plane: Client) -> None:
    router.script = lambda n, h: ok(h)
    r = await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=500)
    assert r.json() == {"duration_us": 1}
    assert (r.attempts, r.node, r.slot, r.service_us) == (1, "n2", 3, 1234)
    seen = router.seen[0]
    assert seen[Header.ATTEMPT] == "1"
    assert 400 < int(seen[Header.DEADLINE_MS]) <= 500
    assert seen[Header.REQUEST_ID] == r.request_id


async def test_429_waits_retry_after_and_sends_the_ticket_back(
    router: FakeRouter, plane: Client
) -> None:
    router.script = lambda n, h: busy(h, after_ms=60, ticket="tk-9") if n == 1 else ok(h)
    t0 = time.monotonic()
    r = await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=1000)
    assert (time.monotonic() - t0) * 1000 >= 60
    assert r.statuses == (429, 200) and r.refusals == 1 and r.attempts == 2
    assert r.waited_ms == 60  # a ticket is kept on the millisecond: no jitter
    second = router.seen[1]
    assert second[Header.TICKET] == "tk-9" and second[Header.ATTEMPT] == "2"
    assert second[Header.REQUEST_ID] == router.seen[0][Header.REQUEST_ID]


async def test_a_holder_called_back_comes_at_once_and_only_a_caller_that_retries_is_on_call(
    router: FakeRouter, plane: Client
) -> None:
    """The SDK gives its inbox (`Plane-Wake`) on every attempt another may follow, none on its
    last or with no retries; a call with its ticket brings it back before its Retry-After."""

    def script(n: int, h: dict[str, str]) -> Reply:
        if n == 1:
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(
                router.nc.publish(h[Header.WAKE], b"", headers={Header.TICKET: "tk-call"})))
            return busy(h, after_ms=2000, ticket="tk-call")
        return ok(h)

    router.script = script
    t0 = time.monotonic()
    r = await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=5000)
    assert r.statuses == (429, 200) and (time.monotonic() - t0) < 1.0  # not after 2 s
    assert 40 <= r.waited_ms < 1000 and router.seen[1][Header.TICKET] == "tk-call"
    assert plane.calls is not None
    assert router.seen[0][Header.WAKE] == router.seen[1][Header.WAKE] == plane.calls.subject
    router.seen.clear()
    router.script = lambda n, h: busy(h, after_ms=1, ticket=f"t{n}")
    await plane.call("calibrated", {"duration_us": 1}, deadline_ms=2000,
                     policy=RetryPolicy(max_attempts=2))
    assert [Header.WAKE in h for h in router.seen] == [True, False]  # none on the last
    router.seen.clear()
    await plane.call("calibrated", {"duration_us": 1}, deadline_ms=2000,
                     policy=RetryPolicy(max_attempts=1))
    assert [Header.WAKE in h for h in router.seen] == [False]  # never comes back


async def test_429_without_a_ticket_adds_a_jitter(router: FakeRouter, plane: Client) -> None:
    """A Retry-After without a ticket is an estimate every caller refused meanwhile got: a
    jitter keeps them from coming back on the same millisecond."""
    def script(n: int, h: dict[str, str]) -> Reply:
        if n > 1:
            return ok(h)
        body, headers = busy(h, after_ms=60)
        del headers[Header.TICKET]
        return body, headers

    router.script = script
    r = await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=1000)
    assert r.statuses == (429, 200) and 60 < r.waited_ms < 62  # seed 7's draw is not 0
    assert Header.TICKET not in router.seen[1]


async def test_skewed_server_clock_falls_back_to_backoff(router: FakeRouter, plane: Client) -> None:
    router.script = lambda n, h: busy(h, after_ms=800, skew_ms=10_000) if n == 1 else ok(h)
    r = await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=2000)
    assert r.attempts == 2 and r.waited_ms < 10  # base_ms, not the server's 800 ms


async def test_503_with_a_node_asks_for_another(router: FakeRouter, plane: Client) -> None:
    def script(n: int, h: dict[str, str]) -> Reply:
        if n == 1:
            return error_reply(h[Header.REQUEST_ID], Status.UNAVAILABLE, Reason.UNHEALTHY,
                               "slot died", node="n-sick")
        return ok(h)

    router.script = script
    r = await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=1000)
    assert r.statuses == (503, 200)
    assert Header.AVOID_NODE not in router.seen[0]
    assert router.seen[1][Header.AVOID_NODE] == "n-sick"


async def test_never_sleeps_past_the_deadline(router: FakeRouter, plane: Client) -> None:
    router.script = lambda n, h: busy(h, after_ms=5000)
    t0 = time.monotonic()
    with pytest.raises(Rejected) as info:
        await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=300)
    assert time.monotonic() - t0 < 0.2
    assert info.value.retry_after_ms == 5000 and info.value.attempts == 1


@pytest.mark.parametrize("reason", [Reason.DEADLINE, Reason.OVERLOADED])
async def test_a_final_refusal_is_not_retried(router: FakeRouter, plane: Client,
                                              reason: Reason) -> None:
    router.script = lambda n, h: busy(h, after_ms=5, reason=reason)
    with pytest.raises(Rejected) as info:
        await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=1000)
    assert info.value.reason == reason.value and len(router.seen) == 1


async def test_retries_are_bounded(router: FakeRouter, plane: Client) -> None:
    router.script = lambda n, h: busy(h, after_ms=5, ticket=f"t{n}")
    with pytest.raises(Rejected) as info:
        await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=1000)
    assert info.value.attempts == 4
    assert [h.get(Header.TICKET) for h in router.seen] == [None, "t1", "t2", "t3"]


@pytest.mark.parametrize(
    ("status", "reason", "error"),
    [
        (Status.BAD_REQUEST, Reason.BAD_REQUEST, BadRequest),
        (Status.TOO_LARGE, Reason.TOO_LARGE, BadRequest),
        (Status.DEADLINE, Reason.DEADLINE, DeadlineExceeded),
    ],
)
async def test_statuses_map_to_typed_errors(
    router: FakeRouter, plane: Client, status: Status, reason: Reason, error: type[Exception]
) -> None:
    router.script = lambda n, h: error_reply(h[Header.REQUEST_ID], status, reason, "nope")
    with pytest.raises(error) as info:
        await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=500)
    assert "nope" in str(info.value) and len(router.seen) == 1


async def test_silence_is_a_deadline_error_on_time(router: FakeRouter, plane: Client) -> None:
    """On time: the deadline, and the wait for an answer within the router's grace
    (`answer_margin_ms`), not longer."""
    router.script = lambda n, h: None
    margin_s = plane.config.answer_margin_ms / 1000
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=150)
    assert isinstance(info.value, TimeoutError)
    assert 0.14 + margin_s <= time.monotonic() - t0 < 0.3 + margin_s


async def test_nobody_listening_is_unavailable(plane: Client) -> None:
    with pytest.raises(Unavailable):
        await plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=500)


async def test_sync_client(router: FakeRouter, nats_server: EmbeddedNats) -> None:
    router.script = lambda n, h: busy(h, after_ms=20) if n == 1 else ok(h)

    def blocking() -> tuple[int, int | None]:
        with SyncClient(nats_server.url) as plane:
            r = plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=1000)
            return r.attempts, r.slot

    assert await asyncio.to_thread(blocking) == (2, 3)


async def test_leaving_after_the_server_went_away_is_clean() -> None:
    """The server stops while the caller is connected (`plane pulse` against a `plane up`
    that was stopped): leaving the `async with` / `with` closes, not raises (nats-py's drain
    raises ConnectionReconnectingError on a connection that is reconnecting)."""
    async with EmbeddedNats() as srv:
        async with Client.connect(srv.url) as plane:
            await srv.stop()
            async with asyncio.timeout(5):
                while plane.nc.is_connected:
                    await asyncio.sleep(0.01)
        assert plane.nc.is_closed

    async with EmbeddedNats() as srv:
        connected, server_gone = threading.Event(), threading.Event()

        def blocking() -> None:
            with SyncClient(srv.url) as sync_plane:
                connected.set()
                assert server_gone.wait(10)
                nc = sync_plane._client.nc if sync_plane._client is not None else None
                t_end = time.monotonic() + 5
                while nc is not None and nc.is_connected:
                    assert time.monotonic() < t_end
                    time.sleep(0.01)

        leaving = asyncio.create_task(asyncio.to_thread(blocking))
        async with asyncio.timeout(10):
            while not connected.is_set():
                await asyncio.sleep(0.01)
        await srv.stop()
        server_gone.set()
        await leaving


async def test_a_cancel_that_meets_the_answer_stops_the_call(router: FakeRouter,
                                                             plane: Client) -> None:
    """A call cancelled in the very turn its answer comes in ends cancelled, not retried.
    nats-py's `request` waited for the answer with `asyncio.wait_for`, which on Python 3.11
    drops such a cancel and returns the answer: the SDK's retry loop (or a caller's own loop,
    being stopped) then went on calling. The SDK now waits on the answer's own future
    (`plane.contract.reply_inbox`); the cancel is made to meet the answer here, not left to
    chance: it is sent from that future."""
    router.script = lambda n, h: busy(h, after_ms=5)  # a 429: the call would come back
    call = asyncio.create_task(plane.invoke("calibrated", {"duration_us": 0}))
    while not plane.replies._waiting:  # the request is out, its answer's future waiting
        await asyncio.sleep(0)
    [answer] = plane.replies._waiting.values()
    answer.add_done_callback(lambda _: call.cancel())
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.sleep(0.05)  # past its Retry-After: a dropped cancel would have retried
    assert len(router.seen) == 1


async def test_concurrent_calls_each_get_their_own_answer(nc: NATS, plane: Client) -> None:
    """Every call's reply comes on the client's one reply inbox (`plane.contract.reply_inbox`),
    told apart by its token: 200 calls in flight, answered in reverse order of arrival, each
    get the answer made for them (the responder puts the request id in the body), and the
    ids the client made for them are all different."""
    held: list[Msg] = []
    everyone = asyncio.Event()

    async def answer_backwards(msg: Msg) -> None:
        held.append(msg)
        if len(held) == 200:
            everyone.set()
            for m in reversed(held):
                rid = (m.headers or {})[Header.REQUEST_ID]
                await nc.publish(m.reply, rid.encode(), headers=ok_headers(rid, "n1", 0, 1))

    sub = await nc.subscribe(Names().infer_all(), cb=answer_backwards)
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(plane.call("calibrated", {"duration_us": 0}, deadline_ms=5000)
              for _ in range(200))), 10)
    finally:
        await sub.unsubscribe()
    assert everyone.is_set()
    assert [r.body.decode() for r in results] == [r.request_id for r in results]
    assert len({r.request_id for r in results}) == 200
    assert not plane.replies._waiting  # nothing left behind
