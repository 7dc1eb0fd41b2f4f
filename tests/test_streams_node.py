"""A node serves `tinylm`: one reply, or a stream (docs/design.md "Streams"), on a real
nats-server.

Most tests place slot messages themselves, as a router does (`place`), on a plane with no
router: they test the node's half of the contract alone (start, tokens, end; cancels; the
stream deadline; failures and withdrawals mid-stream). The last ones go through a real router.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError

from gpu_node.generation import Generation
from gpu_node.slot import ACK_WAIT_S
from gpu_node.streaming import EXTEND_ACK_S
from kernels.tinylm import TinyLM
from plane.contract import replies
from plane.contract.messages import (
    TINYLM_CONTEXT,
    DoneEvent,
    FaultCommand,
    StreamFinish,
    json_encoder,
    read_done,
)
from plane.contract.ownership import slot_ttl
from plane.contract.streams import Kind, StreamReader
from plane.contract.subjects import Header
from plane.stack import PlaneStack
from tests.plane_fixtures import NAMES, client, plane, wait_until

MODEL = "tinylm"
NODE = "node0-tinylm"
LONG_PROMPT = "abc"  # greedy from "abc" never samples END: a stream runs to max_tokens
DEPTH_FULL = 10077


def body(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                       "seed": seed}).encode()


def direct(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> str:
    """What kernels.tinylm generates for the request, with no plane around it."""
    lm = TinyLM.from_seed(0)
    s = lm.start(prompt.encode(), max_tokens, temperature, seed)
    out = bytearray()
    while (b := lm.step(s)) is not None:
        out.append(b)
    return out.decode()


@dataclass
class Stream:
    """What arrived on one inbox: every message, its arrival time, read by the one rule."""

    sub: Subscription
    reader: StreamReader = field(default_factory=StreamReader)
    msgs: list[Msg] = field(default_factory=list)
    at_s: list[float] = field(default_factory=list)

    async def next(self, timeout_s: float = 5.0) -> Kind:
        msg = await self.sub.next_msg(timeout=timeout_s)
        self.msgs.append(msg)
        self.at_s.append(time.monotonic())
        return self.reader.feed(msg.headers, msg.data)

    async def to_end(self, timeout_s: float = 5.0) -> Stream:
        while not self.reader.done:
            await self.next(timeout_s)
        return self

    async def nothing_more(self, wait_s: float = 0.2) -> None:
        with pytest.raises(TimeoutError):
            await self.sub.next_msg(timeout=wait_s)

    @property
    def text(self) -> str:
        return b"".join(m.data for m in self.msgs
                        if (m.headers or {}).get(Header.STREAM) == Kind.TOKEN).decode()


async def place(nc: Client, payload: bytes, rid: str, *, k: int = 0, stream: bool = True,
                ttft_ms: int = 2000, stream_ms: int = 5000) -> Stream:
    """Put a request on slot k's subject as a router does (its headers, its TTL) and return
    the caller's inbox. Retries while the subject is still full (the ack of the stream before
    is on its way into the slot stream)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    now = replies.now_ms()
    h = {Header.REPLY_TO: inbox, Header.REQUEST_ID: rid, Header.DEADLINE_AT: str(now + ttft_ms),
         Header.DEADLINE_MS: str(max(1, ttft_ms)), Header.WORK_US: "0", Header.ROUTER: "stand-in",
         Header.NATS_TTL: slot_ttl(stream_ms)}
    if stream:
        h[Header.STREAM] = "1"
        h[Header.STREAM_DEADLINE_AT] = str(now + stream_ms)
    js = nc.jetstream()
    for _ in range(50):
        try:
            await js.publish(NAMES.slot(MODEL, NODE, k), payload, stream=NAMES.slots_stream,
                             headers=h)
            return Stream(sub)
        except APIError as exc:
            if exc.err_code != DEPTH_FULL:
                raise
            await asyncio.sleep(0.0005)
    raise AssertionError("the slot's subject stayed full")


