"""Where a node process stands with the routers: which process it is (a random instance token
and its start time, sent in every heartbeat), whether a newer process with its id replaced it,
and whether a router may already have acted on a request it fetched, in which case its answer
must take the message through the broker (`plane.contract.ownership`) instead of acking it.

Pure bookkeeping: times are monotonic seconds passed in by the caller.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from plane.contract import replies
from plane.contract.identity import new_instance
from plane.contract.messages import Heartbeat

# For this long after its first heartbeat a node answers through the broker: a router that
# knew an earlier process with this id acts on that one's requests when it hears of this one,
# and a request placed before then may be fetched here.
SETTLE_S = 1.0
# Heartbeats this many periods apart mean a router may have given the node up meanwhile (it
# waits about four): what was fetched before such a gap is answered through the broker.
LAPSE_PERIODS = 2


class Other(enum.Enum):
    """Another process heard on our heartbeat subject."""

    NONE = "none"  # ourselves, or one that is stopping (a predecessor draining)
    OLDER = "older"  # started before us: it stands down
    NEWER = "newer"  # started after us: it serves the id now; we stand down


@dataclass(slots=True)
class Standing:
    period_s: float  # the heartbeat period
    instance: str = field(default_factory=new_instance)
    started_ms: int = field(default_factory=replies.now_ms)
    superseded: bool = False
    settled_s: float = math.inf  # set by the first heartbeat
    sent_s: float = -math.inf  # the last heartbeat
    lapse_seen_s: float = -math.inf  # the last heartbeat that followed a gap

    def heartbeat(self, now_s: float) -> None:
        """A heartbeat went out at `now_s`."""
        if now_s - self.sent_s > LAPSE_PERIODS * self.period_s:
            self.lapse_seen_s = now_s
        if self.settled_s == math.inf:
            self.settled_s = now_s + SETTLE_S
        self.sent_s = now_s

    def must_take(self, fetched_s: float, now_s: float) -> bool:
        """Whether a router may have acted on a request fetched at `fetched_s`: replaced by a
        newer process, fetched before routers surely knew this one, or heartbeats lapsed
        since it was fetched (or now)."""
        return (self.superseded or fetched_s < self.settled_s or self.lapse_seen_s >= fetched_s
                or now_s - self.sent_s > LAPSE_PERIODS * self.period_s)

    def heard(self, hb: Heartbeat) -> Other:
        """A heartbeat on our own subject. A newer live process replaces us (for good)."""
        if hb.instance == self.instance or hb.stopping:
            return Other.NONE
        if (hb.started_ms, hb.instance) < (self.started_ms, self.instance):
            return Other.OLDER
        self.superseded = True
        return Other.NEWER
