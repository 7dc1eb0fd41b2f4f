"""The SDK as a newcomer meets it: a wrong URL fails fast with the SDK's own error naming the
URL (no traceback per reconnect attempt), and a call sends `Plane-Deadline-Ms` only when a
deadline was asked for (else the plane's live deadline for the model applies)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time

import nats
import pytest
from nats.aio.msg import Msg

from plane.client import (
    Client,
    ClientConfig,
    ConnectFailed,
    LocalCause,
    SyncClient,
    Unavailable,
)
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import ConnectionClosed
from plane.contract.messages import Reason, Status
from plane.contract.replies import error_reply, ok_headers
from plane.contract.streams import start_headers, token_headers
from plane.contract.subjects import Header, Names
from tests.plane_fixtures import wait_until

OUTAGE_S = 1.0  # the server is down this long while a call waits


def _dead_url() -> str:
    """A loopback port nobody listens on (bound, then closed: refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


PROBE = """
import asyncio, json, sys, time
from plane.client import Client, ConnectFailed, SyncClient
url = sys.argv[1]
out = {}
t0 = time.monotonic()
async def main():
    async with Client.connect(url) as plane:
        await plane.invoke("risk", {"features": [0.0] * 32})
try:
    asyncio.run(main())
except ConnectFailed as exc:
    out["async"] = {"message": str(exc), "url": exc.url, "s": time.monotonic() - t0}
t0 = time.monotonic()
try:
    with SyncClient(url) as plane:
        pass
except ConnectFailed as exc:
    out["sync"] = {"message": str(exc), "url": exc.url, "s": time.monotonic() - t0}
print(json.dumps(out))
"""


def test_a_wrong_url_fails_fast_with_one_clear_error() -> None:
    url = _dead_url()
    done = subprocess.run([sys.executable, "-c", PROBE, url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for kind in ("async", "sync"):
        assert out[kind]["url"] == url, out
        assert url in out[kind]["message"] and "plane up" in out[kind]["message"]
        assert out[kind]["s"] < 5, out
    # nats-py's default error callback logged a traceback for every attempt.
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) < 5, done.stderr


async def test_connect_failed_is_an_unavailable_and_a_connection_error() -> None:
    url = _dead_url()
    t0 = time.monotonic()
    with pytest.raises(ConnectFailed) as info:
        async with Client.connect(url, ClientConfig(connect_attempts=1)):
            pass
    assert time.monotonic() - t0 < 3
    assert isinstance(info.value, Unavailable) and isinstance(info.value, ConnectionError)
    assert info.value.url == url


async def test_deadline_is_sent_only_when_asked(nats_server: EmbeddedNats,
                                                seen: list[dict[str, str]]) -> None:
    body = {"duration_us": 1}
    async with Client.connect(nats_server.url) as plane:
        await plane.invoke("calibrated", body)
        await plane.invoke("calibrated", body, deadline_ms=80)
    config = ClientConfig(default_deadline_ms={"calibrated": 90})
    async with Client.connect(nats_server.url, config) as plane:
        await plane.invoke("calibrated", body)
        await plane.invoke("risk", {"features": [0.0] * 32})
    with SyncClient(nats_server.url) as sync:  # its loop thread; the stand-in runs on ours
        await asyncio.to_thread(sync.invoke, "calibrated", body)
    deadlines = [h.get(Header.DEADLINE_MS) for h in seen]
    assert deadlines[0] is None and deadlines[3] is None and deadlines[4] is None, deadlines
    assert deadlines[1] is not None and 1 <= int(deadlines[1]) <= 80
    assert deadlines[2] is not None and 1 <= int(deadlines[2]) <= 90


async def _stand_in(url: str, seen: list[dict[str, str]], **connect: object) -> nats.NATS:
    """A router stand-in: answers every `plane.infer.*` request 200, keeping its headers."""
    nc = await nats.connect(url, **connect)  # type: ignore[arg-type]

    async def answer(msg: Msg) -> None:
        h = dict(msg.headers or {})
        seen.append(h)
        await nc.publish(msg.reply, b'{"duration_us": 1}',
                         headers=ok_headers(h.get(Header.REQUEST_ID, "x"), "n1", 0, 1))

    await nc.subscribe(Names().infer_all(), cb=answer)
    await nc.flush()
    return nc

async def test_a_call_made_while_the_server_is_down_sends_the_deadline_it_has_left(
        nats_server: EmbeddedNats) -> None:
    """A call made during an outage is held by the SDK, not in nats-py's buffer, and goes out
    at the reconnect with what is left of its deadline: the router counts a budget from when
    it receives a request, and would otherwise give it time its caller no longer has."""
    headers: list[dict[str, str]] = []
    stand_in = await _stand_in(nats_server.url, headers, reconnect_time_wait=0.05,
                               max_reconnect_attempts=-1)
    try:
        async with Client.connect(nats_server.url) as plane:
            await nats_server.stop()
            await wait_until(lambda: plane.nc.is_reconnecting, 5, "the client to see it")
            call = asyncio.create_task(
                plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=5000))
            await asyncio.sleep(OUTAGE_S)
            await nats_server.start()
            await call
    finally:
        await stand_in.close()
    sent = int(headers[-1][Header.DEADLINE_MS])
    assert sent <= 5000 - OUTAGE_S * 1000, sent


async def test_a_call_sent_at_the_reconnect_waits_for_the_routers_to_come_back(
        nats_server: EmbeddedNats) -> None:
    """The routers reconnect on their own schedule: a call held through an outage and sent as
    the client's connection came back found no router yet, and failed 503 (CI). Now the SDK
    sends it again until they are back (within its deadline), and then it is answered."""
    seen: list[dict[str, str]] = []
    async with Client.connect(nats_server.url) as plane:
        await nats_server.stop()
        await wait_until(lambda: plane.nc.is_reconnecting, 5, "the client to see it")
        call = asyncio.create_task(
            plane.call("calibrated", {"duration_us": 1}, deadline_ms=5000))
        await asyncio.sleep(0.2)
        await nats_server.start()
        await wait_until(lambda: plane.nc.is_connected, 5, "the client back")
        await asyncio.sleep(0.3)  # the call finds nobody meanwhile
        assert not call.done()
        stand_in = await _stand_in(nats_server.url, seen)  # a router comes back
        try:
            result = await call
        finally:
            await stand_in.close()
    assert result.status == 200, result
    assert result.statuses[0] == 503 and len(result.statuses) >= 3, result.statuses
    assert len(seen) == 1, seen


async def test_no_router_on_a_steady_connection_is_a_503_at_once(
        nats_server: EmbeddedNats) -> None:
    """Without an outage, nobody listening means the plane is not there: one attempt, 503
    `no-capacity`, at once (not retried for the deadline's length)."""
    async with Client.connect(nats_server.url) as plane:
        result = await plane.call("calibrated", {"duration_us": 1}, deadline_ms=5000)
    assert result.status == 503 and result.statuses == (503,), result
    assert result.local and "no router listens" in result.body.decode()


async def test_a_connection_closed_under_a_call_and_a_stream_ends_them_at_once(
        nats_server: EmbeddedNats) -> None:
    """nats-py resolves nothing pending when its connection closes (it closes on its own on
    most of the server's errors): a call in flight, and a stream between two tokens, raise
    `ConnectionClosed` then, not after their minute-long deadlines. A scripted responder
    answers a stream's start and one token, and a call never."""
    peer = await nats.connect(nats_server.url)
    got = await _start_and_one_token(peer)
    try:
        async with Client.connect(nats_server.url) as plane:
            call = asyncio.create_task(
                plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=60_000))
            stream = plane.stream("tinylm", {"prompt": "hi", "max_tokens": 4},
                                  deadline_ms=60_000, stream_deadline_ms=60_000)
            pieces = stream.__aiter__()
            assert await pieces.__anext__() == "a"
            await wait_until(lambda: len(got) == 2, 5, "the call to reach the responder")
            await plane.nc.close()
            async with asyncio.timeout(10):  # each would wait a minute, unanswered
                with pytest.raises(ConnectionClosed):
                    await call
                with pytest.raises(Unavailable, match="the connection to the plane is closed"):
                    await pieces.__anext__()
            assert stream.status == 503 and stream.result is not None and stream.result.local
    finally:
        await peer.close()