@asynccontextmanager
async def node_only(slots: int = 1) -> AsyncIterator[tuple[PlaneStack, Client,
                                                           list[DoneEvent]]]:
    """A tinylm node (torch backend, faults allowed) with no router, a caller's connection,
    and the done-events it publishes."""
    async with plane(models=(MODEL,), slots=slots, routers=0, backend="torch",
                     allow_faults=True) as stack, client(stack.url) as nc:
        done: list[DoneEvent] = []

        async def on_done(msg: Msg) -> None:
            done.extend(read_done(msg.data, batch=NAMES.is_done_batch(msg.subject)))

        await nc.subscribe(NAMES.done_all(), cb=on_done)
        await nc.flush()
        yield stack, nc, done


async def fault(nc: Client, mode: str, extra_us: int = 0, k: int = 0) -> None:
    ok = await nc.request(NAMES.fault(NODE), json_encoder.encode(
        FaultCommand(k=k, mode=mode, extra_us=extra_us)), timeout=2)
    assert ok.data == b"ok"


def end_headers(s: Stream) -> dict[str, str]:
    assert s.reader.final_headers is not None
    return dict(s.reader.final_headers)


# -- the node's half ------------------------------------------------------------------------
async def test_a_stream_arrives_in_order_and_its_text_is_the_one_replys() -> None:
    prompt, n, temp, seed = "hello", 48, 0.8, 7
    async with node_only() as (_, nc, done):
        s = await (await place(nc, body(prompt, n, temp, seed), "s-1")).to_end()
        one = await (await place(nc, body(prompt, n, temp, seed), "r-1", stream=False)).to_end()
        await wait_until(lambda: len(done) == 2, 2, "two done-events")
    kinds = [(m.headers or {}).get(Header.STREAM) for m in s.msgs]
    assert kinds[0] == "start" and kinds[-1] == "end" and set(kinds[1:-1]) == {"token"}
    start = s.reader.start
    assert start is not None
    assert start[Header.STATUS] == "200" and start[Header.REQUEST_ID] == "s-1"
    assert start[Header.NODE] == NODE and start[Header.SLOT] == "0"
    assert s.reader.cancel_subject == NAMES.cancel(NODE, 0)
    assert s.reader.status == 200 and s.reader.end is not None
    usage = s.reader.usage
    assert usage is not None and usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == len(s.text) > 0 and usage.slot_us > 0
    assert s.reader.end.finish_reason in ("stop", "length")
    # One reply for the same request (no Plane-Stream), and the model with no plane around it.
    assert len(one.msgs) == 1 and one.reader.status == 200
    reply = json.loads(one.msgs[0].data)
    assert reply["text"] == s.text == direct(prompt, n, temp, seed)
    assert reply["finish_reason"] == s.reader.end.finish_reason
    assert reply["usage"]["completion_tokens"] == usage.completion_tokens
    ev = next(e for e in done if e.request_id == "s-1")
    assert ev.status == 200 and ev.prompt_tokens == len(prompt)
    assert ev.tokens == usage.completion_tokens
    assert ev.prefill_us > 0 and ev.decode_us > 0
    assert ev.work_us == ev.prefill_us + ev.decode_us <= ev.service_us
    assert not ev.cut  # it ran to its own end: a measure of how far streams go


async def test_a_one_reply_request_gets_no_stream_messages() -> None:
    async with node_only() as (_, nc, done):
        s = await (await place(nc, body("The plane", 20), "r-1", stream=False)).to_end()
        await s.nothing_more(0.1)
    assert len(s.msgs) == 1 and s.reader.status == 200
    assert (s.msgs[0].headers or {}).get(Header.STREAM) is None
    reply = json.loads(s.msgs[0].data)
    assert reply["text"] == direct("The plane", 20) and reply["finish_reason"] == "length"
    assert reply["usage"]["prompt_tokens"] == 9 and reply["usage"]["completion_tokens"] == 20
    assert done[-1].tokens == 20 and done[-1].work_us == done[-1].prefill_us + done[-1].decode_us


