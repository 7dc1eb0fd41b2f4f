"""From a run's streams to its summary and its verdict against issue 14's targets. Pure
functions of the outcomes (no clock, no I/O).

The targets, for streams the plane let in (`StreamOutcome.accepted`):
- TTFT p99/p50 <= 1.8: the first token does not wait behind other streams;
- TPOT p99/p50 <= 1.5: tokens flow at the slot's pace, whatever else runs;
- >= 99.9% of accepted streams end well (200) within their stream deadline;
- >= 99.5% of first retries (at the 429's Retry-After-Ms, with its ticket) are let in.
A target with nothing to measure (no retries in a run without refusals) is not judged; a run
with no accepted stream is inconclusive.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from plane.contract.quantiles import nearest_rank
from plane.pulse.stream_outcome import StreamOutcome

MAX_TTFT_RATIO = 1.8
MAX_TPOT_RATIO = 1.5
MIN_WITHIN_DEADLINE = 0.999
MIN_FIRST_RETRY = 0.995
MET, NOT_MET, INCONCLUSIVE = "targets met", "targets not met", "inconclusive"


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One target: what was measured against its bound (`met` None: nothing to measure)."""

    name: str
    value: float | None
    bound: float
    at_most: bool  # True: value <= bound; False: value >= bound
    met: bool | None


class Percentiles(msgspec.Struct, frozen=True, kw_only=True):
    """Milliseconds; None when there were no samples."""

    n: int
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    max_ms: float | None = None

    @property
    def p99_over_p50(self) -> float | None:
        if self.p50_ms is None or self.p99_ms is None or self.p50_ms <= 0:
            return None
        return self.p99_ms / self.p50_ms


def percentiles_ms(values_s: Sequence[float]) -> Percentiles:
    """Nearest-rank percentiles of seconds, in ms."""
    if not values_s:
        return Percentiles(n=0)
    xs = sorted(values_s)
    return Percentiles(n=len(xs), p50_ms=1000 * nearest_rank(xs, 0.5),
                       p90_ms=1000 * nearest_rank(xs, 0.9), p99_ms=1000 * nearest_rank(xs, 0.99),
                       p999_ms=1000 * nearest_rank(xs, 0.999), max_ms=1000 * xs[-1])


class StreamSummary(msgspec.Struct, kw_only=True):
    target: str
    rate: float  # arrivals per second offered (the mean of the Poisson process)
    duration_s: float
    elapsed_s: float  # to the last stream's end: what tokens/s is over
    deadline_ms: int | None  # the TTFT budget pulse sent (None: the plane's own)
    stream_deadline_ms: int | None
    sent: int  # arrivals, dropped included
    dropped: int  # over the concurrency cap
    accepted: int
    started: int
    ttft: Percentiles  # accepted: first token - send of the attempt let in
    e2e_ttft: Percentiles  # first token - scheduled send, retry waits included
    tpot: Percentiles  # one per stream: (last - first token) / (tokens - 1)
    gaps: Percentiles  # every gap between successive token messages
    ttft_p99_over_p50: float | None
    tpot_p99_over_p50: float | None
    tokens: int  # delivered, every stream
    tokens_per_s: float
    ok_per_s: float  # streams that ended 200, per second of the run
    status_counts: dict[str, int]  # final status of each stream
    finish_counts: dict[str, int]  # finish_reason of the streams that got an `end`
    refused_first: int  # streams refused at their first try
    refused_by_reason: dict[str, int]  # those, by Plane-Reason
    refused_final_by_reason: dict[str, int]  # streams whose last answer was a 429, by reason
    refusal_rate: float | None  # refused at first try / streams
    retry_after_share: float | None  # 429s that carried Retry-After-Ms
    first_retry_success: float | None  # of streams retried, let in at the second attempt
    mean_retries: float | None  # retries per stream refused and retried after it
    within_deadline: int  # accepted streams that ended 200 within their stream deadline
    within_deadline_share: float | None  # ... of the accepted
    after_final: int  # messages after a final message (the contract: none)
    checks: list[Check]
    verdict: str
    verdict_reasons: list[str]


def _share(num: int, den: int) -> float | None:
    return num / den if den else None


def _check(name: str, value: float | None, bound: float, *, at_most: bool) -> Check:
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return Check(name=name, value=value, bound=bound, at_most=at_most, met=met)