async def test_a_connection_closed_while_a_refused_call_waits_ends_it_at_once(
        nats_server: EmbeddedNats) -> None:
    """A call refused with a long Retry-After and no ticket (nothing can call it back early)
    waits out the Retry-After before it tries again; a close meanwhile ends that wait at once:
    the next attempt could only fail."""
    peer = await nats.connect(nats_server.url)
    refused: list[str] = []

    async def refuse(msg: Msg) -> None:
        rid = (msg.headers or {})[Header.REQUEST_ID]
        body, headers = error_reply(rid, Status.BUSY, Reason.BUSY, "busy",
                                    retry_after_ms=30_000)
        refused.append(rid)
        await peer.publish(msg.reply, body, headers=headers)

    await peer.subscribe(Names().infer_all(), cb=refuse)
    try:
        async with Client.connect(nats_server.url) as plane:
            call = asyncio.create_task(
                plane.invoke("calibrated", {"duration_us": 1}, deadline_ms=60_000))
            await wait_until(lambda: len(refused) == 1, 5, "the call to be refused")
            await asyncio.sleep(0.1)  # into its 30 s pause
            began = time.monotonic()
            await plane.nc.close()
            async with asyncio.timeout(10):  # the pause alone is 30 s
                with pytest.raises(ConnectionClosed):
                    await call
            assert time.monotonic() - began < 10
            assert len(refused) == 1
    finally:
        await peer.close()


