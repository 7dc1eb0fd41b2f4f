"""Admission by tokens (docs/design.md "Streams"): a stream's slot time is predicted from its
prompt and max_tokens at per-token rates learned from done-events; its deadline is for the
first token, its stream deadline for the whole; tickets count a busy slot free at its
stream's predicted end."""

import asyncio
import json

from msgspec.structs import replace

from plane.contract.budget import PRIOR_DECODE_NS, RATES_MAX_AGE_S, ServiceWindow, TokenRates
from plane.contract.messages import Reason, Status
from plane.contract.streams import StreamReader
from plane.contract.subjects import Header
from plane.router.admission import Admission, Ask, Park, Place, Refuse
from tests.plane_fixtures import (
    NAMES,
    calibrated,
    client,
    plane,
    slots_running,
    slow_steps,
    status,
    wait_until,
)
from tests.test_admission import busy_until, slots


def rates(prefill_ns: int, decode_ns: int) -> TokenRates:
    r = TokenRates()
    for _ in range(20):
        r.learn(prompt_tokens=10, tokens=100, prefill_us=prefill_ns * 10 // 1000,
                decode_us=decode_ns * 100 // 1000)
    return r


def overhead(us: int) -> ServiceWindow:
    return ServiceWindow(prior_us=us)


def test_rates_learn_per_token_costs_and_predict_from_the_request() -> None:
    r = TokenRates()
    assert r.decode.p50_us == PRIOR_DECODE_NS  # before any stream: the prior
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    whole, first_p99, work = r.predict(overhead(1000), prompt_tokens=20, max_tokens=50)
    # 20 x 50 µs prefill + 50 x 400 µs decode = 21 ms of device work, plus 1 ms overhead.
    assert work == 21_000
    assert whole.p50_us == whole.p99_us == 22_000
    # The first token: overhead, prefill and one step.
    assert first_p99 == 1000 + 1000 + 400
    # Twice the tokens, about twice the work: the prediction follows the request.
    assert r.predict(overhead(1000), 20, 100)[2] == 41_000


def test_a_slower_device_is_learned() -> None:
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    for _ in range(200):
        r.learn(prompt_tokens=10, tokens=100, prefill_us=1000, decode_us=80_000)  # 800 µs/token
    assert r.predict(overhead(0), 0, 10)[2] == 8_000


def test_one_slow_stream_ages_out_of_the_rates() -> None:
    """A stream slowed 50 ms a step (a device's hiccup, a node slowed) was the decode p99 of
    a small window until 128 newer streams came, and every stream it made too long for its
    deadline was refused `deadline` meanwhile, so none came: long streams were refused for
    good (found from outside). Samples age out after RATES_MAX_AGE_S, as the cycle's do."""
    r = TokenRates()
    for i in range(20):
        r.learn(prompt_tokens=10, tokens=100, prefill_us=500, decode_us=40_000, now_s=i * 0.1)
    r.learn(prompt_tokens=10, tokens=20, prefill_us=500, decode_us=1_000_000, now_s=2.0)
    assert r.decode.p99_us == 50_000_000  # 50 ms a token: 200 tokens, 10 s
    r.expire(2.0 + RATES_MAX_AGE_S - 0.01)
    assert r.decode.p99_us == 50_000_000  # not before its age
    r.expire(2.0 + RATES_MAX_AGE_S + 0.01)
    # Emptied: the median of what it held is its prior now, not the outlier (the p99) nor
    # the configured prior (300 µs a token, four times too fast for a slow CPU's 1.2 ms: a
    # quiet spell sent the router back to it; found in review).
    assert r.decode.count == 0 and r.decode.p99_us == 400_000
    r.learn(prompt_tokens=10, tokens=100, prefill_us=500, decode_us=40_000, now_s=13.0)
    assert r.decode.p99_us == 400_000
    # Too few samples for a median to go by: the configured prior.
    few = TokenRates()
    few.learn(prompt_tokens=10, tokens=100, prefill_us=500, decode_us=1_000_000, now_s=0.0)
    few.expire(RATES_MAX_AGE_S + 1)
    assert few.decode.p99_us == PRIOR_DECODE_NS


def test_streams_cut_short_do_not_shorten_the_deadline_bound() -> None:
    """Six streams ran to max_tokens, then twelve were cancelled at their first token: how
    far the cancelled got says nothing of how far the next stream goes. The schedule spaces
    by what streams took (the fill's p50); the deadline bound (the p99) by the streams that
    ran to their own end. Before, twelve cancels made the p99 a 2% fill, and a 250-token
    stream was admitted to a deadline its first few tokens fitted (found from outside: it
    ended 504 `deadline` instead of a 429 at once)."""
    r = TokenRates()
    for i in range(6):
        r.learn(prompt_tokens=10, tokens=250, prefill_us=500, decode_us=100_000, max_tokens=250,
                now_s=i * 0.1)
    for i in range(12):
        r.learn(prompt_tokens=10, tokens=5, prefill_us=500, decode_us=2_000, max_tokens=250,
                now_s=1 + i * 0.1, cut=True)
    whole, _, _ = r.predict(overhead(0), 10, 250)
    assert whole.p99_us >= 250 * 400  # every token, at 400 µs
    assert whole.p50_us < 20 * 400  # spaced by what streams took: most were cut at 5 tokens
    # Only cut streams: the bound stays every token.
    cut = TokenRates()
    for i in range(12):
        cut.learn(prompt_tokens=10, tokens=5, prefill_us=500, decode_us=2_000, max_tokens=250,
                  now_s=i * 0.1, cut=True)
    assert cut.predict(overhead(0), 10, 250)[0].p99_us >= 250 * 400


def test_after_a_quiet_spell_streams_are_assumed_to_run_to_max_tokens() -> None:
    """Streams that ended early by themselves (END sampled) aged out: the router knows
    nothing recent of how far streams go, and bounds the next by max_tokens (it kept their
    median as the p99 before, and admitted streams it could not finish in time)."""
    r = TokenRates()
    for i in range(20):
        r.learn(prompt_tokens=10, tokens=10, prefill_us=500, decode_us=4_000, max_tokens=250,
                now_s=i * 0.1)
    assert r.predict(overhead(0), 10, 250)[0].p99_us < 20 * 400
    r.expire(2.0 + RATES_MAX_AGE_S + 0.01)
    whole, _, _ = r.predict(overhead(0), 10, 250)
    assert whole.p99_us >= 250 * 400 and whole.p50_us >= 250 * 400


def stream_ask(now: float, *, ttft_s: float, stream_s: float, r: TokenRates,
               max_tokens: int, ticket: str | None = None) -> Ask:
    whole, first_p99, _ = r.predict(overhead(500), 10, max_tokens)
    return Ask(now_s=now, deadline_s=now + ttft_s, prediction=whole, ticket=ticket,
               first_p99_us=first_p99, end_deadline_s=now + stream_s)


def test_a_stream_longer_than_its_first_token_budget_is_admitted() -> None:
    """100 tokens at 400 µs is 40 ms on the slot; a 20 ms TTFT budget is for the first token."""
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    ms, adm = slots(1), Admission("r")
    d = adm.decide(ms, stream_ask(0.0, ttft_s=0.020, stream_s=1.0, r=r, max_tokens=100))
    assert isinstance(d, Place)


def test_the_stream_deadline_must_hold_the_whole_stream() -> None:
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    ms, adm = slots(1), Admission("r")
    d = adm.decide(ms, stream_ask(0.0, ttft_s=0.020, stream_s=0.030, r=r, max_tokens=100))
    assert isinstance(d, Refuse) and d.reason == Reason.DEADLINE
    assert "Plane-Stream-Deadline-Ms" in d.message and "max_tokens" in d.message


def test_the_first_token_must_fit_its_deadline() -> None:
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    ms, adm = slots(1), Admission("r")
    d = adm.decide(ms, stream_ask(0.0, ttft_s=0.001, stream_s=1.0, r=r, max_tokens=10))
    assert isinstance(d, Refuse) and d.reason == Reason.DEADLINE
    assert "first token" in d.message


def test_refused_streams_are_told_when_the_running_stream_ends() -> None:
    """One slot, its stream predicted to end at 40 ms: the next caller's ticket is due then,
    the one after at the end of that caller's stream (40 ms later), each minus its trip."""
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.040)
    waits = []
    for _ in range(2):
        d = adm.decide(ms, stream_ask(0.0, ttft_s=1.0, stream_s=2.0, r=r, max_tokens=100))
        assert isinstance(d, Refuse) and d.status == Status.BUSY and d.ticket
        waits.append(d.retry_after_ms)
    whole = r.predict(overhead(500), 10, 100)[0]
    assert waits[0] == 39
    assert waits[1] == 39 + round(whole.expected_us / 1000)