async def test_bad_requests_are_one_plain_400() -> None:
    async with node_only() as (_, nc, _done):
        too_long = await (await place(nc, body("x" * 200, 100), "bad-1")).to_end()
        await too_long.nothing_more(0.1)
    assert len(too_long.msgs) == 1 and too_long.reader.status == 400
    assert (too_long.msgs[0].headers or {}).get(Header.STREAM) is None


async def test_a_cancel_frees_the_slot_within_a_token_step() -> None:
    """cancel -> the next stream's start on that slot, measured; the cancelled stream ends
    200 `cancelled` with the tokens it produced, and a cancel naming another request is
    ignored."""
    waits_ms: list[float] = []
    async with node_only() as (stack, nc, _done):
        gen = stack.nodes[0].slots[0].generator
        assert gen is not None
        # Once routers surely know the node: a stream fetched before that ends through the
        # broker and asks its router whether it answered (`plane.contract.ownership`), and
        # with no router here the first trial's end waited out that question's 1 s.
        standing = stack.nodes[0].standing
        await wait_until(lambda: time.monotonic() > standing.settled_s, 5, "the node settled")
        for i in range(5):
            s = await place(nc, body(LONG_PROMPT, 250), f"c-{i}")
            assert await s.next() is Kind.START
            assert await s.next() is Kind.TOKEN
            cancel = s.reader.cancel_subject
            assert cancel is not None
            await nc.publish(cancel, b"", headers={Header.REQUEST_ID: "someone-else"})
            await nc.publish(cancel, b"", headers={Header.REQUEST_ID: f"c-{i}"})
            cancelled_at = time.monotonic()
            await s.to_end()
            nxt = await place(nc, body("hello", 4), f"n-{i}")
            assert await nxt.next() is Kind.START
            waits_ms.append((nxt.at_s[0] - cancelled_at) * 1000)
            await nxt.to_end()
            end = s.reader.end
            assert s.reader.status == 200 and end is not None
            assert end.finish_reason == StreamFinish.CANCELLED
            assert end.usage.completion_tokens == len(s.text) < 250
        step_ms = gen.mean_step_s * 1000
        assert stack.nodes[0].streams.cancelled == 5
    print(f"\ncancel -> next stream's start on the slot: {[round(w, 2) for w in waits_ms]} "
          f"ms; a token step {step_ms:.3f} ms")
    # Freed at the cancel, not at the stream's end (250 tokens): every wait well under half
    # of that. The target (one step + 5 ms) is `benchmarks/streams.py`'s to measure; here,
    # on a shared 2-core box under the whole suite, the median within a few times it.
    assert max(waits_ms) < 0.5 * 250 * step_ms, waits_ms
    assert statistics.median(waits_ms) <= step_ms + 25, waits_ms


