"""What one scheduled request came to, as every pulse target reports it.

Targets (the plane over NATS, any HTTP endpoint, the Celery adapter in benchmarks/) return an
`Attempts` for each request; the runner stamps it with the request's scheduled send time and
its end-to-end latency to make an `Outcome`.
"""

from __future__ import annotations

import msgspec

# An attempt sent got no answer within the client's wait (a status made up by the client).
# Not what the client decided without the plane (`targets.attempts_of`): a call never sent
# for a lost connection is an ERROR, and one whose retry never went is UNSENT.
TIMEOUT = "timeout"
ERROR = "error"  # the transport failed (refused, reset, down or dropped, nobody listening)
# The client's own end: the plane answered (a 429, ...), the client waited to try again and
# its deadline passed before the retry could go (its loop late past the Retry-After). Not
# the plane's timeout (no latency of the plane's to count), not a refusal it gave last.
UNSENT = "unsent"


# gc=False on both: they hold only numbers, strings and tuples of them (never a cycle), and a
# long run keeps tens of thousands alive, which the cyclic collector would walk again and again.
class Attempts(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A target's account of one request.

    statuses:        status of each attempt sent, in order (HTTP codes; 0 for timeout/error)
    final:           the final status as a label: "200", "429", ..., "timeout", "error"
    hinted:          how many of the 429s carried a Retry-After (or Retry-After-Ms)
    last_attempt_us: the final attempt alone, from its send to its answer
    local:           why the client made the final up itself, not the target
                     (`plane.client.result.LocalCause`'s value: "no-answer", "closed", ...);
                     "" when the final is the target's own answer
    """

    statuses: tuple[int, ...]
    final: str
    hinted: int = 0
    last_attempt_us: int = 0
    local: str = ""

    @property
    def refusals(self) -> int:
        return sum(1 for s in self.statuses if s == 429)


class Outcome(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One request: its scheduled send time (s from the start), latency from that time to
    its final answer (no coordinated omission), and the target's account."""

    scheduled_s: float
    latency_us: int
    attempts: Attempts

    @property
    def accepted_us(self) -> int:
        """Latency of the attempt that was let in: from the scheduled send time when the
        first attempt was, else from the send of the final attempt (the waits before it were
        announced by Retry-After, not hidden in a queue)."""
        if len(self.attempts.statuses) <= 1:
            return self.latency_us
        return self.attempts.last_attempt_us
