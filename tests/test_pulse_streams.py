"""pulse for streams: its figures on known inputs (pure), its reader and retries against a
stand-in streaming responder on a real nats-server, and one short run against a real plane
serving `tinylm` (TTFT and TPOT reported, every stream ended by exactly one final message)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from plane.contract.backoff import RetryPolicy
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.messages import Status, StreamEnd, Usage
from plane.contract.replies import now_ms
from plane.contract.streams import end_message, start_headers, token_headers
from plane.contract.subjects import Header
from plane.pulse.runner import LoadConfig
from plane.pulse.stream_api import pulse_streams
from plane.pulse.stream_outcome import TIMEOUT, StreamOutcome
from plane.pulse.stream_runner import closed_loop, poisson_offsets_s, run_streams
from plane.pulse.stream_series import stream_seconds
from plane.pulse.stream_summary import (
    INCONCLUSIVE,
    MET,
    NOT_MET,
    percentiles_ms,
    summarize_streams,
)
from plane.pulse.stream_target import StreamSpec, StreamTarget
from tests.plane_fixtures import NAMES, client

PLANE = str(Path(sys.executable).parent / "plane")


def streamed(scheduled_s: float, first_token_s: float, tpot_s: float, tokens: int, *,
             statuses: tuple[int, ...] = (200,), accepted_s: float | None = None,
             reasons: tuple[str, ...] | None = None, deadline_ms: int | None = None
             ) -> StreamOutcome:
    """A stream that ran: `tokens` one per message, the first at `first_token_s`."""
    token_s = tuple(first_token_s + i * tpot_s for i in range(tokens))
    return StreamOutcome(
        scheduled_s=scheduled_s, sent_s=scheduled_s,
        accepted_s=scheduled_s if accepted_s is None else accepted_s,
        start_s=first_token_s - 0.001, token_s=token_s, token_n=(1,) * tokens,
        end_s=token_s[-1] + 0.001, statuses=statuses,
        reasons=reasons or ("",) * len(statuses), final=str(statuses[-1]), finish="length",
        hinted=statuses.count(429), stream_deadline_ms=deadline_ms)


def refused(scheduled_s: float, *, reasons: tuple[str, ...] = ("busy",)) -> StreamOutcome:
    n = len(reasons)
    return StreamOutcome(scheduled_s=scheduled_s, sent_s=scheduled_s,
                         end_s=scheduled_s + 0.001 * n, statuses=(429,) * n, reasons=reasons,
                         final="429", hinted=n)


# -- the figures of one stream ---------------------------------------------------------------
def test_one_streams_figures() -> None:
    o = streamed(1.0, 1.020, 0.002, 5)
    assert o.ttft_s == pytest.approx(0.020) and o.e2e_ttft_s == pytest.approx(0.020)
    assert o.tpot_s == pytest.approx(0.002) and o.tokens == 5
    assert o.gaps_s == pytest.approx([0.002] * 4)
    assert o.accepted and o.started and o.within_deadline and not o.first_refused


def test_ttft_of_a_retried_stream_runs_from_the_attempt_let_in() -> None:
    """The wait announced by Retry-After is not hidden in TTFT; the end to end one has it."""
    o = streamed(1.0, 1.530, 0.002, 3, statuses=(429, 200), accepted_s=1.500)
    assert o.ttft_s == pytest.approx(0.030)
    assert o.e2e_ttft_s == pytest.approx(0.530)
    assert o.first_refused and o.attempts == 2


def test_tpot_counts_tokens_not_messages() -> None:
    """Three messages of 1, 2 and 3 tokens over 10 ms: 5 tokens after the first message."""
    o = StreamOutcome(scheduled_s=0.0, sent_s=0.0, accepted_s=0.0, start_s=0.001,
                      token_s=(0.002, 0.007, 0.012), token_n=(1, 2, 3), end_s=0.013,
                      statuses=(200,), final="200")
    assert o.tokens == 6 and o.tpot_s == pytest.approx(0.010 / 5)
    one = StreamOutcome(scheduled_s=0.0, sent_s=0.0, accepted_s=0.0, start_s=0.001,
                        token_s=(0.002,), token_n=(1,), end_s=0.003, statuses=(200,),
                        final="200")
    assert one.tpot_s is None and one.ttft_s == pytest.approx(0.002)


def test_within_deadline() -> None:
    """With a stream deadline sent: by it, from the first send; without: a 200 end."""
    assert streamed(0.0, 0.010, 0.010, 10, deadline_ms=200).within_deadline  # ends at 0.101
    assert not streamed(0.0, 0.010, 0.010, 10, deadline_ms=100).within_deadline
    late = msgspec.structs.replace(streamed(0.0, 0.01, 0.01, 3), final="504",
                                   statuses=(504,), finish="deadline")
    assert late.accepted and not late.within_deadline
    lost = StreamOutcome(scheduled_s=0.0, sent_s=0.0, accepted_s=0.0, statuses=(0,),
                         final=TIMEOUT)
    assert lost.accepted and not lost.within_deadline and lost.ttft_s is None
    assert not refused(0.0).accepted


# -- the summary ---------------------------------------------------------------------------
def test_percentiles_are_nearest_rank_in_ms() -> None:
    p = percentiles_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (p.n, p.p50_ms, p.p99_ms, p.max_ms) == (100, 51.0, 100.0, 100.0)
    assert p.p99_over_p50 == pytest.approx(100 / 51)
    assert percentiles_ms([]).p99_over_p50 is None


def test_summary_of_a_known_run() -> None:
    """100 streams let in (TTFT 10 ms, one at 50; TPOT 2 ms, one at 4), 10 refused at first
    try: 8 let in at the first retry, 1 at the second, 1 refused to the end."""
    ok = [streamed(i * 0.1, i * 0.1 + (0.050 if i == 7 else 0.010),
                   0.004 if i == 3 else 0.002, 10) for i in range(100)]
    retried_ok = [streamed(10 + i * 0.1, 10 + i * 0.1 + 0.111, 0.002, 10, statuses=(429, 200),
                           accepted_s=10 + i * 0.1 + 0.100, reasons=("busy", ""))
                  for i in range(8)]
    twice = streamed(11.0, 11.311, 0.002, 10, statuses=(429, 429, 200),
                     accepted_s=11.300, reasons=("busy", "busy", ""))
    never = refused(12.0, reasons=("deadline",))
    outcomes = [*ok, *retried_ok, twice, never]
    s = summarize_streams(outcomes, target="t", rate=10, duration_s=12, elapsed_s=12.5,
                          deadline_ms=None, stream_deadline_ms=None, dropped=2)
    assert (s.sent, s.accepted, s.started, s.dropped) == (112, 109, 109, 2)
    assert s.ttft.p50_ms == pytest.approx(10.0) and s.ttft.max_ms == pytest.approx(50.0)
    assert s.ttft.p99_ms == pytest.approx(11.0)  # the retried ones, from their accepted send
    assert s.ttft_p99_over_p50 == pytest.approx(1.1)
    assert s.tpot.p50_ms == pytest.approx(2.0) and s.tpot.max_ms == pytest.approx(4.0)
    assert s.tokens == 1090 and s.tokens_per_s == pytest.approx(1090 / 12.5)
    assert s.status_counts == {"200": 109, "429": 1}
    assert s.refused_first == 10 and s.refused_by_reason == {"busy": 9, "deadline": 1}
    assert s.refused_final_by_reason == {"deadline": 1}
    assert s.first_retry_success == pytest.approx(8 / 9)
    # Over the 9 that came back: the one refused to the end made no retry to count.
    assert s.mean_retries == pytest.approx((8 * 1 + 2) / 9)
    assert s.retry_after_share == 1.0
    assert s.within_deadline == 109 and s.within_deadline_share == 1.0
    assert s.verdict == NOT_MET  # first-retry success 88.9% < 99.5%
    by_name = {c.name: c.met for c in s.checks}
    assert by_name == {"accepted TTFT p99/p50": True, "TPOT p99/p50": True,
                       "accepted within stream deadline": True, "first-retry success": False}


def test_verdicts() -> None:
    steady = [streamed(i * 0.1, i * 0.1 + 0.010, 0.002, 5) for i in range(50)]
    s = summarize_streams(steady, target="t", rate=10, duration_s=5, elapsed_s=5,
                          deadline_ms=None, stream_deadline_ms=None)
    assert s.verdict == MET and s.first_retry_success is None
    assert any("nothing to measure" in r for r in s.verdict_reasons)
    # TTFT that doubles for the last quarter: a queue in front of the first token.
    queued = [streamed(i * 0.1, i * 0.1 + (0.010 if i < 150 else 0.025), 0.002, 5)
              for i in range(200)]
    s = summarize_streams(queued, target="t", rate=10, duration_s=20, elapsed_s=20,
                          deadline_ms=None, stream_deadline_ms=None)
    assert s.verdict == NOT_MET and s.ttft_p99_over_p50 == pytest.approx(2.5)
    s = summarize_streams([refused(0.0)], target="t", rate=1, duration_s=1, elapsed_s=1,
                          deadline_ms=None, stream_deadline_ms=None)
    assert s.verdict == INCONCLUSIVE and s.accepted == 0


def test_per_second_series() -> None:
    outcomes = [streamed(0.2, 0.25, 0.1, 10), streamed(1.5, 1.52, 0.01, 4), refused(1.7)]
    secs = stream_seconds(outcomes)
    assert [s.arrivals for s in secs] == [1, 2]
    assert [s.refused for s in secs] == [0, 1]
    assert [s.tokens for s in secs] == [8, 6]  # 0.25..0.95 -> 8; 1.05, 1.15 + 4 at 1.5x
    assert secs[0].ttft_p50_ms == pytest.approx(50.0)
    assert secs[1].tpot_p99_ms == pytest.approx(10.0)


def test_poisson_arrivals() -> None:
    offsets = poisson_offsets_s(50.0, 200.0, random.Random(7))
    assert offsets == sorted(offsets) and offsets[0] > 0 and offsets[-1] < 200.0
    assert len(offsets) == pytest.approx(10_000, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    # Exponential gaps: the share above the mean is e^-1 (evenly spaced arrivals: 0 or 1).
    assert sum(g > 0.02 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.02)
    assert poisson_offsets_s(50.0, 200.0, random.Random(7)) == offsets


# -- against a stand-in streaming responder on a real nats-server ---------------------------
TOKENS = 6
STEP_S = 0.010
PROBE = "probe"  # the request id of the fixture's reachability probe (answered, not recorded)


@pytest.fixture
async def streamer(nats_server: EmbeddedNats) -> AsyncIterator[dict[str, list[Msg]]]:
    """Answers `plane.infer.tinylm` as a node would answer a stream, on the request's inbox:
    a first attempt without a ticket is refused (429, Retry-After-Ms 20, a ticket); with a
    ticket: start, TOKENS tokens STEP_S apart, end. A request id starting `gap-` gets a token
    sequence with a hole in it; a cancel (on the start's cancel subject) ends the stream
    with `cancelled`."""
    seen: dict[str, list[Msg]] = {"requests": [], "cancels": []}
    cancelled: set[str] = set()
    async with client(nats_server.url) as nc:
        async def stream(msg: Msg) -> None:
            h = msg.headers or {}
            rid = h[Header.REQUEST_ID]
            if Header.TICKET not in h:
                await nc.publish(msg.reply, b'{"error": "busy", "reason": "busy"}', headers={
                    Header.STATUS: "429", Header.REASON: "busy", Header.RETRY_AFTER_MS: "20",
                    Header.TICKET: f"t-{rid}", Header.SERVER_TIME: str(now_ms()),
                    Header.REQUEST_ID: rid})
                return
            await nc.publish(msg.reply, b"", headers=start_headers(
                rid, "stand-in", 0, NAMES.cancel("stand-in", 0)))
            seq = 1
            for i in range(TOKENS):
                if rid in cancelled:
                    break
                await asyncio.sleep(STEP_S)
                seq += rid.startswith("gap-") and i == 2
                await nc.publish(msg.reply, b"a", headers=token_headers(rid, seq))
                seq += 1
            finish = "cancelled" if rid in cancelled else "length"
            body, eh = end_message(rid, seq, Status.OK, StreamEnd(
                finish_reason=finish, usage=Usage(prompt_tokens=3, completion_tokens=seq - 1)),
                service_us=1000)
            await nc.publish(msg.reply, body, headers=eh)

        async def on_request(msg: Msg) -> None:
            if (msg.headers or {}).get(Header.REQUEST_ID) == PROBE:
                await nc.publish(msg.reply, b"", headers={Header.STATUS: "200"})
                return
            seen["requests"].append(msg)
            asyncio.get_running_loop().create_task(stream(msg))

        async def on_cancel(msg: Msg) -> None:
            seen["cancels"].append(msg)
            cancelled.add((msg.headers or {})[Header.REQUEST_ID])

        await nc.subscribe(NAMES.infer("tinylm"), cb=on_request)
        await nc.subscribe(NAMES.node_cancels("stand-in"), cb=on_cancel)
        await nc.flush()
        await answered_from_elsewhere(nats_server.url)
        yield seen


async def answered_from_elsewhere(url: str) -> None:
    """Round trips from another connection until the stand-in answers one: a flushed
    subscription is not always enough, CI once saw the server's no-responders (503) for the
    very first request of a test on a loaded machine."""
    async with client(url) as other:
        for _ in range(50):
            try:
                reply = await other.request(NAMES.infer("tinylm"), b"", timeout=2,
                                            headers={Header.REQUEST_ID: PROBE})
            except NoRespondersError:
                reply = None
            if reply is not None and (reply.headers or {}).get(Header.STATUS) == "200":
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the stand-in never answered a probe")


async def test_streams_retried_at_their_ticket(nats_server: EmbeddedNats,
                                               streamer: dict[str, list[Msg]]) -> None:
    spec = StreamSpec(deadline_ms=2000, stream_deadline_ms=3000, policy=RetryPolicy())
    async with StreamTarget(ConnectOptions(url=nats_server.url), spec, seed=1) as target:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(target.stream(b'{"prompt": "x"}', t0=t0,
                                                        scheduled_s=0.0) for _ in range(5)))
        await asyncio.sleep(0.1)  # anything after a final message would have come by now
        assert target.after_final == 0 and target.after_timeout == 0
    for o in outcomes:
        assert o.statuses == (429, 200) and o.reasons == ("busy", "") and o.hinted == 1
        assert o.final == "200" and o.finish == "length" and o.tokens == TOKENS
        assert o.accepted_s is not None and o.accepted_s - o.sent_s >= 0.020  # Retry-After
        ttft, e2e = o.ttft_s, o.e2e_ttft_s
        assert ttft is not None and e2e is not None and ttft < e2e
        assert o.tpot_s is not None and o.tpot_s >= STEP_S * 0.9
        assert o.within_deadline
    requests = streamer["requests"]
    assert len(requests) == 10
    retries = [m.headers for m in requests if m.headers and Header.TICKET in m.headers]
    assert len(retries) == 5
    for h in retries:
        assert h[Header.TICKET] == f"t-{h[Header.REQUEST_ID]}" and h[Header.ATTEMPT] == "2"
        assert h[Header.STREAM] == "1"
        assert 0 < int(h[Header.DEADLINE_MS]) < 2000
        assert int(h[Header.DEADLINE_MS]) <= int(h[Header.STREAM_DEADLINE_MS]) < 3000


async def test_mean_retries_is_over_the_streams_that_came_back(
        nats_server: EmbeddedNats, streamer: dict[str, list[Msg]]) -> None:
    """Every first try refused `busy` with a Retry-After of 20 ms: streams with a TTFT
    budget that fits the wait come back with their ticket (one retry each), streams with a
    budget of 15 ms take the refusal as their final answer. The mean retries is over those
    that came back, 1.0; the final ones, counted as 0 retries, had pulled it to 0.5."""
    opts = ConnectOptions(url=nats_server.url)
    async with StreamTarget(opts, StreamSpec(deadline_ms=2000, policy=RetryPolicy()),
                            seed=1) as back, \
            StreamTarget(opts, StreamSpec(deadline_ms=15, policy=RetryPolicy()),
                         seed=1) as final:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(
            *(back.stream(b"{}", t0=t0, scheduled_s=0.0) for _ in range(3)),
            *(final.stream(b"{}", t0=t0, scheduled_s=0.0) for _ in range(3)))
    assert [o.statuses for o in outcomes] == [(429, 200)] * 3 + [(429,)] * 3
    s = summarize_streams(list(outcomes), target="t", rate=6, duration_s=1, elapsed_s=1,
                          deadline_ms=None, stream_deadline_ms=None)
    assert s.refused_first == 6 and s.refused_final_by_reason == {"busy": 3}
    assert s.first_retry_success == 1.0 and s.mean_retries == 1.0


async def test_no_retry_a_broken_stream_and_a_cancel(nats_server: EmbeddedNats,
                                                     streamer: dict[str, list[Msg]]) -> None:
    async with StreamTarget(ConnectOptions(url=nats_server.url), StreamSpec()) as target:
        o = await target.stream(b"{}", t0=time.monotonic(), scheduled_s=0.0)
        assert o.final == "429" and o.statuses == (429,) and not o.accepted
        _, call = await target.begin(b"{}", {Header.TICKET: "t", Header.REQUEST_ID: "gap-1"})
        await asyncio.wait_for(call.done.wait(), 2)
        assert call.broken and len(call.token_t) == 2  # tokens 1, 2, then 4: broken
        _, call = await target.begin(b"{}", {Header.TICKET: "t"})
        await asyncio.wait_for(call.first_token.wait(), 2)
        assert await target.cancel(call)
        await asyncio.wait_for(call.done.wait(), 2)
        assert call.reader.end is not None and call.reader.end.finish_reason == "cancelled"
        assert len(call.token_t) < TOKENS
    assert [(m.headers or {})[Header.REQUEST_ID] for m in streamer["cancels"]] == [
        call.request_id]


async def test_closed_loop_counts_streams_and_tokens(nats_server: EmbeddedNats,
                                                     streamer: dict[str, list[Msg]]) -> None:
    spec = StreamSpec(policy=RetryPolicy())
    async with StreamTarget(ConnectOptions(url=nats_server.url), spec) as target:
        cap = await closed_loop(target, b"{}", callers=2, seconds=0.3)
    assert cap.streams >= 4 and cap.tokens == TOKENS * cap.streams
    assert cap.refused == cap.streams and cap.other == 0  # the stand-in refuses every first
    assert cap.streams_per_s == pytest.approx(cap.streams / cap.seconds)


async def test_pulse_streams_offers_a_multiple_of_the_capacity(
        nats_server: EmbeddedNats, streamer: dict[str, list[Msg]]) -> None:
    target = StreamTarget(ConnectOptions(url=nats_server.url),
                          StreamSpec(deadline_ms=1000, policy=RetryPolicy()), seed=2)
    report = await pulse_streams(target, b"{}", LoadConfig(rate=1, duration_s=1), seed=2,
                                 capacity_x=2.0, callers=2, capacity_s=0.3)
    cap, s = report.capacity, report.summary
    assert cap is not None and cap.streams > 0
    assert s.rate == pytest.approx(2.0 * cap.streams_per_s)
    assert s.sent == len(report.run.outcomes) and s.status_counts == {"200": s.sent}
    assert s.first_retry_success == 1.0 and s.refused_by_reason == {"busy": s.sent}
    assert s.tokens == TOKENS * s.sent


# -- against a real plane ---------------------------------------------------------------------
async def test_a_short_run_against_the_plane(tmp_path: Path) -> None:
    """tinylm on 2 torch slots, a low Poisson rate for two seconds with retries: TTFT and TPOT
    reported, every stream ends in exactly one final message, nothing after it."""
    from plane.stack import PlaneStack, StackConfig

    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 32}).encode()
    async with PlaneStack(StackConfig(models=("tinylm",), slots=2, backend="torch")) as stack:
        spec = StreamSpec(deadline_ms=2000, policy=RetryPolicy())
        async with StreamTarget(ConnectOptions(url=stack.url), spec, seed=3) as target:
            run = await run_streams(target, body, LoadConfig(rate=10, duration_s=2), seed=3)
            await asyncio.sleep(0.3)  # a message after any stream's final one: counted
            assert target.after_final == 0 and target.after_timeout == 0
    outcomes = run.outcomes
    s = summarize_streams(outcomes, target=target.name, rate=10, duration_s=2,
                          elapsed_s=run.elapsed_s, deadline_ms=2000, stream_deadline_ms=None,
                          dropped=run.dropped, after_final=run.after_final)
    assert s.sent == len(outcomes) > 5 and s.dropped == 0
    assert all(o.end_s is not None for o in outcomes)  # each one final message
    assert s.status_counts == {"200": len(outcomes)}, s.status_counts
    assert all(o.tokens == 32 and o.finish == "length" for o in outcomes)
    assert s.ttft.p50_ms is not None and s.ttft.p99_ms is not None and s.ttft.p50_ms > 0
    assert s.tpot.p50_ms is not None and 0 < s.tpot.p50_ms < 50
    assert s.tokens == 32 * len(outcomes) and s.tokens_per_s > 0
    assert s.within_deadline_share == 1.0


async def test_the_cli_measures_capacity_then_offers_a_multiple(tmp_path: Path) -> None:
    from plane.stack import PlaneStack, StackConfig

    async with PlaneStack(StackConfig(models=("tinylm",), slots=2, backend="torch")) as stack:
        proc = await asyncio.create_subprocess_exec(
            PLANE, "pulse", "--nats", stack.url, "--model", "tinylm", "--stream",
            "--capacity-x", "0.3", "--callers", "2", "--capacity-s", "1", "--duration", "2",
            "--max-tokens", "16", "--retry", "--seed", "5", "--json", "--out", str(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    s = json.loads(out)
    cap = s["capacity"]
    assert cap["streams"] > 0 and cap["tokens"] == 16 * cap["streams"]
    assert s["rate"] == pytest.approx(0.3 * cap["streams_per_s"])
    assert s["ttft"]["p50_ms"] > 0 and s["tpot"]["p50_ms"] > 0
    assert sum(s["status_counts"].values()) == s["sent"] - s["dropped"]
    assert s["verdict"] in (MET, NOT_MET)
    assert (tmp_path / "streams.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (tmp_path / "streams.csv").read_text().splitlines()
    assert rows[0].startswith("scheduled_s,sent_s,final") and len(rows) == s["sent"] + 1


async def test_cli_refuses_stream_for_a_model_that_does_not_stream(
        nats_server: EmbeddedNats) -> None:
    proc = await asyncio.create_subprocess_exec(
        PLANE, "pulse", "--nats", nats_server.url, "--model", "risk", "--stream",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"does not stream" in err


async def test_nobody_listening_is_a_503_at_once(nats_server: EmbeddedNats) -> None:
    """No router on the subject: the server's no-responders status ends the stream."""
    async with StreamTarget(ConnectOptions(url=nats_server.url), StreamSpec()) as target:
        o = await asyncio.wait_for(target.stream(b"{}", t0=time.monotonic(),
                                                 scheduled_s=0.0), 5)
    assert o.final == "503" and o.reasons == ("no-responders",) and not o.accepted
