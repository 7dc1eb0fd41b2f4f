"""A run over time and over its percentiles: what pulse's picture draws. Pure functions of the
outcomes (no clock, no I/O, no plotting).

- `per_second`: for each second of scheduled sends, the p50 and p99 of the accepted answers
  and of the refusals (how fast a 429 came back, for those not retried), the arrivals and the
  share refused on the first try.
- `percentile_curve`: accepted latency at percentiles 0 .. 99.999 spaced for a log axis of
  1 / (1 - p) (HDR-style: the tail gets the room).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from plane.contract.quantiles import nearest_rank
from plane.pulse.outcome import TIMEOUT, Outcome

CURVE_PERCENTILES = (0.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 99.999)


class Second(msgspec.Struct, frozen=True, kw_only=True):
    t_s: int  # the second of the scheduled sends, from the start
    arrivals: int
    refused: int  # refused on the first try (429)
    accepted_p50_ms: float | None
    accepted_p99_ms: float | None
    refused_p50_ms: float | None
    refused_p99_ms: float | None

    @property
    def refusal_rate(self) -> float | None:
        return self.refused / self.arrivals if self.arrivals else None


def _pcts(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    xs.sort()
    return nearest_rank(xs, 0.5), nearest_rank(xs, 0.99)


def _first_refused(o: Outcome) -> bool:
    return bool(o.attempts.statuses) and o.attempts.statuses[0] == 429


def per_second(outcomes: Sequence[Outcome]) -> list[Second]:
    if not outcomes:
        return []
    last = int(max(o.scheduled_s for o in outcomes))
    accepted: list[list[float]] = [[] for _ in range(last + 1)]
    refused: list[list[float]] = [[] for _ in range(last + 1)]
    arrivals, n_refused = [0] * (last + 1), [0] * (last + 1)
    for o in outcomes:
        i = int(o.scheduled_s)
        arrivals[i] += 1
        if _first_refused(o):
            n_refused[i] += 1
            # How fast the refusal came: known when it was not retried (an outcome keeps only
            # its last attempt's time).
            first_us = o.latency_us if len(o.attempts.statuses) == 1 else None
            if first_us is not None:
                refused[i].append(first_us / 1000)
        if o.attempts.final in ("200", "504", TIMEOUT):
            accepted[i].append(o.accepted_us / 1000)
    out = []
    for i in range(last + 1):
        a50, a99 = _pcts(accepted[i])
        r50, r99 = _pcts(refused[i])
        out.append(Second(t_s=i, arrivals=arrivals[i], refused=n_refused[i],
                          accepted_p50_ms=a50, accepted_p99_ms=a99,
                          refused_p50_ms=r50, refused_p99_ms=r99))
    return out


def percentile_curve(latencies_ms: Sequence[float]) -> list[tuple[float, float]]:
    """(percentile, latency ms) at CURVE_PERCENTILES the data can resolve (1 / (1 - p) at
    most the number of samples), always ending at the max."""
    if not latencies_ms:
        return []
    xs = sorted(latencies_ms)
    n = len(xs)
    curve = [(p, nearest_rank(xs, p / 100)) for p in CURVE_PERCENTILES
             if p == 0.0 or 1 / (1 - p / 100) <= n]
    max_p = 100 * (1 - 1 / (n + 1))  # where the max sits on the 1 / (1 - p) axis
    if curve[-1][0] < max_p:
        curve.append((max_p, xs[-1]))
    return curve