async def test_a_cancel_ends_the_stream_before_the_step_under_way_and_the_next_waits_for_it(
) -> None:
    """A cancel ends the stream (its `end`, its done-event) as soon as the node hears it, not
    when the generation's step under way is over: with 120 ms steps, well before. The next
    request on the slot then waits for that step on the slot's thread (no two computations at
    once) and generates exactly what it would alone."""
    step_s = 0.12  # under the supervisor's 200 ms of overrun: slow, not hung
    async with node_only() as (stack, nc, done):
        standing = stack.nodes[0].standing
        await wait_until(lambda: time.monotonic() > standing.settled_s, 5, "the node settled")
        await fault(nc, "slow", int(step_s * 1e6))
        s = await place(nc, body(LONG_PROMPT, 250), "early-1", stream_ms=30_000)
        assert await s.next(timeout_s=10) is Kind.START
        assert await s.next(timeout_s=10) is Kind.TOKEN, (s.reader.end, s.reader.final_headers)
        # Cancel inside a slow step: once one more has begun on the slot's thread (each step
        # stamps its start), it sleeps on for most of 120 ms.
        runner = stack.nodes[0].slots[0].runner
        seen = runner.call_started_s
        await wait_until(lambda: runner.call_started_s != seen, 2, "the next step's start")
        token_at = runner.call_started_s
        assert token_at is not None
        cancel = s.reader.cancel_subject
        assert cancel is not None
        await nc.publish(cancel, b"", headers={Header.REQUEST_ID: "early-1"})
        cancelled_at = time.monotonic()
        await fault(nc, "none")  # the step under way sleeps on; the next request's do not
        await s.to_end()
        ended_after_s = s.at_s[-1] - cancelled_at
        assert s.reader.status == 200 and s.reader.end is not None
        assert s.reader.end.finish_reason == StreamFinish.CANCELLED
        assert s.reader.end.usage.completion_tokens == len(s.text)
        ev = next(e for e in done if e.request_id == "early-1")
        # Its phases so far, for the router to learn rates from: the (slow) prefill ran.
        assert ev.status == 200 and ev.prompt_tokens == len(LONG_PROMPT), ev
        assert ev.prefill_us >= 0.8 * step_s * 1e6 and ev.tokens <= len(s.text), ev
        nxt = await place(nc, body("hello", 4), "early-2")
        await nxt.to_end(timeout_s=10)
        assert nxt.reader.status == 200 and nxt.text == direct("hello", 4)
        first_token_s = next(at for m, at in zip(nxt.msgs, nxt.at_s, strict=True)
                             if (m.headers or {}).get(Header.STREAM) == Kind.TOKEN) - token_at
    # The end came before the step under way was over (most of a step to run at the cancel);
    # the next stream's first token after it (from that step's start).
    assert ended_after_s < step_s / 2, ended_after_s
    assert first_token_s >= step_s * 0.9, first_token_s


async def test_a_caller_that_stops_reading_stops_its_stream() -> None:
    async with node_only() as (stack, nc, done):
        await fault(nc, "slow", 2000)  # 2 ms a token: the stream would take 0.5 s
        s = await place(nc, body(LONG_PROMPT, 250), "gone-1")
        assert await s.next() is Kind.START
        await s.sub.unsubscribe()
        await nc.flush()
        await wait_until(lambda: any(e.request_id == "gone-1" for e in done), 2,
                         "the stream's done-event")
    ev = next(e for e in done if e.request_id == "gone-1")
    assert ev.status == 200 and ev.tokens < 50 and ev.cut, ev
    assert stack.nodes[0].streams.readers_gone >= 1


async def test_a_caller_whose_connection_closes_stops_its_stream() -> None:
    async with node_only() as (stack, nc, done), client(stack.url) as caller:
        await fault(nc, "slow", 2000)
        s = await place(caller, body(LONG_PROMPT, 250), "closed-1")
        assert await s.next() is Kind.START
        await caller.close()
        await wait_until(lambda: any(e.request_id == "closed-1" for e in done), 2,
                         "the stream's done-event")
    ev = next(e for e in done if e.request_id == "closed-1")
    assert ev.status == 200 and ev.tokens < 50 and ev.cut, ev


async def test_the_stream_deadline_ends_it_504_with_the_usage_so_far() -> None:
    async with node_only() as (_, nc, done):
        await fault(nc, "slow", 2000)
        s = await (await place(nc, body(LONG_PROMPT, 250), "late-1", stream_ms=150)).to_end()
        await s.nothing_more(0.1)
    end = s.reader.end
    assert s.reader.status == 504 and end is not None
    assert end.finish_reason == StreamFinish.DEADLINE and end.reason == "deadline"
    assert 0 < end.usage.completion_tokens == len(s.text) < 250
    assert end_headers(s)[Header.REASON] == "deadline"
    assert done[-1].status == 504 and done[-1].tokens == end.usage.completion_tokens
    assert done[-1].cut