def test_a_stream_holder_with_an_inbox_is_on_call_however_short_the_stream() -> None:
    """A stream of 10 ms beside a call's trip of 2 ms (too long a trip to put 10 ms of other
    work on call): its holder is on call all the same, since whatever it waits for a slot
    after it came is in its time to first token. Told a late fallback, past the predicted
    end of the stream ahead; without an inbox, that predicted end."""
    r = rates(prefill_ns=50_000, decode_ns=100_000)
    ask = stream_ask(0.0, ttft_s=1.0, stream_s=2.0, r=r, max_tokens=100)
    assert ask.prediction.expected_us < 10 * 2_000  # not on call were it not a stream
    told = []
    for a in (ask, replace(ask, wake="_INBOX.me")):
        ms, adm = slots(1), Admission("r")
        busy_until(ms, 0.040)
        d = adm.decide(ms, a)
        assert isinstance(d, Refuse) and d.retry_after_ms is not None
        told.append((d.retry_after_ms, "or when called" in d.message))
    assert told[0] == (39, False)
    assert told[1][1] and told[1][0] >= 39 + ask.prediction.expected_us // 1000


def test_a_stream_newcomer_on_call_is_refused_not_kept_waiting_for_a_slot_about_to_free() -> None:
    """The slot frees in 2 ms, within a quarter of a 40 ms stream. A newcomer without an
    inbox waits for it (parked: its holder would be told a time and come late); one that
    gave an inbox is on call, so it is refused with a ticket and called when the slot
    frees: a wait here would be in its time to first token."""
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    ask = stream_ask(0.0, ttft_s=1.0, stream_s=2.0, r=r, max_tokens=100)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.002)
    assert isinstance(adm.decide(ms, ask), Park)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.002)
    d = adm.decide(ms, replace(ask, wake="_INBOX.me"))
    assert isinstance(d, Refuse) and d.ticket is not None and "or when called" in d.message