async def test_a_call_held_while_nats_is_down_ends_503_after_its_reconnect_wait(
        nats_server: EmbeddedNats) -> None:
    """`ClientConfig.reconnect_wait_ms` bounds how long an attempt waits for a lost connection
    (the gateway's HTTP callers are better told at once than held for the SDK's 30 s): then
    the call ends 503 `no-capacity` locally, its request id on it, and so does a stream."""
    config = ClientConfig(reconnect_wait_ms=300)
    async with Client.connect(nats_server.url, config) as plane:
        await nats_server.stop()
        await wait_until(lambda: plane.nc.is_reconnecting, 5, "the client to see it")
        t0 = time.monotonic()
        result = await plane.call("calibrated", {"duration_us": 1}, request_id="held-1")
        took = time.monotonic() - t0
        stream = plane.stream("tinylm", {"prompt": "x"}, raise_errors=False, request_id="held-2")
        await stream.start()
        await nats_server.start()
    assert result.status == 503 and result.reason == Reason.NO_CAPACITY and result.local
    assert result.headers[Header.REQUEST_ID] == "held-1" and "down" in result.body.decode()
    assert 0.3 <= took < 3.0, took  # not the 30 s of a call without a deadline
    assert stream.status == 503 and stream.result is not None and stream.result.local
    assert stream.result.headers[Header.REQUEST_ID] == "held-2"