async def test_a_stream_past_its_ttft_deadline_is_refused_504_without_a_start() -> None:
    async with node_only() as (_, nc, _done):
        s = await (await place(nc, body("hello", 8), "ttft-1", ttft_ms=-5)).to_end()
        await s.nothing_more(0.1)
    assert s.reader.status == 504 and len(s.msgs) == 1 and s.reader.start is None


async def test_a_slot_that_fails_mid_stream_ends_it_503() -> None:
    async with node_only() as (_, nc, done):
        await fault(nc, "slow", 3000)
        s = await place(nc, body(LONG_PROMPT, 250), "fail-1")
        assert await s.next() is Kind.START
        assert await s.next() is Kind.TOKEN
        await fault(nc, "raise")
        await s.to_end()
        await s.nothing_more(0.1)
    end = s.reader.end
    assert s.reader.status == 503 and end is not None
    assert end.finish_reason == StreamFinish.ERROR and end.reason == "unhealthy"
    assert end.usage.completion_tokens == len(s.text) > 0
    assert any(e.request_id == "fail-1" and e.status == 503 for e in done)


async def test_a_slot_withdrawn_mid_stream_ends_it_503_and_stops_generating() -> None:
    async with node_only() as (stack, nc, _done):
        await fault(nc, "slow", 3000)
        s = await place(nc, body(LONG_PROMPT, 250), "wd-1")
        assert await s.next() is Kind.START
        assert await s.next() is Kind.TOKEN
        slot = stack.nodes[0].slots[0]
        await slot.withdraw("test")
        await s.to_end()
        await s.nothing_more(0.2)
        # The generation thread stopped at its next step: the slot's thread is free again.
        await slot.thread.run(lambda: None)
    assert s.reader.status == 503 and s.reader.end is not None
    assert s.reader.end.finish_reason == StreamFinish.ERROR


async def test_an_interpret_node_streams_what_the_torch_path_generates() -> None:
    """The `interpret` backend runs the Triton decode-attention kernel (in the interpreter):
    the same bytes as the torch path, token by token."""
    async with plane(models=(MODEL,), slots=1, routers=0, backend="interpret") as stack, \
            client(stack.url) as nc:
        assert stack.nodes[0].backend.name == "interpret"
        gen = stack.nodes[0].slots[0].generator
        assert gen is not None and gen.lm.use_kernel
        s = await (await place(nc, body("hello", 10, 0.8, 7), "i-1")).to_end(timeout_s=20)
    assert s.reader.status == 200 and s.text == direct("hello", 10, 0.8, 7)


async def test_a_long_stream_says_in_progress_to_keep_its_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot message stays unacked for the whole stream: the node tells the server the
    message is in progress (`+WPI` on its ack subject) every EXTEND_ACK_S, well within the
    consumer's ack wait, and acks it once, at the end."""
    assert EXTEND_ACK_S * 2 < ACK_WAIT_S
    monkeypatch.setattr("gpu_node.slot_generation.EXTEND_ACK_S", 0.05)
    async with node_only() as (_, nc, _done):
        acks: list[bytes] = []

        async def on_ack(msg: Msg) -> None:
            acks.append(msg.data)

        await nc.subscribe(f"$JS.ACK.{NAMES.slots_stream}.>", cb=on_ack)
        await fault(nc, "slow", 2000)  # 250 tokens: about 0.5 s
        s = await (await place(nc, body(LONG_PROMPT, 250), "long-1")).to_end()
        await nc.flush()
    assert s.reader.status == 200 and len(s.text) == 250
    assert acks.count(b"+WPI") >= 4, acks
    plain = (b"", b"+ACK")  # nats-py acks with an empty body
    assert acks[-1] in plain and sum(a in plain for a in acks) == 1, acks


