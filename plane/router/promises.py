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
# How long the schedule's tail (each slot's availability after every promise in the book) is
# used again for the next refusal without running the book through it again (`PromiseBook.
# next_start`). Under overload nearly every request is refused once, and each refusal asked
# when a promise made after all the others can start: a simulation linear in the book, which
# holds up to PROMISE_MAX_LINKS promises a slot (`benchmarks/admission_cost.py`: 43 us a
# refusal at 32 slots, 85 at 64, on this project's CPU host). Within this long the slots'
# own moves are left out (a slot that frees earlier or later than predicted: the schedule
# errs by that much anyway), a promise kept (its holder placed: the slot time it was given is
# that placement now) leaves it as it is, and a promise added at the end of the book is run
# through the tail alone; any other change of the book (a promise expired, replaced, moved)
# runs it all again. Retry-After is told in whole milliseconds.
TAIL_FRESH_S = 0.000_25


@dataclass(slots=True)
class Promise:
    """Ticket `ticket`: its holder may start at `due_s` on any slot, ahead of newcomers, until
    `expires_s`. `service_s` is the slot time it is expected to use (its p50 or mean)."""

    ticket: str
    due_s: float
    expires_s: float
    service_s: float
    issued_s: float = 0.0
    # The start its holder was promised (its due time when made, before a call brings it
    # forward; 0: no ticket's, e.g. a parked newcomer's): how far real starts slip past it
    # is learned (`Admission.slips`).
    promised_s: float = 0.0
    pinned: bool = True  # holds slot time; False: the Retry-After was an estimate only
    parked: bool = False  # its holder is here, waiting for a slot to free
    foreign: bool = False  # made by another router (told on plane.admission.<model>)
    maker: str = ""  # ... that router
    wake: str | None = None  # the holder's inbox for a call (`Plane-Wake`)
    told_s: float = 0.0  # when its holder was told to come back (0: at `due_s`)
    called_s: float = 0.0  # when its holder was called to come now (0: not called)
    slotted: bool = False  # a freed slot was counted as its (`slot_for`)
    # Its holder is on call for work long beside a call's trip (not a stream): called a trip
    # before a slot is predicted to free, not when it frees (`Admission.call_ahead`).
    ahead: bool = False
    caller: str = ""  # whose record it was made in (`Ask.record`): whose no-show if it lapses
    newcomer: bool = False  # a newcomer's, waiting here for its start: no ticket was handed out

    @property
    def back_s(self) -> float:
        """When its holder is expected back: when it was called, else when it was told."""
        return self.called_s or self.told_s or self.due_s

    def start_floor(self, now_s: float) -> float:
        """The earliest it can start: its due time, or now for a holder that is here or late."""
        return now_s if self.parked else max(now_s, self.due_s)


def _slots_heap(free_s: Sequence[float], now_s: float) -> list[float]:
    heap = [t if t > now_s else now_s for t in free_s]
    heap.sort()  # a sorted list is a heap
    return heap


def _advance(heap: list[float], promises: Iterable[Promise], now_s: float,
             starts: dict[str, float] | None = None) -> None:
    """Run `promises` (in due order) through `heap`, the slots' free times (a non-empty
    heap); record each start in `starts` when given."""
    replace = heapq.heapreplace  # one C call for the pop and the push
    for p in promises:
        # `start_floor`, inlined: this loop runs for every open promise on most decisions
        # made under overload (8 x 1 ms at 2x: a third of the router's CPU before).
        floor = now_s if p.parked or p.due_s < now_s else p.due_s
        top = heap[0]
        start = top if top > floor else floor
        if starts is not None:
            starts[p.ticket] = start
        replace(heap, start + p.service_s)


def simulate(free_s: Sequence[float], promises: Iterable[Promise], now_s: float
             ) -> tuple[dict[str, float], list[float]]:
    """Each promise's predicted start, and each slot's predicted availability after them.

    `free_s`: each healthy slot's predicted free time (now when idle); `promises` in due order.
    """
    heap = _slots_heap(free_s, now_s)
    starts: dict[str, float] = {}
    if heap:
        _advance(heap, promises, now_s, starts)
    return starts, heap


def next_start(free_s: Sequence[float], promises: Iterable[Promise], now_s: float) -> float:
    """When a new promise, made now after every existing one, can start."""
    heap = _slots_heap(free_s, now_s)
    if not heap:
        return now_s
    _advance(heap, promises, now_s)
    return heap[0]


