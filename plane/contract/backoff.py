"""The retry policy: one pure function that says how long to wait before the next attempt.

Shared by the SDK (`plane.client`), the gateway's callers and `plane pulse --retry`. It reads
only its arguments (the random draw `u` is passed in), so tests can pin every branch.

Two regimes:

- The server gave a `Retry-After-Ms` and its clock (`Plane-Server-Time`) agrees with ours
  within `max_skew_ms`: trust it. With a ticket, wait exactly that long: a ticket books its
  own start, holders of successive tickets are due at distinct times, and any jitter would
  only make them late (their slot idles until they come). Without one (an estimate shared
  by every caller refused meanwhile), wait that long plus a jitter, so that they do not all
  arrive on the same millisecond: `jitter_ms`, or `jitter_share` of the wait where that is
  more (a router behind on its inbox tells every caller it refuses the same second).
- Otherwise (no hint, or a server whose clock we cannot trust): capped exponential backoff
  with full jitter, `u * min(cap_ms, base_ms * 2 ** (attempt - 1))`.

Either way the wait never runs past the caller's deadline: when the next attempt could not
start before it, the answer is "give up now" (`None`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plane.contract.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4  # 1 = never retry
    base_ms: int = 10  # first fallback wait (full jitter: uniform in [0, base_ms))
    cap_ms: int = 1000  # fallback waits never exceed this
    jitter_ms: int = 2  # added to a trusted Retry-After-Ms without a ticket, in [0, jitter_ms)
    jitter_share: float = 0.1  # ... or in [0, share x Retry-After-Ms), where that is more
    max_skew_ms: int = 2000  # a server clock further off than this is not trusted
    min_attempt_ms: int = 1  # an attempt with less budget left than this is not worth sending

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1 (1 = no retries)")
        if not 0 < self.base_ms <= self.cap_ms:
            raise ConfigError("backoff needs 0 < base_ms <= cap_ms")
        if self.jitter_ms < 0 or self.max_skew_ms < 0 or self.min_attempt_ms < 0:
            raise ConfigError("jitter_ms, max_skew_ms and min_attempt_ms must be >= 0")
        if not 0 <= self.jitter_share <= 1:
            raise ConfigError("jitter_share must be between 0 and 1")


NO_RETRY = RetryPolicy(max_attempts=1)


def retry_delay_ms(
    policy: RetryPolicy,
    *,
    attempt: int,
    remaining_ms: float,
    u: float,
    retry_after_ms: int | None = None,
    server_time_ms: int | None = None,
    local_time_ms: int | None = None,
    ticket: bool = False,
) -> float | None:
    """How long to wait before attempt `attempt + 1`, or None to give up now.

    attempt:         the attempt that was just refused (1 for the first try)
    remaining_ms:    the caller's budget left, measured now on a monotonic clock
    u:               a uniform random draw in [0, 1)
    retry_after_ms:  the server's Retry-After-Ms, if it sent one
    server_time_ms:  the server's Plane-Server-Time (epoch ms), if it sent one
    local_time_ms:   our wall clock (epoch ms) when the reply arrived
    ticket:          the refusal carried a ticket (`Plane-Ticket`): its Retry-After-Ms is
                     this caller's own booked start, kept without jitter
    """
    if attempt >= policy.max_attempts:
        return None
    trusted = (
        retry_after_ms is not None
        and retry_after_ms >= 0
        and server_time_ms is not None
        and local_time_ms is not None
        and abs(server_time_ms - local_time_ms) <= policy.max_skew_ms
    )
    if trusted:
        assert retry_after_ms is not None
        spread = 0.0 if ticket else max(policy.jitter_ms, policy.jitter_share * retry_after_ms)
        delay = retry_after_ms + u * spread
    else:
        delay = u * min(policy.cap_ms, policy.base_ms * 2 ** (attempt - 1))
    if delay + policy.min_attempt_ms > remaining_ms:
        return None
    return delay
