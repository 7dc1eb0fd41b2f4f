"""Promises made with 429s, pooled over a model's slots, and the schedule they imply.

A refused caller is promised a start time, not a slot: any slot of the model that frees may
keep the promise. Pooling is what makes a promise worth trusting. Pinned to one slot, every
earlier holder's variance (a late arrival, a slow request) adds up along that slot's chain and
the last holder finds its slot still busy; pooled over N slots, a holder is served by whichever
slot frees first (one queue in front of N servers rather than N queues), so a slip on one
slot costs the next holder a fraction of a service time rather than all of it.

The schedule is a small simulation: each slot is available at its predicted free time (now when
idle), and promises in due order each take the earliest available slot, starting at
`max(available, due)` and holding it for their expected service time. It answers the two
questions admission asks: when can the next promise start, and would placing a request now make
an earlier promise start late. Pure logic: monotonic seconds in, no I/O.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

# A promise counts as kept when its holder can start within this long of its due time.
ON_TIME_SLACK_S = 0.001


@dataclass(slots=True)
class Promise:
    """Ticket `ticket`: its holder may start at `due_s` on any slot, ahead of newcomers, until
    `expires_s`. `service_s` is the slot time it is expected to use (its p50 or mean)."""

    ticket: str
    due_s: float
    expires_s: float
    service_s: float
    issued_s: float = 0.0
    pinned: bool = True  # holds slot time; False: the Retry-After was an estimate only
    parked: bool = False  # its holder is here, waiting for a slot to free
    foreign: bool = False  # made by another router (told on plane.admission.<model>)

    def start_floor(self, now_s: float) -> float:
        """The earliest it can start: its due time, or now for a holder that is here or late."""
        return now_s if self.parked else max(now_s, self.due_s)


def simulate(free_s: Sequence[float], promises: Iterable[Promise], now_s: float
             ) -> tuple[dict[str, float], list[float]]:
    """Each promise's predicted start, and each slot's predicted availability after them.

    `free_s`: each healthy slot's predicted free time (now when idle); `promises` in due order.
    """
    heap = [max(now_s, t) for t in free_s]
    heapq.heapify(heap)
    starts: dict[str, float] = {}
    if not heap:
        return starts, heap
    for p in promises:
        start = max(heapq.heappop(heap), p.start_floor(now_s))
        starts[p.ticket] = start
        heapq.heappush(heap, start + p.service_s)
    return starts, heap


def next_start(free_s: Sequence[float], promises: Iterable[Promise], now_s: float) -> float:
    """When a new promise, made now after every existing one, can start."""
    _, heap = simulate(free_s, promises, now_s)
    return heap[0] if heap else now_s


def would_delay(free_s: Sequence[float], protected: Sequence[Promise], now_s: float,
                hold_s: float) -> bool:
    """Whether starting a request now on an idle slot, holding it for `hold_s`, makes any
    `protected` promise start later than it would otherwise and later than it was promised.

    `free_s` must contain `now_s` (or earlier) for the idle slot the request would take.
    """
    if not protected:
        return False
    before, _ = simulate(free_s, protected, now_s)
    taken = sorted(free_s)
    taken[0] = now_s + hold_s  # the earliest entry is an idle slot: the one it takes
    after, _ = simulate(taken, protected, now_s)
    for p in protected:
        kept_by = max(before[p.ticket], max(now_s, p.due_s) + ON_TIME_SLACK_S)
        if after[p.ticket] > kept_by + 1e-9:
            return True
    return False


class PromiseBook:
    """One model's pinned promises, in due order."""

    __slots__ = ("_dues", "_items")

    def __init__(self) -> None:
        self._items: list[Promise] = []
        self._dues: list[float] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Promise]:
        return iter(self._items)

    def add(self, p: Promise) -> None:
        i = bisect.bisect_right(self._dues, p.due_s)
        self._items.insert(i, p)
        self._dues.insert(i, p.due_s)

    def remove(self, p: Promise) -> bool:
        for i, q in enumerate(self._items):
            if q is p:
                del self._items[i]
                del self._dues[i]
                return True
        return False

    def expire(self, now_s: float) -> list[Promise]:
        """Drop and return the promises whose holders did not come in time."""
        gone = [p for p in self._items if p.expires_s < now_s]
        if gone:
            keep = [p for p in self._items if p.expires_s >= now_s]
            self._items = keep
            self._dues = [p.due_s for p in keep]
        return gone
