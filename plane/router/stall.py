"""When the router's own loop or process stood still, and what that means for what it reads.

A request's wait in the router's inbox runs from its receipt, stamped as nats-py hands it to
the subscription (`plane.router.receipt`). A router whose process stopped (SIGSTOP, a long GC
pause, a VM's stolen time, a swap storm) or whose loop was blocked reads nothing meanwhile:
the requests sent to it sit in its socket, and each got a fresh stamp when it was read at
last. So a router stopped for 5 s read its backlog as fresh and decided it: 429 `busy`
tickets "come back in 40 ms" for slot time another router had been promising meanwhile (none
of 35 retries served), 503 `no-capacity` (it had forgotten the nodes it did not hear), all
2-5 s after the callers sent them (/tmp/probeF, finding 2).

The watchdog's tick is the loop's sign of life: before it sleeps it says when it is due to
wake (`sleeping`), and as it wakes it looks (`woke`). A read stamped more than `bound_s`
(the inbox's `max_inbox_wait_ms`, at least `MIN_STALL_S`) past that due time, or the
watchdog's own late wake, means the loop stood still since then (`look`): whatever is read
in the burst that follows may have waited that long, and the inbox (`plane.router.inbox`)
takes it as having come when the loop stopped, so that it takes the path of a request that
waited past the bound (refused unread, 429 `overloaded`, or `deadline`). A stall shorter
than the bound leaves no read past it, and the reads of a loop that keeps time cost two
comparisons.

Only a stall of `MIN_STALL_S` or more counts. Those read after it came at any time during
it, most of them late in a short one: taken as having come at its start, everything read
after a 60-100 ms pause (a collection, a blocking import: frequent in the tests' own
process, where routers, nodes, the gateway and its callers share one loop) was refused
`overloaded`, the request sent in its last millisecond too (a clean clone's
`test_gateway_edges`). A shorter stall hides at most that much wait, as before this module.
"""

from __future__ import annotations

import math

import structlog

log = structlog.get_logger("plane.router.stall")

# What was sent during a stall sits in the socket, ahead of anything sent after it, and
# nats-py reads it out in a few milliseconds once the loop runs (a read a turn of the loop,
# up to 32 KiB, ~100 requests; the inbox lets the loop turn every millisecond): reads later
# than this after the stall was seen are not its backlog. (Bounded by the stall's own length
# alone, an idle inbox's first request a second after a 2 s stall was refused as stale.)
BURST_S = 0.1
# The shortest stall taken as one (see the module): a stop, a swap storm, a stolen VM are
# seconds; a collection or a blocking call, tens of milliseconds.
MIN_STALL_S = 0.25


class LoopStalls:
    """The router loop's last stall, as its watchdog and its reads see it (see the module)."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = max(bound_s, MIN_STALL_S)
        # A read stamped after this: the loop stood still (inf: not watched, before the
        # watchdog's first sleep and after its last).
        self.late_s = math.inf
        self.since_s = -math.inf  # the last stall: from when the loop stood still
        self.seen_s = -math.inf  # and when it was seen over (by a read or the watchdog)
        self.count = 0

    def sleeping(self, now_s: float, for_s: float) -> None:
        """The watchdog sleeps `for_s` from `now_s`: it is due to wake then."""
        self.late_s = now_s + for_s + self.bound_s

    def woke(self, now_s: float) -> None:
        """The watchdog woke at `now_s` (a stall seen if it is late); its tick runs now."""
        self.look(now_s)
        self.late_s = now_s + self.bound_s

    def off(self) -> None:
        """The watchdog has stopped: nothing says when the loop stood still any more."""
        self.late_s = math.inf

    def look(self, now_s: float) -> bool:
        """Whether the loop, alive at `now_s`, stood still past the bound just before it."""
        if now_s <= self.late_s:
            return False
        self.since_s, self.seen_s = self.late_s - self.bound_s, now_s
        self.late_s = now_s + self.bound_s
        self.count += 1
        log.warning("the router's loop stood still: what it reads now may have waited that "
                    "long, and is refused unread as waited past max_inbox_wait_ms (a stopped "
                    "process, a long GC pause, a starved VM: look at the host)",
                    stood_still_ms=round((now_s - self.since_s) * 1000))
        return True

    def waited_s(self, at_s: float) -> float:
        """How long a read at `at_s` in the burst after the last stall may have waited."""
        return at_s - self.since_s

    def burst_over(self, at_s: float, drained_s: float) -> bool:
        """Whether a read at `at_s` comes after the burst that followed the last stall: the
        inbox drained since it was seen (`drained_s`), or reading has lasted longer than the
        stall did, or than BURST_S (its backlog read; what comes now is what keeps coming)."""
        return drained_s >= self.seen_s or (
            at_s - self.seen_s > min(self.seen_s - self.since_s, BURST_S))