def test_a_promise_that_cannot_start_in_time_for_the_first_token_is_not_made() -> None:
    r = rates(prefill_ns=50_000, decode_ns=400_000)
    ms, adm = slots(1), Admission("r")
    busy_until(ms, 0.040)
    d = adm.decide(ms, stream_ask(0.0, ttft_s=0.030, stream_s=2.0, r=r, max_tokens=100))
    assert isinstance(d, Refuse) and d.reason == Reason.DEADLINE and d.ticket is None


# -- live: what the router says about a stream request before any slot is involved -----------
async def test_stream_requests_the_router_cannot_serve_get_a_400_saying_why() -> None:
    async with plane(models=("calibrated",), slots=1) as s, client(s.url) as nc:
        async def ask(model: str, body: bytes, **h: str) -> tuple[int, str]:
            m = await nc.request(NAMES.infer(model), body, timeout=5, headers=h)
            return status(m), m.data.decode()

        # A model that does not stream.
        code, text = await ask("calibrated", calibrated(10), **{Header.STREAM: "1"})
        assert code == 400 and "does not stream" in text
        # A stream deadline shorter than the first token's.
        code, text = await ask("tinylm", b'{"prompt": "hi"}', **{
            Header.STREAM: "1", Header.DEADLINE_MS: "500", Header.STREAM_DEADLINE_MS: "100"})
        assert code == 400 and Header.STREAM_DEADLINE_MS in text
        # Plane-Stream takes one value.
        code, text = await ask("tinylm", b'{"prompt": "hi"}', **{Header.STREAM: "yes"})
        assert code == 400 and Header.STREAM in text
        # A prompt and max_tokens past the context.
        code, text = await ask("tinylm", b'{"prompt": "' + b"a" * 250 + b'", "max_tokens": 10}',
                               **{Header.STREAM: "1"})
        assert code == 400 and "context" in text
        # A well-formed stream with no tinylm slot anywhere: refused, not lost.
        code, text = await ask("tinylm", b'{"prompt": "hi"}', **{Header.STREAM: "1"})
        assert code == 503 and "no healthy slot" in text


def test_streams_that_end_early_are_spaced_by_what_they_take() -> None:
    """Streams that produce a quarter of their max_tokens (END sampled early): promises are
    spaced by a quarter of the work, while the p99 (deadlines) stays at the whole."""
    r = rates(prefill_ns=0, decode_ns=400_000)
    full = r.predict(overhead(0), 0, 100)[0]
    for _ in range(100):
        r.learn(prompt_tokens=0, tokens=25, prefill_us=0, decode_us=10_000, max_tokens=100)
    early = r.predict(overhead(0), 0, 100)[0]
    assert early.expected_us == full.expected_us // 4 == 10_000
    assert early.p99_us == 10_000  # every stream so far took a quarter
    for _ in range(8):  # a few ran to max_tokens (the window recomputes every 8): the p99 knows
        r.learn(prompt_tokens=0, tokens=100, prefill_us=0, decode_us=40_000, max_tokens=100)
    assert r.predict(overhead(0), 0, 100)[0].p99_us == 40_000


