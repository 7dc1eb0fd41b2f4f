"""Admission: an ordered list of small checks, each returning a refusal or passing, then the
slot choice that honours tickets.

Tickets make Retry-After a promise. Each refused caller gets the earliest time a slot will be
free *and not already promised*, and a reservation on that slot from then; successive refused
callers get successive free times. A caller that comes back with its ticket may use its
reserved slot (or any slot nobody was promised); a newcomer may use a free slot only when it
predicts to finish before the next promise on it is due. Pure logic: no I/O, monotonic time in.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from plane.budget import Prediction, fits
from plane.messages import Reason, Status
from plane.occupancy import ModelSlots, Reservation, SlotView

# A reservation is kept this long past its due time for a late holder (then released).
# It covers the reply's trip, the caller's timer and the SDK's jitter (up to 2 ms).
LATE_TOLERANCE_MIN_S = 0.025
LATE_TOLERANCE_MAX_S = 0.100
LATE_TOLERANCE_SHARE = 1.0  # of the predicted p50 service time, within [MIN, MAX]
# Promises are due this much before the slot is predicted to free: the holder's trip back
# takes about that long, and a holder that arrives a moment early is parked (below).
RETURN_LEAD_S = 0.001
# A holder whose own slot is about to free waits for it (on the slot's done-event) at most
# this long, instead of being refused again: the slot starts its request the moment it frees.
# The window is the predicted p99 - p50 spread plus a margin, plus a drift allowance for
# promises made far ahead (each earlier holder's own variance adds up along a slot's chain),
# within [MIN, half the p50 service time].
PARK_MIN_S = 0.008
PARK_MARGIN_S = 0.002
PARK_DRIFT_SHARE = 0.05  # of how far ahead the promise was made
PARK_MAX_SHARE = 1.0
# Promises pin slot time only while callers come back for them: below this share of
# redeemed tickets (an exponential average), refusals carry a Retry-After estimate and a
# ticket but pin no slot, so callers who never retry cannot leave slots idle.
MIN_REDEMPTION = 0.5
# At most this many promises wait on one slot: a promise deep in a slot's chain drifts (every
# earlier holder's variance adds up) and keeps a caller waiting who could go elsewhere now.
# Beyond it the refusal says `deadline`: go elsewhere at once.
PROMISE_MAX_LINKS = 8
REDEMPTION_WEIGHT = 0.05


def _within(lo: float, hi: float, x: float) -> float:
    return max(lo, min(hi, x))


@dataclass(frozen=True, slots=True)
class Ask:
    """One request, as admission sees it."""

    now_s: float
    deadline_s: float  # monotonic
    prediction: Prediction
    ticket: str | None = None
    avoid_node: str | None = None
    park_until_s: float | None = None  # set while a parked holder is re-deciding

    @property
    def remaining_us(self) -> int:
        return int((self.deadline_s - self.now_s) * 1e6)


@dataclass(frozen=True, slots=True)
class Place:
    candidates: list[SlotView]
    redeemed: Reservation | None


@dataclass(frozen=True, slots=True)
class Park:
    """A ticket holder whose slot frees within moments: wait for it until `until_s`."""

    view: SlotView
    until_s: float
    holder: Reservation


@dataclass(frozen=True, slots=True)
class Refuse:
    status: Status
    reason: Reason
    message: str
    retry_after_ms: int | None = None
    ticket: str | None = None


Check = Callable[[ModelSlots, Ask], Refuse | None]


def check_capacity(ms: ModelSlots, ask: Ask) -> Refuse | None:
    if ms.healthy_count() == 0:
        return Refuse(
            Status.UNAVAILABLE, Reason.NO_CAPACITY,
            f"no healthy slot serves model {ms.model!r} right now", retry_after_ms=1000,
        )
    return None


def check_budget(ms: ModelSlots, ask: Ask) -> Refuse | None:
    if not fits(ask.prediction, ask.remaining_us):
        return Refuse(
            Status.BUSY, Reason.DEADLINE,
            f"a {ms.model} request takes about {ask.prediction.p99_us} us (p99); the deadline "
            f"leaves {max(0, ask.remaining_us)} us: raise Plane-Deadline-Ms or go elsewhere",
            retry_after_ms=0,
        )
    return None


CHECKS: tuple[Check, ...] = (check_capacity, check_budget)


class Admission:
    """Per-router admission state: the ticket book over all models."""

    def __init__(self, ticket_prefix: str,
                 on_lateness: Callable[[str, float], None] = lambda model, s: None) -> None:
        self._prefix = ticket_prefix
        self.on_lateness = on_lateness  # (model, seconds a holder came after its due time)
        self._seq = itertools.count(1)
        self.tickets: dict[str, Reservation] = {}
        self.redemption: dict[str, float] = {}  # per model, exponential average in [0, 1]
        self.stats: Counter[str] = Counter()  # what ticket holders found (status endpoint)

    def decide(self, ms: ModelSlots, ask: Ask, *, may_park: bool = True) -> Place | Park | Refuse:
        for check in CHECKS:
            refusal = check(ms, ask)
            if refusal is not None:
                return refusal
        holder = self._holder(ms, ask)
        finish_s = ask.now_s + ask.prediction.p99_us / 1e6
        free: list[SlotView] = []
        avoided: list[SlotView] = []
        for view in ms.ordered():
            self._expire(ms, view, ask.now_s)
            if view.busy or not view.healthy:
                continue
            if view.reservations:
                first = view.reservations[0]
                mine = holder is not None and first.ticket == holder.ticket
                if not mine and first.due_s < finish_s:
                    continue
            (avoided if view.node == ask.avoid_node else free).append(view)
        if holder is not None and holder.key:
            free.sort(key=lambda v: v.key != holder.key)  # the holder's own slot first
        if free or avoided:
            return Place(free + avoided, holder)
        if holder is not None:
            self.stats["holder-no-free-slot"] += 1
        if may_park and holder is not None and holder.key:
            until_s = ask.park_until_s or self._park_until(holder, ask)
            own = ms.slots.get(holder.key)
            if own is not None and own.healthy and ask.now_s < until_s:
                # The promise stands while its holder waits for the slot.
                holder.expires_s = max(holder.expires_s, until_s + PARK_MARGIN_S)
                return Park(own, until_s, holder)
        return self._refuse(ms, ask, holder)

    @staticmethod
    def _park_until(holder: Reservation, ask: Ask) -> float:
        p = ask.prediction
        window_s = (p.p99_us - p.p50_us) / 1e6 + PARK_MARGIN_S
        window_s += PARK_DRIFT_SHARE * max(0.0, holder.due_s - holder.issued_s)
        window_s = _within(PARK_MIN_S, max(PARK_MIN_S, PARK_MAX_SHARE * p.p50_us / 1e6),
                           window_s)
        return min(ask.now_s + window_s, ask.deadline_s - p.p99_us / 1e6)

    def redeemed(self, ms: ModelSlots, reservation: Reservation) -> None:
        """The holder was placed: release its promise."""
        self.forget(ms, reservation)

    def _holder(self, ms: ModelSlots, ask: Ask) -> Reservation | None:
        if ask.ticket is None:
            return None
        r = self.tickets.get(ask.ticket)
        if r is None:
            self.stats["ticket-unknown"] += 1
            return None
        if ask.park_until_s is None:  # first look at this holder (not a parked re-decide)
            self.on_lateness(ms.model, ask.now_s - r.due_s)
        if r.expires_s < ask.now_s:
            self.stats["ticket-late"] += 1
            self.forget(ms, r)
            self._count(ms.model, redeemed=False)
            return None
        self._count(ms.model, redeemed=True)
        if not r.key:  # a ticket that pinned no slot: the caller goes as a newcomer
            self.stats["ticket-unpinned"] += 1
            self.tickets.pop(r.ticket, None)
            return None
        self.stats["ticket-valid"] += 1
        return r

    def _count(self, model: str, *, redeemed: bool) -> None:
        rate = self.redemption.get(model, 1.0)
        self.redemption[model] = rate + REDEMPTION_WEIGHT * (float(redeemed) - rate)

    def _expire(self, ms: ModelSlots, view: SlotView, now_s: float) -> None:
        while view.reservations and view.reservations[0].expires_s < now_s:
            r = view.reservations.popleft()
            if self.tickets.pop(r.ticket, None) is not None:
                self._count(ms.model, redeemed=False)

    def forget(self, ms: ModelSlots, r: Reservation) -> None:
        self.tickets.pop(r.ticket, None)
        view = ms.slots.get(r.key)
        if view is not None:
            with contextlib.suppress(ValueError):
                view.reservations.remove(r)

    def _refuse(self, ms: ModelSlots, ask: Ask, holder: Reservation | None) -> Refuse:
        if holder is not None:
            self.forget(ms, holder)  # a new promise replaces the old one
        now = ask.now_s
        healthy = [v for v in ms.slots.values() if v.healthy]
        best = min(healthy, key=lambda v: v.available_at(now))
        avail_s = best.available_at(now)
        due_s = max(now, avail_s - RETURN_LEAD_S)
        wait_ms = max(1, math.ceil((due_s - now) * 1000 - 1e-6))  # 1e-6: float noise
        if len(best.reservations) >= PROMISE_MAX_LINKS:
            return Refuse(
                Status.BUSY, Reason.DEADLINE,
                f"every {ms.model} slot already has {PROMISE_MAX_LINKS} callers promised "
                f"(earliest free in {wait_ms} ms): go elsewhere now, or come back later",
                retry_after_ms=wait_ms,
            )
        if due_s + ask.prediction.p99_us / 1e6 > ask.deadline_s:
            return Refuse(
                Status.BUSY, Reason.DEADLINE,
                f"every {ms.model} slot is busy and none frees in time for your deadline "
                f"(earliest in {wait_ms} ms): go elsewhere or raise Plane-Deadline-Ms",
                retry_after_ms=wait_ms,
            )
        due_s = now + wait_ms / 1000  # the whole millisecond the caller will wait
        p50_s = ask.prediction.p50_us / 1e6
        tolerance_s = _within(LATE_TOLERANCE_MIN_S, LATE_TOLERANCE_MAX_S,
                              LATE_TOLERANCE_SHARE * p50_s)
        pin = self.redemption.get(ms.model, 1.0) >= MIN_REDEMPTION
        ticket = f"{self._prefix}-{next(self._seq)}"
        r = Reservation(
            ticket=ticket, key=best.key if pin else "", due_s=due_s,
            end_s=max(due_s, avail_s) + ask.prediction.expected_us / 1e6,
            expires_s=due_s + tolerance_s,
            issued_s=now,
        )
        if pin:
            best.reservations.append(r)
        self.tickets[ticket] = r
        return Refuse(
            Status.BUSY, Reason.BUSY,
            f"all {ms.model} slots are busy: come back in {wait_ms} ms with this ticket",
            retry_after_ms=wait_ms, ticket=ticket,
        )
