"""The router's view of slots: which exist (node adverts), which are healthy, which are busy
and when each is predicted to free. An optimisation on top of the broker, which stays the
ground truth: a publish the broker refuses marks the slot busy here.

Pure bookkeeping, no I/O; times are monotonic seconds passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from plane.contract.budget import ServiceWindow, TokenRates
from plane.contract.messages import NodeAdvert
from plane.contract.subjects import Names
from plane.router.promises import PromiseBook

# The router's cycle samples age out after this long (see `ServiceWindow.max_age_s`): an
# estimate a burst polluted heals within it, with or without placements meanwhile.
CYCLE_MAX_AGE_S = 2.0
# A slot past its predicted (p50) end: the share of its remaining way to the p99 end, or of
# its overrun so far, that it is predicted to run on; past its p99 end, as long again as it
# has overrun (`SlotView.free_time`).
OVERDUE_SHARE = 0.5
# Done-events remembered per slot (`SlotView.was_done`): a peer's note overtaken by more
# than one finished request on the slot is rarer still.
DONE_IDS_KEPT = 4


@dataclass(slots=True)
class SlotView:
    key: str
    node: str
    k: int
    subject: str
    stream: str = ""  # the slot stream that holds `subject` (the node's advert says)
    healthy: bool = True
    busy: bool = False
    free_at_s: float = 0.0  # predicted free time while busy, at the p99 (conservative)
    expected_free_s: float = 0.0  # the same at the p50 (what promises are timed to)
    request_id: str | None = None  # ours, while busy with a request this router placed
    freed_s: float = -1.0  # when its last done-event came
    # Its stream answered a publish with no-responders (no leader): unhealthy until a node
    # advert after this (`ModelSlots.silence`); 0.0 when not silenced.
    silent_until_s: float = 0.0
    # The requests of the last few done-events on it: another router's note that it took the
    # slot for one of them came after the request was over (`was_done`).
    done_ids: tuple[str, ...] = ()
    # When another router last said it took the slot (its note after the broker took its
    # publish): a depth refusal after that and after `freed_s` is that request, not the ack
    # of the last one still on its way into the stream (`RequestPath._settling`).
    peer_took_s: float = -1.0
    placer: str = ""  # the router whose request's done-event came last ("": none, or unknown)
    # The predicted end (`expected_free_s`) a holder was last called ahead of
    # (`plane.router.calls`): one call ahead per piece of work on the slot.
    called_ahead_s: float = -1.0

    def is_free(self, now_s: float) -> bool:
        """Free to place on. A slot the broker said was taken by someone else (no request id
        of ours) counts as free again once its p50 has passed: its done-event frees it sooner
        when it is another router's request, and when it is the ack of the request just done,
        still on its way into the stream (a loaded broker), no done-event will come. Held to
        the p99, such slots sat idle while callers were refused busy (the cluster test saw
        bursts of a hundred). The broker refuses again if it is still taken: one publish.
        (Inlined in `ModelSlots.free_now`, which runs for every slot on every decision:
        change the two together.)"""
        return not self.busy or (self.request_id is None and now_s >= self.expected_free_s)

    def free_time(self, now_s: float) -> float:
        """When the slot is predicted to be free: now when idle, else after its current work
        at the p50. Past that and still running, after half of what is left to its p99 end
        or of how long it has overrun, whichever is longer: `now` there promised the next
        holder a slot that was still busy when it came, again and again (a holder refused
        four times in 35 ms behind cold streams running 3x their prediction). Past its p99
        end too (stalled), after as long again as it has overrun, so that a holder's waits
        double while the stall lasts: half of it let a caller's four attempts run out in ~80
        ms behind two generations stalled for 130 ms on a loaded host, with most of its
        deadline left (tests/test_pulse_streams.py, 2 of 20 runs). Within the p99 the rule is
        unchanged: a later promise there leaves a slot that frees on time idle."""
        if self.is_free(now_s):
            return now_s
        if now_s < self.expected_free_s:
            return self.expected_free_s
        overrun_s = now_s - self.expected_free_s
        if now_s >= self.free_at_s:  # past its p99 too: stalled, waits double
            return now_s + overrun_s
        return now_s + OVERDUE_SHARE * max(self.free_at_s - now_s, overrun_s)

    def occupy(self, now_s: float, request_id: str | None, expected_s: float,
               p99_s: float) -> None:
        """Busy from now: with our request, or (None) with one the broker says is there."""
        self.busy, self.request_id = True, request_id
        self.expected_free_s, self.free_at_s = now_s + expected_s, now_s + p99_s

    def finished(self, now_s: float, request_id: str, placer: str = "") -> None:
        """Its done-event came for `request_id` (any router's request, `placer`'s): free
        from now."""
        self.release(now_s)
        self.done_ids = (request_id, *self.done_ids[:DONE_IDS_KEPT - 1])
        self.placer = placer

    @property
    def called_ahead(self) -> bool:
        """Whether a holder was called ahead of its current work's end (`plane.router.calls`)."""
        return self.called_ahead_s == self.expected_free_s

    def taken_by_peer(self) -> bool:
        """Whether another router took the slot since it last freed."""
        return self.peer_took_s > self.freed_s

    def was_done(self, request_id: str | None) -> bool:
        """Whether `request_id`'s done-event came already. Another router tells that it took
        the slot once its publish is acknowledged; a short request's done-event can reach us
        first, and marked busy then the slot looked taken until its p50 had passed: with two
        routers, 1-3% of a closed loop of one caller per slot was refused
        (`benchmarks/cpu_per_request.py --routers 2`)."""
        return request_id is not None and request_id in self.done_ids

    def release(self, now_s: float, request_id: str | None = None) -> None:
        """Free from now (its done-event came, or our placement on it did not happen). With
        `request_id`, only while that request is the one it holds."""
        if request_id is not None and self.request_id != request_id:
            return
        self.busy, self.request_id, self.freed_s = False, None, now_s


