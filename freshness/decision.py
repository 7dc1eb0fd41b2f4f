"""The freshness decision as pure functions: given what the guard sees, use the value, wait
for a fresher one, or degrade. No clock, no I/O: unit-tested with seeded randomness.

Definitions (all in milliseconds):
  lag_ms        ingest_time - event_time of the newest value: how late the data reached us
  age_ms        now - the newest ingest stamp the guard has seen: how stale its view is
  threshold_ms  both must be at or under it for the value to be fresh
  remaining_ms  time left before the request's deadline, less the scoring reserve
"""

from __future__ import annotations

import enum

from freshness.config import OnStale


class Action(enum.StrEnum):
    USE = "use"  # the value is fresh: use it
    WAIT = "wait"  # stale or absent: wait (bounded) for a fresher one, then decide again
    DEGRADE = "degrade"  # stale and no time (or not configured) to wait: fall back


class Source(enum.StrEnum):
    """What a degraded lookup returns."""

    LAST_GOOD = "last-good"  # the newest value that was fresh when it arrived
    NEUTRAL = "neutral"  # nothing fresh ever seen for this key: zeros (no history)


def is_fresh(*, lag_ms: float | None, age_ms: float | None, threshold_ms: float) -> bool:
    """A value is fresh when it exists and neither its lag nor the view's age exceed the
    threshold. `age_ms=None` means the age is not checked."""
    if lag_ms is None:
        return False
    if lag_ms > threshold_ms:
        return False
    return age_ms is None or age_ms <= threshold_ms


def decide(
    *,
    lag_ms: float | None,
    age_ms: float | None,
    threshold_ms: float,
    remaining_ms: float,
    has_last_good: bool,
    on_stale: OnStale = OnStale.WAIT,
    min_wait_ms: float = 1.0,
) -> Action:
    """USE a fresh value; otherwise WAIT when configured to and at least `min_wait_ms` of
    budget is left, else DEGRADE. `has_last_good` does not change whether to wait (a fresher
    value is always better than a fallback) but is part of the decision's inputs so that
    `degrade_source` and this function are tested over the same space."""
    del has_last_good  # documented input; the choice of fallback is `degrade_source`
    if is_fresh(lag_ms=lag_ms, age_ms=age_ms, threshold_ms=threshold_ms):
        return Action.USE
    if on_stale is OnStale.WAIT and remaining_ms >= min_wait_ms:
        return Action.WAIT
    return Action.DEGRADE


def degrade_source(*, has_last_good: bool) -> Source:
    """Stale data is never scored as fresh: a degraded lookup returns the last value that
    was fresh on arrival, or no history at all."""
    return Source.LAST_GOOD if has_last_good else Source.NEUTRAL
