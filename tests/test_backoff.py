"""The retry policy is one pure function: every branch pinned here with explicit draws."""

from __future__ import annotations

import random

import pytest

from plane.contract.backoff import NO_RETRY, RetryPolicy, retry_delay_ms
from plane.contract.errors import ConfigError

NOW = 1_700_000_000_000
P = RetryPolicy(max_attempts=5, base_ms=10, cap_ms=80, jitter_ms=2, max_skew_ms=2000)


def delay(**kw: object) -> float | None:
    args: dict[str, object] = {"attempt": 1, "remaining_ms": 10_000.0, "u": 0.5}
    args.update(kw)
    return retry_delay_ms(P, **args)  # type: ignore[arg-type]


def test_trusted_retry_after_plus_small_jitter() -> None:
    assert delay(retry_after_ms=15, server_time_ms=NOW, local_time_ms=NOW, u=0.0) == 15
    assert delay(retry_after_ms=15, server_time_ms=NOW + 1999, local_time_ms=NOW, u=0.5) == 16
    d = delay(retry_after_ms=15, server_time_ms=NOW - 2000, local_time_ms=NOW, u=0.999)
    assert d is not None and 15 <= d < 17


def test_a_long_wait_shared_by_many_is_spread_by_a_share_of_it() -> None:
    """A router behind on its inbox tells every caller it refuses unread the same second: a
    tenth of it spreads their return (2 ms would bring them back as one burst)."""
    assert delay(retry_after_ms=1000, server_time_ms=NOW, local_time_ms=NOW, u=0.0) == 1000
    assert delay(retry_after_ms=1000, server_time_ms=NOW, local_time_ms=NOW, u=0.5) == 1050
    d = delay(retry_after_ms=1000, server_time_ms=NOW, local_time_ms=NOW, u=0.999)
    assert d is not None and 1099 < d < 1100
    assert delay(retry_after_ms=1000, server_time_ms=NOW, local_time_ms=NOW, u=0.5,
                 ticket=True) == 1000  # a ticket is still kept on the millisecond


def test_a_ticket_is_kept_on_the_millisecond() -> None:
    """A ticket books this caller's own start: no jitter, whatever the draw (a holder late by
    the jitter leaves its slot idle); a skewed clock still falls back to backoff."""
    for u in (0.0, 0.5, 0.999):
        assert delay(retry_after_ms=40, server_time_ms=NOW, local_time_ms=NOW, u=u,
                     ticket=True) == 40
    assert delay(retry_after_ms=40, server_time_ms=NOW + 5000, local_time_ms=NOW, u=0.5,
                 ticket=True) == 5


@pytest.mark.parametrize("server_ms", [NOW + 2001, NOW - 5000, None])
def test_untrusted_clock_falls_back_to_full_jitter(server_ms: int | None) -> None:
    # attempt 1: uniform in [0, base); attempt 3: [0, base * 4)
    assert delay(retry_after_ms=40, server_time_ms=server_ms, local_time_ms=NOW, u=0.5) == 5
    assert delay(retry_after_ms=40, server_time_ms=server_ms, local_time_ms=NOW, u=0.5,
                 attempt=3) == 20


def test_no_hint_backoff_is_capped_and_never_negative(rng: random.Random) -> None:
    for attempt in range(1, 5):
        for _ in range(200):
            d = delay(attempt=attempt, u=rng.random())
            assert d is not None and 0 <= d < min(P.cap_ms, P.base_ms * 2 ** (attempt - 1))
    big = RetryPolicy(max_attempts=10_000, base_ms=10, cap_ms=80)
    assert retry_delay_ms(big, attempt=5000, remaining_ms=1e9, u=0.999) == pytest.approx(79.92)


def test_never_sleeps_past_the_deadline() -> None:
    assert delay(retry_after_ms=40, server_time_ms=NOW, local_time_ms=NOW, u=0.0,
                 remaining_ms=40.5) is None
    assert delay(retry_after_ms=40, server_time_ms=NOW, local_time_ms=NOW, u=0.0,
                 remaining_ms=41.0) == 40
    assert delay(u=0.5, remaining_ms=5.5) is None
    assert delay(u=0.5, remaining_ms=0.0) is None


def test_attempts_are_bounded() -> None:
    assert delay(attempt=4) is not None
    assert delay(attempt=5) is None
    assert retry_delay_ms(NO_RETRY, attempt=1, remaining_ms=1e6, u=0.1) is None


@pytest.mark.parametrize(
    "kw",
    [{"max_attempts": 0}, {"base_ms": 0}, {"base_ms": 100, "cap_ms": 50}, {"jitter_ms": -1},
     {"jitter_share": -0.1}, {"jitter_share": 1.5}],
)
def test_policy_is_validated(kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kw)
