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
from collections.abc import Callable
from dataclasses import dataclass

from plane.budget import Prediction
from plane.messages import Reason, Status
from plane.occupancy import ModelSlots, Reservation, SlotView

# A reservation is kept this long past its due time for a late holder (then released).
# It covers the reply's trip, the caller's timer and the SDK's jitter (up to 2 ms).
LATE_TOLERANCE_MIN_S = 0.008
LATE_TOLERANCE_MAX_S = 0.025
LATE_TOLERANCE_SHARE = 0.5  # of the predicted p50 service time, within [MIN, MAX]


@dataclass(frozen=True, slots=True)
class Ask:
    """One request, as admission sees it."""

    now_s: float
    deadline_s: float  # monotonic
    prediction: Prediction
    ticket: str | None = None
    avoid_node: str | None = None

    @property
    def remaining_us(self) -> int:
        return int((self.deadline_s - self.now_s) * 1e6)


@dataclass(frozen=True, slots=True)
class Place:
    candidates: list[SlotView]
    redeemed: Reservation | None


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
    if ask.prediction.p99_us > ask.remaining_us:
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

    def __init__(self, ticket_prefix: str) -> None:
        self._prefix = ticket_prefix
        self._seq = itertools.count(1)
        self.tickets: dict[str, Reservation] = {}

    def decide(self, ms: ModelSlots, ask: Ask) -> Place | Refuse:
        for check in CHECKS:
            refusal = check(ms, ask)
            if refusal is not None:
                return refusal
        holder = self._holder(ask)
        p99_s = ask.prediction.p99_us / 1e6
        finish_s = ask.now_s + p99_s
        free: list[SlotView] = []
        avoided: list[SlotView] = []
        for view in ms.ordered():
            self._expire(view, ask.now_s)
            if view.busy or not view.healthy:
                continue
            if view.reservations:
                first = view.reservations[0]
                mine = holder is not None and first.ticket == holder.ticket
                if not mine and first.due_s < finish_s:
                    continue
            (avoided if view.node == ask.avoid_node else free).append(view)
        if holder is not None:
            # The holder's own slot first.
            free.sort(key=lambda v: v.key != holder.key)
        if free or avoided:
            return Place(free + avoided, holder)
        return self._refuse(ms, ask, holder)

    def redeemed(self, ms: ModelSlots, reservation: Reservation) -> None:
        """The holder was placed: release its promise."""
        self.forget(ms, reservation)

    def _holder(self, ask: Ask) -> Reservation | None:
        if ask.ticket is None:
            return None
        r = self.tickets.get(ask.ticket)
        if r is None or r.expires_s < ask.now_s:
            return None
        return r

    def _expire(self, view: SlotView, now_s: float) -> None:
        while view.reservations and view.reservations[0].expires_s < now_s:
            self.tickets.pop(view.reservations.popleft().ticket, None)

    def forget(self, ms: ModelSlots, r: Reservation) -> None:
        self.tickets.pop(r.ticket, None)
        view = ms.slots.get(r.key)
        if view is not None:
            with contextlib.suppress(ValueError):
                view.reservations.remove(r)

    def _refuse(self, ms: ModelSlots, ask: Ask, holder: Reservation | None) -> Refuse:
        if holder is not None:
            self.forget(ms, holder)  # a new promise replaces the old one
        healthy = [v for v in ms.slots.values() if v.healthy]
        best = min(healthy, key=lambda v: v.available_at(ask.now_s))
        due_s = best.available_at(ask.now_s)
        wait_ms = max(1, math.ceil((due_s - ask.now_s) * 1000))
        if due_s + ask.prediction.p99_us / 1e6 > ask.deadline_s:
            return Refuse(
                Status.BUSY, Reason.DEADLINE,
                f"every {ms.model} slot is busy and none frees in time for your deadline "
                f"(earliest in {wait_ms} ms): go elsewhere or raise Plane-Deadline-Ms",
                retry_after_ms=wait_ms,
            )
        # Align the promise to the whole millisecond the caller will wait. Promises are
        # spaced by the predicted p99, so the next holder finds the slot free.
        due_s = ask.now_s + wait_ms / 1000
        p50_s = ask.prediction.p50_us / 1e6
        p99_s = ask.prediction.p99_us / 1e6
        tolerance_s = max(LATE_TOLERANCE_MIN_S, min(LATE_TOLERANCE_MAX_S,
                                                    LATE_TOLERANCE_SHARE * p50_s))
        ticket = f"{self._prefix}-{next(self._seq)}"
        r = Reservation(
            ticket=ticket, key=best.key, due_s=due_s, end_s=due_s + p99_s,
            expires_s=due_s + tolerance_s,
        )
        best.reservations.append(r)
        self.tickets[ticket] = r
        return Refuse(
            Status.BUSY, Reason.BUSY,
            f"all {ms.model} slots are busy: come back in {wait_ms} ms with this ticket",
            retry_after_ms=wait_ms, ticket=ticket,
        )
