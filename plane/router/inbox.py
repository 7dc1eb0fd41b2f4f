"""The order in which the router reads its requests: first come, first served while it keeps
up; the newest first, and the stale refused unread, while it does not.

A router whose CPU is the plane's limit (a GPU host, BENCHMARKS.md "The plane on the GPU", or
`benchmarks/router_limit.py` here) read its inbox in arrival order and so decided every
request as late as its backlog was long: up to `max_pending` requests, ~1 s at a few hundred
decisions a second. Its promises then held slots for holders who sat that long in the inbox,
every newcomer found the slots promised and was refused, and the goodput fell to nothing
(36 of 5,400 requests answered at 900/s offered to a router that decides ~580/s,
`router_limit.py`, before this module). That is receive livelock, and the known cure is the
one here (adaptive LIFO with a bound on the wait, as Facebook's "Fail at Scale" describes it,
the bound after CoDel):

- A queue that forms and clears (a burst, a pause of the loop) is read in order: the wait of
  the oldest request is judged only once it has been over `TARGET_S` for `INTERVAL_S`.
- While the router is behind in that sense it reads ticket holders and forwarded requests
  first (their promise is for a time), then the newest request: it is decided in the
  present, so its budget, its promise and a holder's return all mean what they say.
- A request that has waited more than `max_wait_s` by then is refused unread, one between
  two decisions (`RequestPath._shed_stale`: 429 `overloaded`, final, its Retry-After as long
  as it waited, or as the router has been behind): it costs a reply, not a decision, and its
  caller learns within about that bound instead of a second later. A holder is never
  refused for its wait, nor a request whose caller said it waits longer for its start
  (`Plane-Wait-Ms`, a burst's): it is decided in that turn, oldest first, while its wait
  lasts.
- A run of reads back to back marks, every `TURN_EVERY_S`, a message before which the loop
  is to turn (`RequestPath.on_request`, `turn`): the socket is read and the done-events heard
  while a backlog is worked through, and what they set off (a parked holder placed, a
  node's delivery started and answered, in `plane up`) is done and written before the
  backlog resumes.

- What is read in the burst after the router's own loop or process stood still past
  `max_wait_s` (`plane.router.stall`: its socket held the requests meanwhile, and they were
  stamped only as they were read) is taken as having come when the loop stopped: the router
  is behind since then, and each such request, a holder's or one whose caller waits longer
  for its start aside, is refused unread as one that waited past the bound. The burst ends
  when the inbox drains, or once reading it has lasted as long as the stall did (at most
  `plane.router.stall.BURST_S`).

The discipline sits in the subscription's own queue (nats-py's `_pending_queue`, an
`asyncio.Queue`: its `put_nowait` wrapped by `plane.router.receipt` to stamp the receipt and
note the holders, and its `_get` replaced on the instance), so the subscription's task and nats-py's
drop past `max_pending` work as before. `tests/test_inbox.py` checks it against a real
server.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from plane.contract.headers import asked_ms
from plane.contract.subjects import Header
from plane.router.receipt import mark_received, received_s, stamp_receipt
from plane.router.stall import LoopStalls

TARGET_S = 0.005  # the oldest request's wait beyond which a queue has formed
INTERVAL_S = 0.020  # formed this long without clearing: the router is behind
# Requests handled back to back for this long: let the loop turn before the next (the
# socket read, done-events handled first: `RequestPath.on_request`). It bounds how long a
# freed slot, a woken holder or (in `plane up`) a slot's delivery waits behind a backlog,
# and each turn adds what runs in it to the wait of the requests behind: under a flood
# (`benchmarks/gateway_flood.py`, 2 slots of 5 ms, 50 hey workers) 200s a second 229 with 1
# ms, 241-242 with 0.5 ms, 251 with 0.25 ms; but at 2x of 4 slots of 2 ms the refusals
# decided within 1 ms of their receipt fell from 99.9% to 98.2-99.3% with 0.5 ms (99.9-100%
# with 1 ms): "refused at once" is the promise. BENCHMARKS.md, thirty-fourth session.
TURN_EVERY_S = 0.001
# A turn is this many rounds of the loop, not one. A task that yields once is back at the head
# of the next round, ahead of what the socket's read set off: on uvloop round 1 polls the
# sockets and queues nats-py's read tasks, round 2 runs them (a done-event frees a slot and
# wakes a parked holder; in `plane up` a slot's delivery wakes its slot), round 3 runs the
# woken (the holder decides and publishes, the slot answers), round 4 writes what they
# published (`plane.contract.soon_flush`); the stdlib loop takes one round more (its reads'
# callbacks run after the turning task's). Resumed after one round, the backlog ran ahead of
# each of those steps for another TURN_EVERY_S: under a flood (`plane up`, 2 slots of 5 ms,
# `hey -c 50` through the gateway) a freed slot's cycle took 4.4 ms beyond its work on
# average, 3.1 ms with these rounds, and the 200s a second went from 210 to 229
# (`benchmarks/gateway_flood.py`; two rounds were no better than one, four as good as
# eight; BENCHMARKS.md, thirty-fourth session).
TURN_ROUNDS = 5
# On a Msg to be refused unread: (how long it waited, how long the router has been behind), s.
_STALE = "_plane_stale"
_TURN = "_plane_turn"  # on a Msg before which the loop is to turn


class Inbox:
    """The discipline of one request subscription's queue (see the module)."""

    def __init__(self, sub: Subscription, *, max_wait_s: float,
                 read_first: Callable[[Msg], bool],
                 clock: Callable[[], float] = time.monotonic,
                 stalls: LoopStalls | None = None) -> None:
        self.max_wait_s = max_wait_s
        # The router loop's stalls (its watchdog's; none seen without one).
        self._stalls = stalls if stalls is not None else LoopStalls(max_wait_s)
        # Whether a message holds a promise (`RequestPath.read_first`): a ticket a router
        # issued, a forward from another router; read first while behind.
        self._read_first = read_first
        self._clock = clock
        queue: asyncio.Queue[Msg] = sub._pending_queue
        self._items: deque[Msg] = queue._queue  # type: ignore[attr-defined]
        # The ticket holders' and forwarded requests among the items, oldest first: while
        # the router is behind they are read first (their promise is for a time).
        self._holders: deque[Msg] = deque()
        self._above_since: float | None = None  # when the oldest's wait went over TARGET_S
        # When the loop last turned for this subscription's task, as far as we know: when it
        # found the queue empty (it waited for the next message) or was told to turn.
        self._turned_s = 0.0
        self._drained = True
        self._drained_s = -math.inf  # when it was last found empty after a read
        self._settled_s = -math.inf  # the stall whose burst is over for this inbox (its seen_s)
        self._shed_turn = True
        self._limit = sub._pending_msgs_limit
        stamp_receipt(sub, clock=clock, then=self._noted, past_limit=self._past_limit)
        queue._get = self._take  # type: ignore[method-assign]

    def _noted(self, msg: Msg, at_s: float) -> None:
        """A message just queued at `at_s`: a ticket holder's or a forwarded one is tracked;
        one read in the wake of the loop's stall is taken as having come when it began."""
        stalls = self._stalls
        if at_s > stalls.late_s or stalls.seen_s > self._settled_s:
            self._after_stall(msg, at_s)
        if msg.headers and self._read_first(msg):
            self._holders.append(msg)

    def _after_stall(self, msg: Msg, at_s: float) -> None:
        """`msg`, read at `at_s` after the loop stood still (`plane.router.stall`), may have
        waited since it stopped: stamped so, the router behind since then, and marked to be
        refused unread unless it is a holder's or its caller waits longer for its start."""
        stalls = self._stalls
        stalls.look(at_s)
        if stalls.burst_over(at_s, self._drained_s):
            self._settled_s = stalls.seen_s
            return
        came = stalls.since_s
        mark_received(msg, came)
        if self._above_since is None or self._above_since > came + TARGET_S:
            self._above_since = came + TARGET_S
        waited = stalls.waited_s(at_s)
        hdrs = msg.headers
        if waited <= self.max_wait_s or (hdrs and (
                self._read_first(msg) or waited <= (asked_ms(hdrs, Header.WAIT_MS) or 0) / 1000)):
            return
        setattr(msg, _STALE, (waited, waited))

    def _past_limit(self, msg: Msg) -> bool:
        """Whether `msg`, come when the queue holds its limit, is queued all the same: a ticket
        holder's or a forward (read first while behind), while the holders tracked stay under
        the limit too (a ticket sent again and again is no more room). Dropped by nats-py,
        it was answered as a newcomer, its promise gone: the overflow's answer has only the
        subject and reply to go by (at 2x of 8 slots of 1 ms here, thousands dropped)."""
        return bool(msg.headers) and len(self._holders) < self._limit and self._read_first(msg)

    def behind_s(self) -> float:
        """How long the router has been behind on this inbox (0: it is not, or nothing waits
        in it now: a router idle after a slow read reported itself behind for as long as no
        request came, `plane status`'s "behind for 1360 ms"). How it reads (`_pick`) keeps
        its state across an empty inbox."""
        since = self._above_since
        if since is None or not self._items or (behind := self._clock() - since) < INTERVAL_S:
            return 0.0
        return behind

    def _take(self) -> Msg:
        items = self._items
        now = self._clock()
        msg = self._pick(items, now)
        if self._drained:
            self._turned_s, self._drained = now, False
        elif now - self._turned_s >= TURN_EVERY_S:
            setattr(msg, _TURN, True)
            self._turned_s = now
        drained = self._drained = not items
        if drained:
            self._drained_s = now
        return msg

    def _pick(self, items: deque[Msg], now: float) -> Msg:
        head = items[0]
        waited = now - received_s(head, now)
        if waited < TARGET_S:
            self._above_since = None
            return self._first(items)
        if self._above_since is None:
            self._above_since = now
        if now - self._above_since < INTERVAL_S:
            return self._first(items)
        holders = self._holders
        if holders:
            return _take_out(items, holders.popleft())
        if waited > self.max_wait_s and self._shed_turn:
            # The stale are refused one between two decisions, not all before the next: a
            # refusal costs the router a reply, and a run of them ages the fresh requests
            # behind it past the bound in turn. One whose caller said it waits longer for
            # its start (`Plane-Wait-Ms`) is decided in that turn instead, while it has.
            self._shed_turn = False
            if not head.headers or waited > (asked_ms(head.headers, Header.WAIT_MS) or 0) / 1000:
                setattr(head, _STALE, (waited, now - self._above_since))
            return items.popleft()
        self._shed_turn = True
        return items.pop()

    def _first(self, items: deque[Msg]) -> Msg:
        msg = items.popleft()
        holders = self._holders
        if holders and holders[0] is msg:
            holders.popleft()
        return msg


def _take_out(items: deque[Msg], msg: Msg) -> Msg:
    """`msg` taken out of `items` by identity (a Msg's == compares its fields)."""
    for i, m in enumerate(items):
        if m is msg:
            del items[i]
            return msg
    raise AssertionError("a holder tracked by the inbox is not in its queue")


def stale(msg: Msg) -> tuple[float, float] | None:
    """When the inbox gave `msg` to be refused unread: how long it waited, and how long the
    router has been behind (s); else None."""
    return getattr(msg, _STALE, None)


def turn_due(msg: Msg) -> bool:
    """Whether the loop is to turn before `msg` is handled."""
    return getattr(msg, _TURN, False)


async def turn() -> None:
    """Let the loop turn TURN_ROUNDS times: what the socket's read sets off runs to its
    write before the caller goes on."""
    for _ in range(TURN_ROUNDS):
        await asyncio.sleep(0)