def would_delay(free_s: Sequence[float], protected: Sequence[Promise], now_s: float,
                hold_s: float) -> bool:
    """Whether starting a request now on an idle slot, holding it for `hold_s`, makes any
    `protected` promise start later than it would otherwise and later than it was promised.

    `free_s` must contain `now_s` (or earlier) for the idle slot the request would take.

    The two schedules (without and with the request) are run side by side and stop as soon as
    the answer is known: at the first promise made late, or once they agree again. The
    schedule with the request never frees a slot earlier than the one without (each step pops
    the earliest and pushes a monotone function of it), so as sorted lists one dominates the
    other entry by entry, and equal sums mean equal schedules: every promise after starts at
    the same time in both.
    """
    if not protected:
        return False
    before = _slots_heap(free_s, now_s)
    after = before.copy()
    after[0] = now_s + hold_s  # the earliest entry is an idle slot: the one it takes
    heapq.heapify(after)
    gap = hold_s  # sum(after) - sum(before)
    eps = 1e-9 * (len(before) + 1)
    replace = heapq.heapreplace
    for p in protected:
        if gap <= eps:
            return False
        due = p.due_s if p.due_s > now_s else now_s
        floor = now_s if p.parked else due
        top_b, top_a = before[0], after[0]
        b = top_b if top_b > floor else floor
        a = top_a if top_a > floor else floor
        replace(before, b + p.service_s)
        replace(after, a + p.service_s)
        gap += (a - top_a) - (b - top_b)
        if a > max(b, due + ON_TIME_SLACK_S) + 1e-9:
            return True
    return False


class PromiseBook:
    """One model's pinned promises, in due order."""

    __slots__ = ("_dues", "_expires_floor_s", "_items", "_tail", "_tail_at_s")

    def __init__(self) -> None:
        self._items: list[Promise] = []
        self._dues: list[float] = []
        # The schedule's tail (`next_start`) and when it was run; None: to run again.
        self._tail: list[float] | None = None
        self._tail_at_s = 0.0
        # No promise expires before this: `expire` looks at none until then (it runs on every
        # decision, and a model's book holds up to PROMISE_MAX_LINKS promises a slot under
        # overload). An expiry moved earlier goes through `expires_at`; later, a floor stays one.
        self._expires_floor_s = float("inf")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Promise]:
        return iter(self._items)

    def add(self, p: Promise) -> None:
        i = bisect.bisect_right(self._dues, p.due_s)
        self._items.insert(i, p)
        self._dues.insert(i, p.due_s)
        if p.expires_s < self._expires_floor_s:
            self._expires_floor_s = p.expires_s
        if self._tail is not None:
            if i == len(self._items) - 1:  # after every other: through the tail alone
                _advance(self._tail, (p,), self._tail_at_s)
            else:
                self._tail = None

    def remove(self, p: Promise, *, kept: bool = False) -> bool:
        """Take `p` out of the book. `kept`: its holder was placed now, and the slot time the
        schedule gave it is that placement's, which the tail holds already (within the
        slots' own moves, as `next_start` takes them); otherwise the schedule runs again."""
        for i, q in enumerate(self._items):
            if q is p:
                del self._items[i]
                del self._dues[i]
                if not kept:
                    self._tail = None
                return True
        return False

    def next_start(self, free_s: Sequence[float], now_s: float) -> float:
        """When a promise made now after every one in the book can start (`next_start` of
        the slots' free times `free_s` and the book), from the tail run at most TAIL_FRESH_S
        ago for as many slots when there is one."""
        tail = self._tail
        if (tail is None or now_s - self._tail_at_s > TAIL_FRESH_S
                or now_s < self._tail_at_s or len(tail) != len(free_s)):
            tail = _slots_heap(free_s, now_s)
            if not tail:
                self._tail = None
                return now_s
            _advance(tail, self._items, now_s)
            self._tail, self._tail_at_s = tail, now_s
        return tail[0] if tail[0] > now_s else now_s

    def expires_at(self, p: Promise, expires_s: float) -> None:
        """`p` (in this book) now expires at `expires_s`: the only way to move it earlier."""
        p.expires_s = expires_s
        if expires_s < self._expires_floor_s:
            self._expires_floor_s = expires_s

    def bring_forward(self, p: Promise, due_s: float) -> None:
        """`p` is due earlier now (its holder was called early): moved to its new place."""
        if self.remove(p):
            p.due_s = due_s
            self.add(p)

    def expire(self, now_s: float, spare: Promise | None = None) -> list[Promise]:
        """Drop and return the promises whose holders did not come in time (`spare`'s did:
        it is kept, whatever its time)."""
        if now_s <= self._expires_floor_s:
            return []
        gone = [p for p in self._items if p.expires_s < now_s and p is not spare]
        if gone:
            self._items = [p for p in self._items if p.expires_s >= now_s or p is spare]
            self._dues = [p.due_s for p in self._items]
            self._tail = None
        self._expires_floor_s = min((p.expires_s for p in self._items), default=float("inf"))
        return gone
