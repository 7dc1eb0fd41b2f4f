"""The SDK's streams (`Client.stream`, `SyncClient.stream`) and a Node.js reader, against a
real plane (nats-server, router, a `tinylm` node with one slot, all in process).

A stream is held long by the node's own fault drill (`slow`: every token step sleeps), so
that a second caller finds the slot busy; each test that slows it says so.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from plane.client import Client, ClientConfig, SyncClient
from plane.contract.backoff import NO_RETRY, RetryPolicy
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import BadRequest, DeadlineExceeded, Rejected
from plane.contract.messages import (
    DoneEvent,
    Status,
    StreamEnd,
    Usage,
    read_done,
)
from plane.contract.streams import end_message, start_headers, token_headers
from plane.contract.subjects import Header
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import NAMES, listen, slots_running, wait_until
from tests.plane_fixtures import slow_steps as slow

MODEL = "tinylm"
NODE = "node0-tinylm"
PROMPT = "The plane"  # greedy from here never samples END: a stream runs to max_tokens
JS_DIR = Path(__file__).parent / "js"


@pytest.fixture
async def stack() -> AsyncIterator[PlaneStack]:
    async with PlaneStack(StackConfig(models=(MODEL,), slots=1, allow_faults=True)) as s:
        yield s


@pytest.fixture
async def plane(stack: PlaneStack) -> AsyncIterator[Client]:
    async with Client.connect(stack.url) as c:
        yield c


def ask(max_tokens: int, prompt: str = PROMPT) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens}




def done_events(msgs: list[Msg]) -> list[DoneEvent]:
    return [ev for m in msgs for ev in read_done(m.data, batch=NAMES.is_done_batch(m.subject))]


# -- a whole stream --------------------------------------------------------------------------
async def test_a_stream_yields_the_replys_text_piece_by_piece(plane: Client) -> None:
    whole = (await plane.invoke(MODEL, ask(120), deadline_ms=5000)).json()
    stream = plane.stream(MODEL, ask(120), deadline_ms=5000, stream_deadline_ms=10_000)
    pieces = [piece async for piece in stream]
    assert "".join(pieces) == whole["text"] == stream.text  # greedy: the same text
    assert len(pieces) >= 2 and all(pieces)  # read as it was made, not in one piece
    assert stream.finish_reason == "length" == whole["finish_reason"]
    assert stream.usage is not None and stream.usage.completion_tokens == 120
    assert stream.usage.prompt_tokens == len(PROMPT) and stream.usage.slot_us > 0
    assert stream.status == 200 and stream.result is not None and stream.result.attempts == 1
    assert stream.start_headers[Header.NODE] == NODE and stream.seq == len(pieces) + 1


async def test_async_with_exposes_the_start_and_the_end(plane: Client) -> None:
    async with plane.stream(MODEL, ask(8), deadline_ms=5000) as stream:
        assert stream.started and not stream.done
        assert stream.start_headers[Header.CANCEL_SUBJECT] == NAMES.cancel(NODE, 0)
        text = "".join([piece async for piece in stream])
    assert len(text) == 8 and stream.finish_reason == "length" and stream.done


# -- refusals, before the start --------------------------------------------------------------
async def test_a_busy_slot_is_refused_then_retried_with_its_ticket(
        stack: PlaneStack, plane: Client) -> None:
    await slow(plane.nc, 3000)  # ~0.3 s for 100 tokens
    # One slowed stream first, so that the router's per-token rates (learned from
    # done-events) predict the holder's end, and the Retry-After is worth trusting.
    async for _ in plane.stream(MODEL, ask(100), deadline_ms=5000):
        pass
    async with plane.stream(MODEL, ask(100), deadline_ms=5000) as holder:
        refused = plane.stream(MODEL, ask(4), deadline_ms=5000, policy=NO_RETRY)
        with pytest.raises(Rejected) as info:
            await refused.start()
        assert info.value.retry_after_ms > 0 and info.value.attempts == 1
        assert refused.result is not None and refused.result.headers.get(Header.TICKET)
        assert not refused.started and refused.pieces == []
        patient = plane.stream(MODEL, ask(4), deadline_ms=5000,
                               policy=RetryPolicy(max_attempts=6))
        text = "".join([piece async for piece in patient])
        assert len(text) == 4
        assert patient.result is not None and patient.result.statuses[0] == 429
        assert patient.result.statuses[-1] == 200 and patient.result.hinted >= 1
        assert holder.started
    await slow(plane.nc, 0)


async def test_a_holder_is_called_on_its_inbox_when_its_slot_frees_early(
        stack: PlaneStack, plane: Client) -> None:
    """`Plane-Wake`, read as any NATS client reads it: a ticket's holder that gave an inbox is
    called there (an empty message with its ticket) when the slot frees before its
    Retry-After, here a stream cancelled at its start; then the SDK, which does the same by
    itself, is back long before its Retry-After."""
    await slow(plane.nc, 3000)  # ~0.3 s for 100 tokens
    # The router's loop (this test's: the stack runs in-process) lags, as on a busy host or
    # at a start: it drops the cycle samples of the next second, but the stream's rates are
    # the node's own timings and are learned all the same.
    time.sleep(0.2)  # noqa: ASYNC251 (the lag is the point)
    await asyncio.sleep(0.15)  # the router's watchdog ticks and sees it
    async for _ in plane.stream(MODEL, ask(100), deadline_ms=5000):  # the router learns
        pass
    inbox = plane.nc.new_inbox()
    calls = await listen(plane.nc, inbox)
    async with plane.stream(MODEL, ask(100), deadline_ms=5000) as holder:
        assert holder.started
        refused = await plane.nc.request(
            NAMES.infer(MODEL), json.dumps(ask(4)).encode(), timeout=5,
            headers={Header.DEADLINE_MS: "5000", Header.WAKE: inbox})
        h = refused.headers or {}
        assert h[Header.STATUS] == "429" and h[Header.TICKET]
        retry_after_ms = int(h[Header.RETRY_AFTER_MS])
        assert retry_after_ms >= 150
        t0 = asyncio.get_running_loop().time()
    # Leaving the block cancels the stream: its slot frees within a token step.
    await wait_until(lambda: calls, retry_after_ms / 1000, "the early call")
    called_after_ms = (asyncio.get_running_loop().time() - t0) * 1000
    assert called_after_ms < retry_after_ms / 2, (called_after_ms, retry_after_ms)
    call = calls[0]
    assert call.data == b"" and (call.headers or {})[Header.TICKET] == h[Header.TICKET]
    back = await plane.nc.request(NAMES.infer(MODEL), json.dumps(ask(4)).encode(), timeout=5,
                                  headers={Header.TICKET: h[Header.TICKET]})
    assert (back.headers or {})[Header.STATUS] == "200"
    await asyncio.sleep(0.05)
    assert len(calls) == 1  # one call per promise

    # The SDK: a patient caller refused while a stream runs is back once it is cancelled.
    requests = await listen(plane.nc, NAMES.infer(MODEL))
    async with plane.stream(MODEL, ask(100), deadline_ms=5000) as holder:
        assert holder.started
        task = asyncio.create_task(plane.call(MODEL, ask(4), deadline_ms=5000))
        await wait_until(lambda: len(requests) == 2, 5, "the patient caller's first try")
        await asyncio.sleep(0.02)  # its 429 is back: it waits for its turn
    result = await asyncio.wait_for(task, 5)
    assert result.statuses == (429, 200), result.statuses
    assert plane.calls is not None
    assert (requests[1].headers or {})[Header.WAKE] == plane.calls.subject
    assert result.waited_ms < 150, result.waited_ms  # a 100-token stream's Retry-After: ~300
    await slow(plane.nc, 0)


async def test_closing_a_stream_that_waits_to_retry_sends_nothing_more(
        stack: PlaneStack, plane: Client) -> None:
    requests = await listen(plane.nc, NAMES.infer(MODEL))  # a copy of every request
    await slow(plane.nc, 3000)
    async for _ in plane.stream(MODEL, ask(100), deadline_ms=5000):  # the router learns
        pass
    async with plane.stream(MODEL, ask(100), deadline_ms=5000) as holder:
        assert holder.started
        waiting = plane.stream(MODEL, ask(4), deadline_ms=5000,
                               policy=RetryPolicy(max_attempts=5))
        task = asyncio.create_task(waiting.start())

        def sent() -> int:
            return sum(1 for m in requests
                       if (m.headers or {}).get(Header.REQUEST_ID) == waiting.request_id)

        await wait_until(lambda: waiting.statuses == (429,), 5, "the first refusal")
        await waiting.aclose()
        assert await asyncio.wait_for(task, 1) is False  # at once, not after its retries
        await asyncio.sleep(0.5)  # past its Retry-After: a retry would have gone out
        assert sent() == 1 and waiting.cancelled and not waiting.started
    await slow(plane.nc, 0)


async def test_a_bad_request_raises_unless_asked_not_to(plane: Client) -> None:
    with pytest.raises(BadRequest, match="context"):
        async for _ in plane.stream(MODEL, ask(255, prompt="x" * 10), deadline_ms=2000):
            pass
    quiet = plane.stream(MODEL, {"prompt": 1}, deadline_ms=2000, raise_errors=False)
    assert [piece async for piece in quiet] == []
    assert quiet.status == 400 and quiet.result is not None and not quiet.started
    with pytest.raises(BadRequest):  # the plane refuses a stream of a model that does not
        async for _ in plane.stream("risk", {"features": [0.0] * 32}, deadline_ms=2000):
            pass


# -- closing early -------------------------------------------------------------------------
async def test_leaving_the_loop_cancels_the_stream_and_frees_the_slot(
        stack: PlaneStack, plane: Client) -> None:
    """`break` out of `async with`, `break` out of a bare `async for`, and an exception in
    the loop: each sends one cancel naming the stream, and the node stops generating (its
    done-event counts far fewer tokens than asked) and frees the slot."""
    cancels = await listen(plane.nc, NAMES.cancel_all())
    dones = await listen(plane.nc, NAMES.done_all())
    await slow(plane.nc, 2000)  # 200 tokens: 0.4 s at least, if not cancelled

    async def with_block() -> str:
        async with plane.stream(MODEL, ask(200), deadline_ms=5000) as s:
            async for _ in s:
                break
        assert s.finish_reason == "cancelled" and s.status == 200
        return s.request_id

    async def bare_loop() -> str:
        s = plane.stream(MODEL, ask(200), deadline_ms=5000)
        async for _ in s:
            break
        return s.request_id

    async def raising() -> str:
        s = plane.stream(MODEL, ask(200), deadline_ms=5000)
        with pytest.raises(KeyError):
            async for _ in s:
                raise KeyError("the caller's own bug")
        return s.request_id

    async def stopped(rid: str, how: str) -> None:
        await wait_until(lambda: any(c.headers and c.headers.get(Header.REQUEST_ID) == rid
                                     for c in cancels), 5, f"the cancel of {how}")
        took_s = await wait_until(lambda: slots_running(stack) == 0, 5, "the slot to free")
        assert took_s < 0.3, how  # within a step or two, not the 0.4 s left
        await wait_until(lambda: any(d.request_id == rid for d in done_events(dones)), 5,
                         "the done-event")
        done = next(d for d in done_events(dones) if d.request_id == rid)
        assert done.tokens < 100, (how, done.tokens)

    for how in (with_block, bare_loop, raising):
        await stopped(await how(), how.__name__)
    assert all(c.subject == NAMES.cancel(NODE, 0) and c.data == b"" for c in cancels)
    await slow(plane.nc, 0)
    async with plane.stream(MODEL, ask(5), deadline_ms=5000) as after:  # the slot serves on
        assert len("".join([p async for p in after])) == 5


# -- a stream that goes silent ---------------------------------------------------------------
async def test_a_silent_stream_ends_with_a_clear_error_not_a_hang(
        nats_server: EmbeddedNats) -> None:
    """The plane always ends a stream; this checks the SDK's own bound in case it does not:
    a scripted responder on a real server sends a start, one token, then nothing."""
    peer = await nats.connect(nats_server.url)

    async def half_a_stream(msg: Msg) -> None:
        rid = (msg.headers or {})[Header.REQUEST_ID]
        assert msg.reply
        await peer.publish(msg.reply, b"", headers=start_headers(rid, "n1", 0,
                                                                 NAMES.cancel("n1", 0)))
        await peer.publish(msg.reply, b"a", headers=token_headers(rid, 1))

    await peer.subscribe(NAMES.infer(MODEL), cb=half_a_stream)
    cancels = await listen(peer, NAMES.cancel_all())
    try:
        async with Client.connect(nats_server.url, ClientConfig(stream_margin_ms=100)) as c:
            stream = c.stream(MODEL, ask(5), deadline_ms=200, stream_deadline_ms=300)
            pieces: list[str] = []
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(DeadlineExceeded, match="went silent"):
                async for piece in stream:
                    pieces.append(piece)
            assert pieces == ["a"] and 0.3 <= loop.time() - t0 < 2.0
            assert stream.status == 504 and stream.result is not None and stream.result.local
            await wait_until(lambda: len(cancels) == 1, 5, "the cancel of the silent stream")
    finally:
        await peer.close()


async def test_a_stream_whose_node_ends_it_is_read_to_its_end(nats_server: EmbeddedNats) -> None:
    """A non-200 `end` (the node's stream deadline) raises the SDK's error after the pieces
    read; `raise_errors=False` keeps it in `result`. Scripted node, real server: the real
    node's deadline end is tests/test_streams_node.py's."""
    peer = await nats.connect(nats_server.url)

    async def cut_short(msg: Msg) -> None:
        rid = (msg.headers or {})[Header.REQUEST_ID]
        assert msg.reply
        await peer.publish(msg.reply, b"", headers=start_headers(rid, "n1", 0,
                                                                 NAMES.cancel("n1", 0)))
        await peer.publish(msg.reply, b"ab", headers=token_headers(rid, 1))
        body, headers = end_message(rid, 2, Status.DEADLINE, StreamEnd(
            finish_reason="deadline", usage=Usage(prompt_tokens=1, completion_tokens=2),
            error="stream deadline passed", reason="deadline"), 1000)
        await peer.publish(msg.reply, body, headers=headers)

    await peer.subscribe(NAMES.infer(MODEL), cb=cut_short)
    try:
        async with Client.connect(nats_server.url) as c:
            stream = c.stream(MODEL, ask(5), deadline_ms=500)
            pieces: list[str] = []
            with pytest.raises(DeadlineExceeded, match="stream deadline passed"):
                async for piece in stream:
                    pieces.append(piece)
            assert pieces == ["ab"] and stream.finish_reason == "deadline"
            kept = c.stream(MODEL, ask(5), deadline_ms=500, raise_errors=False)
            assert [p async for p in kept] == ["ab"] and kept.status == 504
            assert kept.usage is not None and kept.usage.completion_tokens == 2
    finally:
        await peer.close()


# -- the blocking client ---------------------------------------------------------------------
async def test_the_sync_client_streams_and_cancels(stack: PlaneStack) -> None:
    admin = await nats.connect(stack.url)
    cancels = await listen(admin, NAMES.cancel_all())

    def blocking() -> tuple[str, str | None, str]:
        with SyncClient(stack.url) as plane:
            whole = plane.stream(MODEL, ask(30), deadline_ms=5000)
            text = "".join(whole)
            early = plane.stream(MODEL, ask(200), deadline_ms=5000, request_id="sync-early")
            for _ in early:
                break
            return text, whole.finish_reason, early.stream.request_id

    try:
        text, finish, rid = await asyncio.to_thread(blocking)
        assert len(text) == 30 and finish == "length"
        await wait_until(lambda: [c.headers.get(Header.REQUEST_ID) for c in cancels
                                  if c.headers] == [rid], 5, "the sync stream's cancel")
        await wait_until(lambda: slots_running(stack) == 0, 5, "the slot to free")
    finally:
        await admin.close()


# -- any language: Node.js reads a stream with a plain subscription --------------------------
async def test_nodejs_reads_a_stream_with_a_plain_subscription(stack: PlaneStack,
                                                                plane: Client) -> None:
    if shutil.which("node") is None or not (JS_DIR / "node_modules" / "@nats-io").exists():
        pytest.fail("Node.js client missing: run `make test` (it runs npm ci in tests/js)")
    expected = (await plane.invoke(MODEL, ask(40), deadline_ms=5000)).json()["text"]
    lines = await run_node_reader(stack.url, "40")
    kinds = [x["stream"] for x in lines]
    assert kinds[0] == "start" and kinds[-1] == "end" and set(kinds[1:-1]) == {"token"}
    assert [int(x["seq"]) for x in lines] == list(range(len(lines)))
    assert lines[0]["status"] == "200" and lines[0]["cancel"] == NAMES.cancel(NODE, 0)
    assert "".join(x["body"] for x in lines[1:-1]) == expected
    end = json.loads(lines[-1]["body"])
    assert lines[-1]["status"] == "200" and end["finish_reason"] == "length"
    assert end["usage"]["completion_tokens"] == 40
    # Its cancel after two token messages: the node ends the stream early, and since the
    # reader still listens, it says so in an `end` (finish `cancelled`, status 200).
    await slow(plane.nc, 2000)  # 200 tokens: 0.4 s at least, if not cancelled
    lines = await run_node_reader(stack.url, "200", cancel_after="2")
    end = json.loads(lines[-1]["body"])
    assert lines[-1]["stream"] == "end" and end["finish_reason"] == "cancelled"
    assert lines[-1]["status"] == "200" and end["usage"]["completion_tokens"] < 100
    await slow(plane.nc, 0)


async def test_nodejs_is_called_back_when_its_slot_frees(stack: PlaneStack,
                                                          plane: Client) -> None:
    """`Plane-Wake` from another ecosystem: a Node.js caller refused while a stream holds the
    slot gives its inbox, is called there with its ticket as soon as the stream is cancelled
    (long before its Retry-After), and is placed when it comes back with the ticket."""
    if shutil.which("node") is None or not (JS_DIR / "node_modules" / "@nats-io").exists():
        pytest.fail("Node.js client missing: run `make test` (it runs npm ci in tests/js)")
    await slow(plane.nc, 3000)  # ~0.3 s for 100 tokens
    async for _ in plane.stream(MODEL, ask(100), deadline_ms=5000):  # the router learns
        pass
    async with plane.stream(MODEL, ask(100), deadline_ms=5000) as holder:
        assert holder.started
        proc = await asyncio.create_subprocess_exec(
            "node", str(JS_DIR / "call_back.mjs"), stack.url, MODEL, json.dumps(ask(4)),
            cwd=JS_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        refused = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    # Leaving the block cancels the stream: its slot frees within a token step.
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    called, back = (json.loads(line) for line in out.decode().splitlines() if line.strip())
    assert refused["status"] == "429" and refused["ticket"], refused
    assert refused["retryAfterMs"] >= 150, refused
    assert called["calledWith"] == refused["ticket"], (called, refused)
    assert called["afterMs"] < refused["retryAfterMs"] / 2, (called, refused)
    assert back["status"] == "200"
    await slow(plane.nc, 0)


async def run_node_reader(url: str, max_tokens: str, cancel_after: str = "",
                          ) -> list[dict[str, str]]:
    args = [str(JS_DIR / "stream_plane.mjs"), url, PROMPT, max_tokens]
    proc = await asyncio.create_subprocess_exec(
        "node", *args, *([cancel_after] if cancel_after else []), cwd=JS_DIR,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]