async def test_an_answer_within_the_routers_grace_reaches_the_caller(
        nats_server: EmbeddedNats) -> None:
    """The router counts a deadline from its receipt and answers within its grace of it: an
    answer that comes a little after the caller's own deadline is still the caller's (the
    SDK made up a 504 for it: the gateway's HTTP callers got 504 for work done). Silence is
    a local 504 after `answer_margin_ms`, with the call's request id."""
    late_s = 0.03
    nc = await nats.connect(nats_server.url)

    async def late(msg: Msg) -> None:
        h = dict(msg.headers or {})
        await asyncio.sleep(int(h[Header.DEADLINE_MS]) / 1000 + late_s)
        await nc.publish(msg.reply, b'{"duration_us": 1}',
                         headers=ok_headers(h[Header.REQUEST_ID], "n1", 0, 1))

    async def silent(msg: Msg) -> None:
        return None

    await nc.subscribe(Names().infer("calibrated"), cb=late)
    await nc.subscribe(Names().infer("risk"), cb=silent)
    await nc.flush()
    try:
        async with Client.connect(nats_server.url, ClientConfig(answer_margin_ms=300)) as plane:
            answered = await plane.call("calibrated", {"duration_us": 1}, deadline_ms=50,
                                        request_id="late-1")
            t0 = time.monotonic()
            silent = await plane.call("risk", {"features": [0.0] * 32}, deadline_ms=50,
                                      request_id="silent-1")
            waited = time.monotonic() - t0
    finally:
        await nc.close()
    assert answered.status == 200 and not answered.local, answered
    assert silent.status == 504 and silent.local and silent.reason == Reason.DEADLINE
    assert silent.headers[Header.REQUEST_ID] == "silent-1"
    assert 0.05 + 0.3 <= waited < 2.0, waited


async def test_a_stream_refused_before_its_start_leaves_no_subscription(
        nats_server: EmbeddedNats) -> None:
    """A stream whose one message is a final refusal: its inbox is let go at once, not at
    an `aclose` the caller may never make (the gateway's refused streams each kept a
    subscription, its task and the stream, for good: found in review)."""
    nc = await nats.connect(nats_server.url)

    async def refuse(msg: Msg) -> None:
        body, headers = error_reply(dict(msg.headers or {})[Header.REQUEST_ID], Status.BUSY,
                                    Reason.DEADLINE, "none frees in time")
        await nc.publish(msg.reply, body, headers=headers)

    await nc.subscribe(Names().infer("tinylm"), cb=refuse)
    await nc.flush()
    try:
        async with Client.connect(nats_server.url) as plane:
            await plane.stream("tinylm", {"prompt": "x"}, raise_errors=False).start()
            before = len(plane.nc._subs)  # the client's own (its inbox for calls back)
            for _ in range(5):
                stream = plane.stream("tinylm", {"prompt": "x"}, raise_errors=False)
                assert not await stream.start() and stream.status == 429
            assert len(plane.nc._subs) == before
    finally:
        await nc.close()


async def test_with_end_on_disconnect_a_drop_ends_a_call_and_a_stream_in_flight_at_once(
        nats_server: EmbeddedNats) -> None:
    """`ClientConfig.end_on_disconnect` (the gateway's): a call and a started stream waiting
    when the server is killed end at once, a local 503 `unhealthy` (what the plane sent
    meanwhile is lost), not at their minute-long deadlines; a client without it still waits
    (in a cluster the connection may come back in time for the answer). A scripted
    responder answers a stream's start and one token, and a call never."""
    peer = await nats.connect(nats_server.url)
    got = await _start_and_one_token(peer)
    await peer.flush()
    ending = ClientConfig(end_on_disconnect=True)
    async with Client.connect(nats_server.url, ending) as plane, \
            Client.connect(nats_server.url) as waiting:
        call = asyncio.create_task(plane.call("calibrated", {"duration_us": 1},
                                              deadline_ms=60_000, request_id="drop-1"))
        held = asyncio.create_task(waiting.call("calibrated", {"duration_us": 1},
                                                deadline_ms=60_000))
        stream = plane.stream("tinylm", {"prompt": "hi", "max_tokens": 4}, deadline_ms=60_000,
                              stream_deadline_ms=60_000, raise_errors=False)
        pieces = stream.__aiter__()
        assert await pieces.__anext__() == "a"
        await wait_until(lambda: len(got) == 3, 5, "the calls to reach the responder")
        await peer.close()
        await nats_server.stop(kill=True)
        async with asyncio.timeout(10):  # each would wait a minute, unanswered
            result = await call
            with pytest.raises(StopAsyncIteration):
                await pieces.__anext__()
        assert result.status == 503 and result.local and result.reason == Reason.UNHEALTHY
        assert result.headers[Header.REQUEST_ID] == "drop-1"
        assert "connection to NATS dropped" in result.body.decode(), result.body
        assert stream.status == 503 and stream.result is not None and stream.result.local
        assert stream.result.reason == Reason.UNHEALTHY and stream.pieces == ["a"]
        assert "dropped mid-stream (node n1)" in stream.result.body.decode()
        await asyncio.sleep(0.5)
        assert not held.done()  # the default: it waits on for its deadline
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await nats_server.start()  # both clients close as usual


