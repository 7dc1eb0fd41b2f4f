"""A tenant's `max_rate.<tenant>`: a token bucket whose refusals book the next tokens.

Pure: times are monotonic seconds passed in, the rate comes from the live settings.

A bucket of `rate` tokens a second, RATE_BURST_S of them at most, lets a request through
when it holds a whole token. A request refused for want of one is given a ticket for the
bucket's next token not already booked: the token is taken from the bucket now (the count
goes below zero), and the ticket's holder, back at its Retry-After with the ticket, passes
without taking another. A newcomer of the tenant finds a token only once every booked one
is covered, so it cannot take the token a holder was told of. (With the Retry-After only an
estimate, a caller back on time competed with its own tenant's new arrivals, which took the
token first: at 75/s against `max_rate` 20, 86 retries were served and 2,692 refused
`tenant-limit` again; found from outside, probe F.)

A booked token is held for its holder until RESERVE_LATE_S past its time; then it lapses,
goes back into the bucket (nobody used it) and counts as a no-show. While fewer than
MIN_REDEMPTION of a caller's tickets are redeemed (an exponential average kept per caller,
`Ask.record`, as for the slots' promises in `plane.router.admission`), its refusals carry a
ticket that books no token: the holder that comes back goes as a newcomer, and counts as
redeemed, so callers that never retry cannot keep their tenant's tokens booked for nobody,
and do not stop the tenant's callers that do retry from booking theirs.

A refusal whose next token falls after the caller's last start (its deadline less the
work's p99) less RESERVE_MARGIN_S books nothing and says `deadline`; one whose token would
be more than RESERVE_AHEAD_S away (or past RESERVED_MAX tickets) books nothing and says
`overloaded`: both final (go elsewhere now), as for the slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from plane.contract.messages import Reason
from plane.router.caller import Redemptions

RATE_BURST_S = 0.1  # a rate limit lets this many seconds' worth through at once
RESERVE_LATE_S = 0.05  # a booked token waits this long past its time for a late holder
RESERVE_EARLY_S = 0.002  # a holder this early is let through (the reply's rounding)
# A token is booked only this long before the holder's last start at least: it comes back a
# trip and a timer after the token's time. (Booked up to the last start, 25-28 of ~200
# holders at 300 ms deadlines came back just past it and were refused `deadline`.)
RESERVE_MARGIN_S = 0.010
RESERVE_AHEAD_S = 1.0  # tokens are booked at most this far ahead
RESERVED_MAX = 1000  # and at most this many at once (bounded state at any rate)
CALLERS_MAX = 256  # callers whose averages a bucket keeps (the least recently counted go)


@dataclass(frozen=True, slots=True)
class OverRate:
    """Refused by the rate limit: come back in `retry_after_ms` (with `ticket`, if any);
    `reason`: `tenant-limit`, or final (`deadline`, `overloaded`) when nothing was booked
    for it."""

    retry_after_ms: int
    ticket: str | None = None
    reason: Reason = Reason.TENANT_LIMIT


@dataclass(slots=True)
class Booked:
    due_s: float  # the booked token's time (the Retry-After told, whole ms)
    pinned: bool  # took a token from the bucket (else a ticket that books nothing)
    caller: str  # whose record it settles in


@dataclass(slots=True)
class RateBucket:
    tokens: float = math.inf  # inf: no limit seen yet
    at_s: float = 0.0
    booked: dict[str, Booked] = field(default_factory=dict)  # ticket -> booking, due order
    # Per caller, the share of its tickets whose holders came back (as for the slots').
    redemption: Redemptions[str] = field(default_factory=lambda: Redemptions(CALLERS_MAX))

    def clear(self) -> None:
        """The limit was lifted: nothing is held."""
        self.tokens, self.booked = math.inf, {}

    def take(self, rate: int, now_s: float, ticket: str | None, latest_start_s: float,
             new_ticket: Callable[[], str], caller: str = "") -> OverRate | None:
        """Let a request through (None) or refuse it. `ticket`: the one it brought (a holder
        of a booked token passes on it, once); `latest_start_s`: the last moment it may
        start and meet its deadline; `caller`: the record a ticket given to it is judged
        in."""
        burst = max(1.0, rate * RATE_BURST_S)
        if self.tokens == math.inf:
            self.tokens, self.at_s = burst, now_s
        self.tokens = min(burst, self.tokens + (now_s - self.at_s) * rate)
        self.at_s = now_s
        self._lapse(now_s, burst)
        if ticket is not None and (b := self.booked.get(ticket)) is not None:
            if b.pinned and now_s < b.due_s - RESERVE_EARLY_S:
                # Early: its token is not due yet. Told again, the same ticket.
                return OverRate(_ms(b.due_s - now_s), ticket)
            del self.booked[ticket]
            self.redemption.settle(b.caller, redeemed=True)
            if b.pinned:
                return None  # its token was taken when it was booked
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        wait_ms = _ms((1.0 - self.tokens) / rate)
        due_s = now_s + wait_ms / 1000
        if due_s + RESERVE_MARGIN_S > latest_start_s:
            return OverRate(wait_ms, reason=Reason.DEADLINE)
        if due_s - now_s > RESERVE_AHEAD_S or len(self.booked) >= RESERVED_MAX:
            return OverRate(wait_ms, reason=Reason.OVERLOADED)
        pinned = self.redemption.pins(caller)
        if pinned:  # else it books nothing: told when a token frees, were it not taken
            self.tokens -= 1.0
        given = new_ticket()
        self.booked[given] = Booked(due_s, pinned, caller)
        return OverRate(wait_ms, given)

    def _lapse(self, now_s: float, burst: float) -> None:
        """Bookings whose holder did not come in time: no-shows, their tokens back."""
        while self.booked:
            ticket, b = next(iter(self.booked.items()))
            if b.due_s + RESERVE_LATE_S >= now_s:
                break
            del self.booked[ticket]
            if b.pinned:
                self.tokens = min(burst, self.tokens + 1.0)
            self.redemption.settle(b.caller, redeemed=False)


def _ms(s: float) -> int:
    """Whole milliseconds, at least 1 (1e-6: float noise)."""
    return max(1, math.ceil(s * 1000 - 1e-6))