async def test_a_stream_forwarded_to_the_router_that_made_its_promise_arrives_whole() -> None:
    """A ticket holder's stream retry lands on the router that did not make the promise: it is
    forwarded, the maker takes it over, and every message of the stream (start, tokens, end),
    not only the first, reaches the caller in order, from the node itself."""
    async with plane(models=("tinylm",), slots=1, routers=2) as stack, client(stack.url) as nc:
        async def ask(subject: str, max_tokens: int, **h: str) -> StreamReader:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(subject, json.dumps({"prompt": "hi", "max_tokens": max_tokens})
                             .encode(), reply=inbox, headers={Header.STREAM: "1", **h})
            reader = StreamReader()
            while not reader.done:
                m = await sub.next_msg(timeout=5)
                reader.feed(m.headers, m.data)
            await sub.unsubscribe()
            return reader

        long = asyncio.create_task(ask(NAMES.infer("tinylm"), 250))
        await wait_until(lambda: slots_running(stack) == 1, 5, "the long stream running")
        refused = await ask(NAMES.infer("tinylm"), 40)
        assert refused.status == 429
        ticket = (refused.final_headers or {})[Header.TICKET]
        owner = next(r for r in stack.routers if ticket.startswith(r.cfg.router_id + "-"))
        other = next(r for r in stack.routers if r is not owner)
        assert (await long).status == 200
        kept = await ask(NAMES.router_infer(other.cfg.router_id, "tinylm"), 40,
                         **{Header.TICKET: ticket})
        assert kept.status == 200 and kept.start is not None
        assert kept.usage is not None and kept.usage.completion_tokens == 40
        assert kept.next_seq >= 3  # start, at least one token message, end: all of them
        # Forwarded for its ticket and taken over (the owner honours it, or, on a loaded
        # machine where the stream ahead ran long, takes it as a late holder: either way it
        # ran), nothing relayed.
        forwarded = stack.metrics.registry.get_sample_value
        assert forwarded("plane_router_forwarded_total", {
            "model": "tinylm", "why": "ticket", "outcome": "taken"}) == 1
        assert forwarded("plane_router_forwarded_total", {
            "model": "tinylm", "why": "ticket", "outcome": "relayed"}) is None
        stats = owner.admission.stats
        assert stats["ticket-valid"] + stats["ticket-late"] == 1, stats


async def test_a_forwarded_streams_caller_that_stops_reading_stops_it() -> None:
    """Taken over by the router that made its promise, a forwarded stream goes from the node
    to the caller itself: a caller that stops reading is seen by the node, which ends the
    stream and frees the slot at once. (Relayed through the router the retry landed on, the
    node's reader was that router's inbox, which read on: the stream ran to its end.)"""
    async with plane(models=("tinylm",), slots=1, routers=2, allow_faults=True) as stack, \
            client(stack.url) as nc:
        await slow_steps(nc, 2000)  # 2 ms a token: 250 tokens take half a second
        long = asyncio.create_task(nc.request(
            NAMES.infer("tinylm"), json.dumps({"prompt": "hi", "max_tokens": 60}).encode(),
            timeout=10))
        await wait_until(lambda: slots_running(stack) == 1, 5, "the first call running")
        refused = await nc.request(NAMES.infer("tinylm"), json.dumps(
            {"prompt": "hi", "max_tokens": 250}).encode(), timeout=5,
            headers={Header.STREAM: "1"})
        assert status(refused) == 429
        ticket = refused.headers[Header.TICKET]
        owner = next(r for r in stack.routers if ticket.startswith(r.cfg.router_id + "-"))
        other = next(r for r in stack.routers if r is not owner)
        assert status(await long) == 200
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(NAMES.router_infer(other.cfg.router_id, "tinylm"), json.dumps(
            {"prompt": "hi", "max_tokens": 250}).encode(), reply=inbox,
            headers={Header.STREAM: "1", Header.TICKET: ticket, Header.REQUEST_ID: "left-1"})
        first = await sub.next_msg(timeout=5)
        assert (first.headers or {}).get(Header.STREAM) == "start", first.headers
        await sub.unsubscribe()  # the caller stops reading after the start
        await nc.flush()
        gone_by = await wait_until(lambda: stack.nodes[0].streams.readers_gone >= 1, 3,
                                   "the node to see its reader gone")
        await wait_until(lambda: slots_running(stack) == 0, 1, "the slot free")
        assert gone_by < 0.4  # well before the 250 tokens' half second
