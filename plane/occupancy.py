"""The router's view of slots: which exist (node adverts), which are healthy, which are busy
and when each is predicted to free. An optimisation on top of the broker, which stays the
ground truth: a publish the broker refuses marks the slot busy here.

Pure bookkeeping, no I/O; times are monotonic seconds passed in by the caller.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from plane.budget import ServiceWindow
from plane.messages import NodeAdvert


@dataclass(slots=True)
class Reservation:
    """A promise made with a 429: slot `key` is kept for ticket `ticket` from `due_s`."""

    ticket: str
    key: str
    due_s: float
    end_s: float
    expires_s: float
    issued_s: float = 0.0


@dataclass(slots=True)
class SlotView:
    key: str
    node: str
    k: int
    subject: str
    healthy: bool = True
    busy: bool = False
    free_at_s: float = 0.0  # predicted free time while busy, at the p99 (conservative)
    expected_free_s: float = 0.0  # the same at the p50 (what promises are timed to)
    request_id: str | None = None  # ours, while busy with a request this router placed
    reservations: deque[Reservation] = field(default_factory=deque)

    def available_at(self, now_s: float) -> float:
        """When the slot can start a new promise: after its current work and every ticket
        already promised on it."""
        t = self.expected_free_s if self.busy else now_s
        if self.reservations:
            t = max(t, self.reservations[-1].end_s)
        return max(t, now_s)


@dataclass(slots=True)
class ModelSlots:
    model: str
    slots: dict[str, SlotView] = field(default_factory=dict)
    window: ServiceWindow = field(default_factory=ServiceWindow)
    rr: int = 0  # round-robin start, so load spreads over equal slots

    def apply_advert(self, advert: NodeAdvert) -> None:
        present = set()
        for s in advert.slots:
            key = slot_key(advert.node, s.k)
            present.add(key)
            view = self.slots.get(key)
            if view is None:
                view = SlotView(key=key, node=advert.node, k=s.k, subject=s.subject)
                self.slots[key] = view
            view.healthy = s.healthy
            view.subject = s.subject
        for key in [k for k, v in self.slots.items() if v.node == advert.node]:
            if key not in present:
                del self.slots[key]

    def remove_node(self, node: str) -> list[SlotView]:
        gone = [v for v in self.slots.values() if v.node == node]
        for v in gone:
            del self.slots[v.key]
        return gone

    def healthy_count(self) -> int:
        return sum(1 for v in self.slots.values() if v.healthy)

    def busy_count(self) -> int:
        return sum(1 for v in self.slots.values() if v.busy)

    def ordered(self) -> list[SlotView]:
        """Slots in round-robin order starting after the last one used."""
        views = list(self.slots.values())
        if not views:
            return views
        self.rr = (self.rr + 1) % len(views)
        return views[self.rr :] + views[: self.rr]


def slot_key(node: str, k: int) -> str:
    return f"{node}/{k}"