def checks_for(*, ttft_ratio: float | None, tpot_ratio: float | None,
               within_share: float | None, first_retry: float | None) -> list[Check]:
    return [
        _check("accepted TTFT p99/p50", ttft_ratio, MAX_TTFT_RATIO, at_most=True),
        _check("TPOT p99/p50", tpot_ratio, MAX_TPOT_RATIO, at_most=True),
        _check("accepted within stream deadline", within_share, MIN_WITHIN_DEADLINE,
               at_most=False),
        _check("first-retry success", first_retry, MIN_FIRST_RETRY, at_most=False),
    ]


def describe(c: Check) -> str:
    if c.value is None:
        return f"{c.name}: nothing to measure"
    pct = c.bound < 1 and not c.at_most
    v = f"{100 * c.value:.2f}%" if pct else f"{c.value:.2f}"
    b = f"{100 * c.bound:.1f}%" if pct else f"{c.bound:g}"
    return f"{c.name} {v} {'<=' if c.at_most else '>='} {b}: {'met' if c.met else 'NOT met'}"


def stream_verdict(checks: Sequence[Check], accepted: int) -> tuple[str, list[str]]:
    if not accepted:
        return INCONCLUSIVE, ["no stream was let in: nothing to measure"]
    reasons = [describe(c) for c in checks]
    if any(c.met is False for c in checks):
        return NOT_MET, reasons
    return MET, reasons


def summarize_streams(
    outcomes: Sequence[StreamOutcome],
    *,
    target: str,
    rate: float,
    duration_s: float,
    elapsed_s: float,
    deadline_ms: int | None,
    stream_deadline_ms: int | None,
    dropped: int = 0,
    after_final: int = 0,
) -> StreamSummary:
    accepted = [o for o in outcomes if o.accepted]
    ttft = percentiles_ms([v for o in accepted if (v := o.ttft_s) is not None])
    e2e = percentiles_ms([v for o in accepted if (v := o.e2e_ttft_s) is not None])
    tpot = percentiles_ms([v for o in accepted if (v := o.tpot_s) is not None])
    gaps = percentiles_ms([g for o in accepted for g in o.gaps_s])
    refused = [o for o in outcomes if o.first_refused]
    retried = [o for o in refused if o.attempts > 1]
    # Refused at least once and retried after it: a refusal that was the stream's final
    # answer made no retry to count (counted as 0, it pulled the mean down).
    came_back = [o for o in outcomes if 429 in o.statuses[:-1]]
    refusals = sum(o.statuses.count(429) for o in outcomes)
    hinted = sum(o.hinted for o in outcomes)
    within = sum(1 for o in accepted if o.within_deadline)
    # Only 429s are retried: a stream of exactly two attempts that was let in got in at
    # its first retry.
    first_retry = _share(sum(1 for o in retried if o.attempts == 2 and o.accepted),
                         len(retried))
    within_share = _share(within, len(accepted))
    checks = checks_for(ttft_ratio=ttft.p99_over_p50, tpot_ratio=tpot.p99_over_p50,
                        within_share=within_share, first_retry=first_retry)
    verdict, reasons = stream_verdict(checks, len(accepted))
    tokens = sum(o.tokens for o in outcomes)
    return StreamSummary(
        target=target, rate=rate, duration_s=duration_s, elapsed_s=elapsed_s,
        deadline_ms=deadline_ms, stream_deadline_ms=stream_deadline_ms,
        sent=len(outcomes) + dropped, dropped=dropped, accepted=len(accepted),
        started=sum(1 for o in outcomes if o.started),
        ttft=ttft, e2e_ttft=e2e, tpot=tpot, gaps=gaps,
        ttft_p99_over_p50=ttft.p99_over_p50, tpot_p99_over_p50=tpot.p99_over_p50,
        tokens=tokens, tokens_per_s=tokens / elapsed_s if elapsed_s > 0 else 0.0,
        ok_per_s=(sum(1 for o in outcomes if o.final == "200") / elapsed_s
                  if elapsed_s > 0 else 0.0),
        status_counts=dict(Counter(o.final for o in outcomes)),
        finish_counts=dict(Counter(o.finish for o in outcomes if o.finish)),
        refused_first=len(refused),
        refused_by_reason=dict(Counter(o.reasons[0] or "-" for o in refused)),
        refused_final_by_reason=dict(Counter(o.reasons[-1] or "-" for o in outcomes
                                             if o.final == "429")),
        refusal_rate=_share(len(refused), len(outcomes)),
        retry_after_share=_share(hinted, refusals),
        first_retry_success=first_retry,
        mean_retries=(sum(o.attempts - 1 for o in came_back) / len(came_back)
                      if came_back else None),
        within_deadline=within, within_deadline_share=within_share,
        after_final=after_final,
        checks=checks, verdict=verdict, verdict_reasons=reasons,
    )
