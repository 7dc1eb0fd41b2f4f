"""From a run's outcomes to its summary: HDR percentiles, counts, retry figures, the plateau
and the verdict. Pure functions of the outcomes (no clock, no I/O).

A run in which the target broke (1% or more of requests failed in transport: refused or lost
connections, nobody listening) is "inconclusive" whatever else it shows. The verdict needs
evidence of saturation first: a load that never pushed the target past its
capacity (no refusals, no latency growth over the run, no drops, no timeouts) cannot show
whether a queue is there, whatever its p99/p50 (a busy machine's jitter alone gives 1.9).
Saturated, the marks of a queue (growth, a plateau, p99/p50 over 1.8, refusals without a
Retry-After) say "present"; refusals with a Retry-After and none of those say "absent".
`decided_by` names the signal that decided it.

Latency figures (`p50_ms` ...) are of *accepted* requests: those answered 200, or that ran out
of time (a timeout or 504 counts at the time it took: a queue must not hide behind a
timeout). Refusals (429, 503) and bad requests are fast answers of another kind and are
counted by status instead. `e2e_*` figures include the waits of client retries.

Retry figures: `refusal_rate` is the share refused at their first try; `first_retry_success`
is over those of them that came back, `mean_retries` over every request refused and come
back (a 429, then another attempt): a refusal that was the request's final answer (a final
`deadline` or `overloaded`, no retry policy, or no time left for one) made no retry to
count, and counted as 0 it pulled the mean down (2x of 2 x 10 ms, `--retry`, 40 ms
deadlines: 1530 of 2396 refused were final, and the mean said 0.36 for retries that were
1.00 each).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
from hdrh.histogram import HdrHistogram

from plane.pulse.outcome import ERROR, TIMEOUT, Outcome
from plane.pulse.plateau import detect_plateau

MAX_RATIO = 1.8  # p99/p50 above this: answers wait for each other somewhere
MIN_HINTED = 0.99  # share of 429s that must carry a Retry-After
GROWTH_FACTOR = 2.0  # accepted p50 of the last third over the first third: a backlog grows
GROWTH_MIN_MS = 1.0  # ... and by at least this much (sub-millisecond noise is not growth)
MIN_TIMEOUT_SHARE = 0.01  # answers that ran out of time: saturation from this share on
# Requests whose transport failed (connection refused or lost, nobody listening): from this
# share on the target broke under the run, and its answers say nothing of a queue.
MIN_ERROR_SHARE = 0.01
_HIGHEST_US = 3_600_000_000  # an hour: nothing we measure takes longer
ABSENT, PRESENT, INCONCLUSIVE = "queueing layer absent", "queueing layer present", "inconclusive"
NOT_SATURATED = "not saturated"
# What decided a verdict (Summary.decided_by).
BY_GROWTH, BY_PLATEAU, BY_RATIO, BY_HINTS = "growth", "plateau", "p99/p50", "retry-after"
BY_REFUSALS, BY_NO_SATURATION, BY_NO_ANSWERS, BY_NO_REFUSALS = (
    "refusals", "no saturation", "no answers", "no refusals")
BY_ERRORS = "transport errors"


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    """What the verdict is decided on (all from the outcomes)."""

    p99_over_p50: float | None
    plateau: bool
    refusals: int  # 429s, every attempt
    retry_after_share: float | None  # of those, with a Retry-After
    first_third_p50_ms: float | None = None  # accepted, by scheduled time
    last_third_p50_ms: float | None = None
    dropped: int = 0  # arrivals over the concurrency cap
    timeouts: int = 0  # final answers that ran out of time (timeout, 504)
    errors: int = 0  # requests whose transport failed (final "error")
    requests: int = 0

    @property
    def growth(self) -> bool:
        a, b = self.first_third_p50_ms, self.last_third_p50_ms
        return (a is not None and b is not None and b > GROWTH_FACTOR * a
                and b - a >= GROWTH_MIN_MS)


class Summary(msgspec.Struct, kw_only=True):
    target: str
    rate: float
    duration_s: float
    concurrency: int
    deadline_ms: int | None  # None: pulse sent no Plane-Deadline-Ms (the server's applied)
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None
    p99_over_p50: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    p99_by_window_ms: list[float | None]
    sent: int
    answered: int
    dropped: int
    ok_per_s: float
    status_counts: dict[str, int]
    within_deadline_share: float | None
    refusal_rate: float | None
    retry_after_share: float | None
    first_retry_success: float | None  # of those refused at their first try and retried
    mean_retries: float | None  # attempts after the first, over the requests retried after a 429
    plateau: bool
    plateau_ms: float | None
    verdict: str
    verdict_reasons: list[str]
    decided_by: str = ""  # the signal that decided the verdict (BY_*)
    p50_first_third_ms: float | None = None  # accepted p50, first and last third of the run
    p50_last_third_ms: float | None = None
    arrivals: str = "even"  # how the sends were scheduled (LoadConfig.arrivals)
    # Final answers the client made up itself, not the target (`Attempts.local`), by why:
    # in `status_counts` under "error", "timeout" or "unsent", never as the target's status.
    local_causes: dict[str, int] = msgspec.field(default_factory=dict)


def _hist(values_us: Sequence[int]) -> HdrHistogram:
    h = HdrHistogram(1, _HIGHEST_US, 3)
    for v in values_us:
        h.record_value(min(max(1, v), _HIGHEST_US))
    return h


def _pct_ms(h: HdrHistogram, p: float) -> float | None:
    return h.get_value_at_percentile(p) / 1000 if h.get_total_count() else None


def _is_accepted(o: Outcome) -> bool:
    return o.attempts.final in ("200", "504", TIMEOUT)


def _share(num: int, den: int) -> float | None:
    return num / den if den else None


def verdict(sig: Signals) -> tuple[str, list[str], str]:
    """(verdict, reasons, decided_by): see the module doc."""
    if sig.requests and sig.errors == sig.requests:
        return INCONCLUSIVE, [
            f"none of the {sig.requests} requests reached the target (connection refused, "
            "nobody listening): is it up, and is the URL right?"], BY_ERRORS
    if sig.requests and sig.errors / sig.requests >= MIN_ERROR_SHARE:
        # A plane stopped under the run (or a gateway gone) times out what it held and
        # fails what came after: "latency grew" then, and it is not a queue's doing.
        return INCONCLUSIVE, [
            f"{sig.errors} of {sig.requests} requests failed in transport (connection refused "
            "or lost, nobody listening): the target broke during the run, so its latency "
            "says nothing of a queue; run again against a target that stays up"], BY_ERRORS
    saturation: list[str] = []
    if sig.refusals:
        saturation.append(f"{sig.refusals} refusals (429)")
    if sig.growth:
        saturation.append(f"accepted p50 grew {sig.first_third_p50_ms:.2f} -> "
                          f"{sig.last_third_p50_ms:.2f} ms over the run")
    if sig.dropped:
        saturation.append(f"{sig.dropped} arrivals dropped at the concurrency cap")
    if sig.requests and sig.timeouts / sig.requests >= MIN_TIMEOUT_SHARE:
        saturation.append(f"{sig.timeouts} answers ran out of time")
    if sig.p99_over_p50 is None:
        return INCONCLUSIVE, ["no accepted answers to measure"], BY_NO_ANSWERS
    ratio = f"p99/p50 = {sig.p99_over_p50:.2f}"
    if not saturation:
        why = [f"no refusals, no latency growth ({sig.first_third_p50_ms or 0:.2f} -> "
               f"{sig.last_third_p50_ms or 0:.2f} ms), no drops, no timeouts: the load stayed "
               "under capacity; offer more than the capacity to tell"]
        if sig.p99_over_p50 > MAX_RATIO or sig.plateau:
            why.append(f"{ratio}{' and a plateau' if sig.plateau else ''} without saturation "
                       "is jitter, not evidence of a queue")
        return NOT_SATURATED, why, BY_NO_SATURATION
    marks: list[tuple[str, str]] = []
    if sig.growth:
        marks.append((BY_GROWTH, "latency grows with the backlog: requests wait in a queue"))
    if sig.plateau:
        marks.append((BY_PLATEAU, "plateau in the right tail"))
    if sig.p99_over_p50 > MAX_RATIO:
        marks.append((BY_RATIO, f"{ratio} > {MAX_RATIO}"))
    if sig.refusals and (sig.retry_after_share or 0.0) < MIN_HINTED:
        marks.append((BY_HINTS, f"only {100 * (sig.retry_after_share or 0):.1f}% of 429s "
                                "carry Retry-After"))
    saturated = "saturated: " + ", ".join(saturation)
    if marks:
        return PRESENT, [m for _, m in marks] + [saturated], marks[0][0]
    if not sig.refusals:
        return INCONCLUSIVE, [saturated, "but nothing was refused: how it sheds load is "
                                         "unseen"], BY_NO_REFUSALS
    return ABSENT, [
        saturated,
        f"{ratio} <= {MAX_RATIO}, no plateau, no growth",
        f"{100 * (sig.retry_after_share or 0):.1f}% of 429s carry Retry-After",
    ], BY_REFUSALS


def summarize(
    outcomes: Sequence[Outcome],
    *,
    target: str,
    rate: float,
    duration_s: float,
    concurrency: int,
    deadline_ms: int | None,
    dropped: int,
    windows: int = 6,
    arrivals: str = "even",
) -> Summary:
    """`deadline_ms` None: pulse sent none (the router's live deadline applied, unknown
    here), so `within_deadline_share` is None too."""
    accepted = [o for o in outcomes if _is_accepted(o)]
    acc = _hist([o.accepted_us for o in accepted])
    e2e = _hist([o.latency_us for o in accepted])
    p50, p99 = _pct_ms(acc, 50), _pct_ms(acc, 99)
    by_window: list[list[int]] = [[] for _ in range(windows)]
    for o in accepted:
        i = min(windows - 1, max(0, int(o.scheduled_s / duration_s * windows)))
        by_window[i].append(o.accepted_us)
    status_counts = dict(Counter(o.attempts.final for o in outcomes))
    local_causes = dict(Counter(o.attempts.local for o in outcomes if o.attempts.local))
    refused = [o for o in outcomes if o.attempts.statuses and o.attempts.statuses[0] == 429]
    retried = [o for o in refused if len(o.attempts.statuses) > 1]
    # Refused at least once and retried after it (a first try answered 503, then refused,
    # counts too): the requests a retry figure is about.
    came_back = [o for o in outcomes if 429 in o.attempts.statuses[:-1]]
    refusals = sum(o.attempts.refusals for o in outcomes)
    hinted = sum(o.attempts.hinted for o in outcomes)
    retry_after_share = _share(hinted, refusals)
    plateau = detect_plateau([o.accepted_us / 1000 for o in accepted])
    ratio = p99 / p50 if p50 and p99 is not None else None
    sent = len(outcomes) + dropped
    ok = status_counts.get("200", 0)
    within = None if deadline_ms is None else sum(
        1 for o in outcomes if o.attempts.final == "200" and o.latency_us <= deadline_ms * 1000)
    first, last = _thirds_p50_ms(accepted, duration_s)
    v, reasons, decided_by = verdict(Signals(
        p99_over_p50=ratio, plateau=plateau.found, refusals=refusals,
        retry_after_share=retry_after_share, first_third_p50_ms=first, last_third_p50_ms=last,
        dropped=dropped, requests=len(outcomes),
        timeouts=sum(1 for o in outcomes if o.attempts.final in (TIMEOUT, "504")),
        errors=sum(1 for o in outcomes if o.attempts.final == ERROR)))
    return Summary(
        target=target, rate=rate, duration_s=duration_s, concurrency=concurrency,
        deadline_ms=deadline_ms,
        p50_ms=p50, p90_ms=_pct_ms(acc, 90), p99_ms=p99, p999_ms=_pct_ms(acc, 99.9),
        max_ms=acc.get_max_value() / 1000 if accepted else None,
        p99_over_p50=ratio,
        e2e_p50_ms=_pct_ms(e2e, 50), e2e_p99_ms=_pct_ms(e2e, 99),
        p99_by_window_ms=[_pct_ms(_hist(w), 99) for w in by_window],
        sent=sent,
        answered=sum(1 for o in outcomes if o.attempts.final not in (TIMEOUT, ERROR)),
        dropped=dropped,
        ok_per_s=ok / duration_s if duration_s > 0 else 0.0,
        status_counts=status_counts,
        local_causes=local_causes,
        within_deadline_share=None if within is None else _share(within, sent),
        refusal_rate=_share(sum(1 for o in refused), len(outcomes)),
        retry_after_share=retry_after_share,
        first_retry_success=_share(
            sum(1 for o in retried if o.attempts.statuses[1] == 200), len(retried)
        ) if retried else None,
        mean_retries=(sum(len(o.attempts.statuses) - 1 for o in came_back) / len(came_back)
                      if came_back else None),
        plateau=plateau.found,
        plateau_ms=plateau.level_ms,
        verdict=v,
        verdict_reasons=reasons,
        decided_by=decided_by,
        arrivals=arrivals,
        p50_first_third_ms=first,
        p50_last_third_ms=last,
    )


def _thirds_p50_ms(accepted: Sequence[Outcome], duration_s: float
                   ) -> tuple[float | None, float | None]:
    """Accepted p50 of the first and the last third of the run (by scheduled time)."""
    third = duration_s / 3
    first = [o.accepted_us for o in accepted if o.scheduled_s < third]
    last = [o.accepted_us for o in accepted if o.scheduled_s >= duration_s - third]
    return _pct_ms(_hist(first), 50), _pct_ms(_hist(last), 50)