def test_the_node_refuses_a_model_of_another_context() -> None:
    from dataclasses import replace

    from kernels.tinylm import TinyLMConfig, TinyLMWeights
    from plane.contract.errors import ConfigError

    small = TinyLMWeights.from_seed(0, replace(TinyLMConfig(), context=128))
    with pytest.raises(ConfigError, match=str(TINYLM_CONTEXT)):
        Generation(TinyLM(small, TinyLM.from_seed(0).device, use_kernel=False), "torch")


# -- through a real router ------------------------------------------------------------------
async def test_a_one_reply_request_through_the_router() -> None:
    async with plane(models=(MODEL,), slots=2, backend="torch") as stack, \
            client(stack.url) as nc:
        r = await nc.request(NAMES.infer(MODEL), body("The plane", 24, 0.8, 7), timeout=5)
    assert r.headers is not None and r.headers[Header.STATUS] == "200"
    reply = json.loads(r.data)
    assert reply["text"] == direct("The plane", 24, 0.8, 7)


async def _stream_via_router(nc: Client, payload: bytes, rid: str) -> Stream:
    inbox = nc.new_inbox()
    s = Stream(await nc.subscribe(inbox))
    await nc.publish(NAMES.infer(MODEL), payload, reply=inbox,
                     headers={Header.STREAM: "1", Header.REQUEST_ID: rid,
                              Header.DEADLINE_MS: "2000"})
    return s


async def test_a_stream_through_the_router() -> None:
    async with plane(models=(MODEL,), slots=2, backend="torch") as stack, \
            client(stack.url) as nc:
        s = await (await _stream_via_router(nc, body("hello", 40, 0.8, 7), "via-1")).to_end()
        await s.nothing_more(0.1)
    assert s.reader.start is not None, "the router placed it as a one-reply request"
    assert s.reader.status == 200 and s.text == direct("hello", 40, 0.8, 7)


async def test_a_cancelled_stream_through_the_router_frees_its_slot_for_the_next() -> None:
    async with plane(models=(MODEL,), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        s = await _stream_via_router(nc, body(LONG_PROMPT, 250), "via-c")
        assert await s.next() is Kind.START
        assert await s.next() is Kind.TOKEN
        cancel = s.reader.cancel_subject
        assert cancel is not None
        await nc.publish(cancel, b"", headers={Header.REQUEST_ID: "via-c"})
        await s.to_end()
        nxt = await (await _stream_via_router(nc, body("hello", 8), "via-n")).to_end()
    assert s.reader.end is not None and s.reader.end.finish_reason == StreamFinish.CANCELLED
    assert nxt.reader.status == 200 and nxt.reader.start is not None
    assert nxt.reader.start[Header.SLOT] == "0"
    # What Prometheus sees of the two: how each ended, every token sent, a first token each.
    sample = stack.metrics.registry.get_sample_value
    model = {"model": MODEL}
    assert sample("plane_streams_total", {**model, "finish": "cancelled"}) == 1
    assert sample("plane_streams_total", {**model, "finish": "length"}) == 1
    assert s.reader.usage is not None and nxt.reader.usage is not None
    sent = s.reader.usage.completion_tokens + nxt.reader.usage.completion_tokens
    assert sample("plane_stream_tokens_total", model) == sent == len(s.text) + 8
    assert sample("plane_stream_first_token_seconds_count", model) == 2
    # Time per token after the first message: one sample per stream that sent tokens in more
    # than one message (a loop that wakes late sends what the slot made meanwhile in one:
    # on a busy host, all of a short stream's tokens at once).
    token_msgs = [sum(1 for m in x.msgs if (m.headers or {}).get(Header.STREAM) == Kind.TOKEN)
                  for x in (s, nxt)]
    timed = sum(1 for n in token_msgs if n > 1)
    assert sample("plane_stream_token_seconds_count", model) == timed, token_msgs
    if timed:
        per_token = sample("plane_stream_token_seconds_sum", model) or 0.0
        assert 0 < per_token / timed < 0.05