async def test_a_call_held_for_the_connection_until_its_deadline_says_so(
        nats_server: EmbeddedNats) -> None:
    """Without `reconnect_wait_ms` an attempt waits for a lost connection until the call's
    deadline: then it ends 504 as before, but says it was never sent for the connection's
    sake (`LocalCause.DISCONNECTED`), not "deadline passed before send", which a caller that
    counts outcomes (`plane pulse`) took for the plane's timeout."""
    async with Client.connect(nats_server.url) as plane:
        await nats_server.stop()
        await wait_until(lambda: plane.nc.is_reconnecting, 5, "the client to see it")
        result = await plane.call("calibrated", {"duration_us": 1}, deadline_ms=300)
        await nats_server.start()
    assert result.status == 504 and result.local and result.reason == Reason.DEADLINE
    assert result.local_cause == LocalCause.DISCONNECTED, result
    assert "connection to NATS stayed down" in result.body.decode(), result.body


async def _start_and_one_token(peer: nats.NATS) -> list[str]:
    """A scripted responder on `peer`: a stream's start and one token, a call never. The
    subjects it was asked on."""
    names = Names()
    got: list[str] = []

    async def answer(msg: Msg) -> None:
        got.append(msg.subject)
        rid = (msg.headers or {})[Header.REQUEST_ID]
        if Header.STREAM in (msg.headers or {}) and msg.reply:
            await peer.publish(msg.reply, b"", headers=start_headers(rid, "n1", 0,
                                                                     names.cancel("n1", 0)))
            await peer.publish(msg.reply, b"a", headers=token_headers(rid, 1))

    await peer.subscribe(names.infer_all(), cb=answer)
    return got


async def test_a_drop_wakes_its_wakers_each_time_and_a_close_wakes_its_own_once(
        nats_server: EmbeddedNats) -> None:
    """`OnDrop` keeps its wakers (the client's reply inbox waits on every drop) and leaves a
    close to `OnClose`, which wakes its own once and forgets them (a closed connection never
    opens again). Each waker is discarded as its waiter goes."""
    async with Client.connect(nats_server.url, ClientConfig(
            end_on_disconnect=True)) as plane:
        assert plane.on_drop is not None
        drops: list[str] = []
        closes: list[str] = []
        plane.on_drop.add("kept", lambda: drops.append("kept"))
        plane.on_drop.add("gone", lambda: drops.append("gone"))
        plane.on_drop.discard("gone")
        plane.on_close.add("waiter", lambda: closes.append("waiter"))
        for n in (1, 2):  # two outages: woken on each
            await nats_server.stop()
            await wait_until(lambda n=n: len(drops) == n, 10, f"drop {n} to wake its waker")
            await nats_server.start()
            await wait_until(lambda: plane.nc.is_connected, 10, "the reconnect")
        assert drops == ["kept", "kept"] and closes == []
        await plane.nc.close()
        await wait_until(lambda: closes == ["waiter"], 5, "the close to wake its waker")
        assert drops == ["kept", "kept"]  # a close is not a drop
        plane.on_close.end_all()  # again: forgotten, not woken twice
        assert closes == ["waiter"]
