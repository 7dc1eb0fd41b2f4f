"""The plateau detector: does the right tail of a latency set show the mark of a queue?

A service without a queue answers in about its service time, with a tail that thins out fast
(exponential, log-normal, even Pareto: most of the tail mass sits just above the body). A
saturated queue leaves a different mark: mass far above the fastest answers that does *not*
thin out. While the backlog grows, waits spread evenly from nothing to the current backlog (a
flat shelf in the histogram); once a concurrency cap or a timeout bounds it, answers pile up at
that ceiling (a flat top in the percentile plot). Either way the far tail holds a real share of
the requests, and its upper half holds a real share of that tail.

The test, on a set of latencies:

1. floor  = the 0.1th percentile (the fastest answers: service time with no wait);
2. far    = latencies above `far_factor * floor` (waits of several service times);
3. plateau when `far` holds at least `min_share` of all answers, and the upper half of its
   range (by value, up to the max) holds at least `upper_share` of the far mass.

Pure: a function of its arguments only, tested with seeded synthetic latency sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from plane.contract.quantiles import nearest_rank


class Plateau(msgspec.Struct, frozen=True, kw_only=True):
    found: bool
    floor_ms: float  # the fastest answers (0.1th percentile)
    far_share: float  # share of answers above far_factor * floor
    upper_share: float  # share of that far mass in the upper half of its range
    level_ms: float | None = None  # the median of the far tail, when a plateau is found


def detect_plateau(
    latencies_ms: Sequence[float],
    *,
    far_factor: float = 3.0,
    min_share: float = 0.02,
    upper_share: float = 0.25,
    min_samples: int = 50,
) -> Plateau:
    """Look for a queue's plateau in the right tail of `latencies_ms` (see module doc)."""
    if len(latencies_ms) < min_samples:
        return Plateau(found=False, floor_ms=0.0, far_share=0.0, upper_share=0.0)
    xs = sorted(latencies_ms)
    floor = max(nearest_rank(xs, 0.001), 1e-9)
    far = [x for x in xs if x > far_factor * floor]
    far_share = len(far) / len(xs)
    if not far:
        return Plateau(found=False, floor_ms=floor, far_share=0.0, upper_share=0.0)
    lo, hi = far_factor * floor, far[-1]
    mid = lo + (hi - lo) / 2
    upper = sum(1 for x in far if x >= mid) / len(far)
    found = far_share >= min_share and upper >= upper_share
    return Plateau(
        found=found,
        floor_ms=floor,
        far_share=far_share,
        upper_share=upper,
        level_ms=far[len(far) // 2] if found else None,
    )