@dataclass(slots=True)
class FreeNow:
    """`ModelSlots.free_now`: the free slots not on the node to avoid, those on it, and how
    many slots are healthy."""

    free: list[SlotView]
    avoided: list[SlotView]
    healthy: int


def _end(v: SlotView) -> float:
    return v.expected_free_s


@dataclass(slots=True)
class ModelSlots:
    model: str
    slots: dict[str, SlotView] = field(default_factory=dict)
    window: ServiceWindow = field(
        default_factory=lambda: ServiceWindow(max_age_s=CYCLE_MAX_AGE_S))
    rr: int = 0  # round-robin start, so load spreads over equal slots
    promises: PromiseBook = field(default_factory=PromiseBook)  # pooled over the slots
    rates: TokenRates = field(default_factory=TokenRates)  # a generating model's, learned
    # When its book last held at most one promise a slot (None: not seen so), and how long it
    # may stand longer before a slot keeps fewer promises (`Admission.depth`).
    drained_s: float | None = None
    standing_s: float = 0.0

    def apply_advert(self, advert: NodeAdvert, names: Names, now_s: float) -> list[str]:
        """Book a node's advert. A slot is placed on at the subject the plane's names give it
        (`names.slot(model, node, k)`), never at one an advert names, and taken from one of
        the plane's slot streams only: a slot whose advert says otherwise is ignored, and
        what it named returned (a router must not publish, or delete, where any client tells
        it to, `$JS.API...` say). A node older than the advert's `stream` is in the shared
        stream."""
        present = set()
        rejected: list[str] = []
        streams = names.slot_streams()
        for s in advert.slots:
            if s.subject != names.slot(advert.model, advert.node, s.k):
                rejected.append(s.subject)
                continue
            stream = s.stream or names.slots_stream
            if stream not in streams:
                rejected.append(stream)
                continue
            key = slot_key(advert.node, s.k)
            present.add(key)
            view = self.slots.get(key)
            if view is None:
                view = SlotView(key=key, node=advert.node, k=s.k, subject=s.subject)
                self.slots[key] = view
            if view.silent_until_s and now_s >= view.silent_until_s:
                view.silent_until_s = 0.0  # its stream may answer again: a request tries it
            view.healthy = s.healthy and not view.silent_until_s
            view.subject = s.subject
            view.stream = stream
        for key in [k for k, v in self.slots.items() if v.node == advert.node]:
            if key not in present:
                del self.slots[key]
        return rejected

    def silence(self, stream: str, until_s: float) -> int:
        """The slots in `stream` are unhealthy until the first advert after `until_s`: a
        publish there found no stream (a cluster electing its leader, 4-9 s); the node,
        which still advertises them, cannot tell. Admission places on, and promises, the
        others meanwhile; the next advert after `until_s` lets a request try it again. How
        many slots it silenced."""
        n = 0
        for v in self.slots.values():
            if v.stream == stream:
                v.healthy, v.silent_until_s = False, until_s
                n += 1
        return n

    def remove_node(self, node: str) -> list[SlotView]:
        gone = [v for v in self.slots.values() if v.node == node]
        for v in gone:
            del self.slots[v.key]
        return gone

    def free_times(self, now_s: float) -> list[float]:
        """Each healthy slot's predicted free time: what promises are scheduled on."""
        return [v.free_time(now_s) for v in self.slots.values() if v.healthy]

    def free_times_when_read(self, now_s: float, healthy: int) -> Sequence[float]:
        """`free_times`, computed when first read; its length (`healthy`, counted already)
        before. The promise schedule reads them only when its tail is stale
        (`PromiseBook.next_start`), and a refusal asks on every decision under overload."""
        return _FreeTimes(self, now_s, healthy)

    def silent_count(self) -> int:
        """Slots passed over because their stream answered no publish (`silence`)."""
        return sum(1 for v in self.slots.values() if v.silent_until_s)

    def healthy_count(self) -> int:
        return sum(1 for v in self.slots.values() if v.healthy)

    def any_healthy(self) -> bool:
        """`healthy_count() > 0`, from the first healthy slot on (every decision asks)."""
        return any(v.healthy for v in self.slots.values())

    def busy_count(self, now_s: float) -> int:
        return sum(1 for v in self.slots.values() if not v.is_free(now_s))

    def working(self) -> Iterator[SlotView]:
        """The healthy busy slots, in no order."""
        return (v for v in self.slots.values() if v.healthy and v.busy)

    def by_end(self) -> list[SlotView]:
        """The healthy busy slots, the one predicted to free first first."""
        return sorted(self.working(), key=_end)

    def next_end_not_called_ahead(self) -> SlotView | None:
        """The healthy busy slot predicted to free first whose work no holder has been called
        ahead of yet: one pass, not a sort (`plane.router.calls` asks on every placement of
        a model with a holder to call ahead)."""
        return min((v for v in self.working() if not v.called_ahead), key=_end, default=None)

    def free_now(self, now_s: float, avoid_node: str | None = None,
                 placer: str = "") -> FreeNow:
        """The healthy slots free now, in round-robin order from after the last start, those
        another router placed on last after the others (`placer`: this router): two routers
        that see the same slots free take different ones, each its own, instead of racing for
        the first (a closed loop of one caller a slot over two routers lost 0.3% of its
        requests to such races). One pass, `is_free` inlined: under overload every decision
        scans every slot and finds none (64 slots: a third of a refusal's time went to this
        scan and its copies)."""
        scan = FreeNow([], [], 0)
        views = list(self.slots.values())
        n = len(views)
        if not n:
            return scan
        self.rr = start = (self.rr + 1) % n
        theirs: list[SlotView] | None = None  # made only when there is one (most scans: none)
        for i in range(start, start + n):
            v = views[i - n] if i >= n else views[i]
            if v.healthy:
                scan.healthy += 1
                if not v.busy or (v.request_id is None and now_s >= v.expected_free_s):
                    if v.node == avoid_node:
                        scan.avoided.append(v)
                    elif v.placer and v.placer != placer:
                        if theirs is None:
                            theirs = []
                        theirs.append(v)
                    else:
                        scan.free.append(v)
        if theirs:
            scan.free += theirs
        return scan


class _FreeTimes(Sequence[float]):
    """`ModelSlots.free_times_when_read`."""

    __slots__ = ("_healthy", "_ms", "_now_s", "_times")

    def __init__(self, ms: ModelSlots, now_s: float, healthy: int) -> None:
        self._ms, self._now_s, self._healthy = ms, now_s, healthy
        self._times: list[float] | None = None

    def _read(self) -> list[float]:
        if self._times is None:
            self._times = self._ms.free_times(self._now_s)
        return self._times

    def __len__(self) -> int:
        return self._healthy

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[float]: ...
    def __getitem__(self, i: int | slice) -> float | Sequence[float]:
        return self._read()[i]

    def __iter__(self) -> Iterator[float]:
        return iter(self._read())


def slot_key(node: str, k: int) -> str:
    return f"{node}/{k}"
