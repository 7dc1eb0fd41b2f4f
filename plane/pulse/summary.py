"""From a run's outcomes to its summary: HDR percentiles, counts, retry figures, the plateau
and the verdict. Pure functions of the outcomes (no clock, no I/O).

Latency figures (`p50_ms` ...) are of *accepted* requests: those answered 200, or that ran out
of time (a timeout or 504 counts at the time it took: a queue must not hide behind a
timeout). Refusals (429, 503) and bad requests are fast answers of another kind and are
counted by status instead. `e2e_*` figures include the waits of client retries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
from hdrh.histogram import HdrHistogram

from plane.pulse.outcome import TIMEOUT, Outcome
from plane.pulse.plateau import detect_plateau

MAX_RATIO = 1.8  # p99/p50 above this: answers wait for each other somewhere
MIN_HINTED = 0.99  # share of 429s that must carry a Retry-After
_HIGHEST_US = 3_600_000_000  # an hour: nothing we measure takes longer
ABSENT, PRESENT, INCONCLUSIVE = "queueing layer absent", "queueing layer present", "inconclusive"


class Summary(msgspec.Struct, kw_only=True):
    target: str
    rate: float
    duration_s: float
    concurrency: int
    deadline_ms: int
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
    first_retry_success: float | None
    mean_retries: float | None
    plateau: bool
    plateau_ms: float | None
    verdict: str
    verdict_reasons: list[str]


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


def verdict(
    p99_over_p50: float | None, plateau: bool, refusals: int, retry_after_share: float | None
) -> tuple[str, list[str]]:
    """"queueing layer absent" only when p99/p50 <= 1.8, no plateau, and the refusals carry
    a Retry-After; "inconclusive" when nothing was measured or nothing was refused (a
    system never pushed past its capacity cannot show how it sheds load)."""
    present: list[str] = []
    if p99_over_p50 is not None and p99_over_p50 > MAX_RATIO:
        present.append(f"p99/p50 = {p99_over_p50:.2f} > {MAX_RATIO}")
    if plateau:
        present.append("plateau in the right tail")
    if refusals and (retry_after_share or 0.0) < MIN_HINTED:
        present.append(f"only {100 * (retry_after_share or 0):.1f}% of 429s carry Retry-After")
    if present:
        return PRESENT, present
    if p99_over_p50 is None:
        return INCONCLUSIVE, ["no accepted answers to measure"]
    if not refusals:
        return INCONCLUSIVE, ["no refusals seen: offer more than the capacity to tell"]
    return ABSENT, [
        f"p99/p50 = {p99_over_p50:.2f} <= {MAX_RATIO}",
        "no plateau",
        f"{100 * (retry_after_share or 0):.1f}% of 429s carry Retry-After",
    ]


def summarize(
    outcomes: Sequence[Outcome],
    *,
    target: str,
    rate: float,
    duration_s: float,
    concurrency: int,
    deadline_ms: int,
    dropped: int,
    windows: int = 6,
) -> Summary:
    accepted = [o for o in outcomes if _is_accepted(o)]
    acc = _hist([o.accepted_us for o in accepted])
    e2e = _hist([o.latency_us for o in accepted])
    p50, p99 = _pct_ms(acc, 50), _pct_ms(acc, 99)
    by_window: list[list[int]] = [[] for _ in range(windows)]
    for o in accepted:
        i = min(windows - 1, max(0, int(o.scheduled_s / duration_s * windows)))
        by_window[i].append(o.accepted_us)
    status_counts = dict(Counter(o.attempts.final for o in outcomes))
    refused = [o for o in outcomes if o.attempts.statuses and o.attempts.statuses[0] == 429]
    retried = [o for o in refused if len(o.attempts.statuses) > 1]
    refusals = sum(o.attempts.refusals for o in outcomes)
    hinted = sum(o.attempts.hinted for o in outcomes)
    retry_after_share = _share(hinted, refusals)
    plateau = detect_plateau([o.accepted_us / 1000 for o in accepted])
    ratio = p99 / p50 if p50 and p99 is not None else None
    sent = len(outcomes) + dropped
    ok = status_counts.get("200", 0)
    within = sum(1 for o in outcomes
                 if o.attempts.final == "200" and o.latency_us <= deadline_ms * 1000)
    v, reasons = verdict(ratio, plateau.found, refusals, retry_after_share)
    return Summary(
        target=target, rate=rate, duration_s=duration_s, concurrency=concurrency,
        deadline_ms=deadline_ms,
        p50_ms=p50, p90_ms=_pct_ms(acc, 90), p99_ms=p99, p999_ms=_pct_ms(acc, 99.9),
        max_ms=acc.get_max_value() / 1000 if accepted else None,
        p99_over_p50=ratio,
        e2e_p50_ms=_pct_ms(e2e, 50), e2e_p99_ms=_pct_ms(e2e, 99),
        p99_by_window_ms=[_pct_ms(_hist(w), 99) for w in by_window],
        sent=sent,
        answered=sum(1 for o in outcomes if o.attempts.final not in (TIMEOUT, "error")),
        dropped=dropped,
        ok_per_s=ok / duration_s if duration_s > 0 else 0.0,
        status_counts=status_counts,
        within_deadline_share=_share(within, sent),
        refusal_rate=_share(sum(1 for o in refused), len(outcomes)),
        retry_after_share=retry_after_share,
        first_retry_success=_share(
            sum(1 for o in retried if o.attempts.statuses[1] == 200), len(retried)
        ) if retried else None,
        mean_retries=(sum(len(o.attempts.statuses) - 1 for o in refused) / len(refused)
                      if retried else None),
        plateau=plateau.found,
        plateau_ms=plateau.level_ms,
        verdict=v,
        verdict_reasons=reasons,
    )
