"""Admission: an ordered list of small checks, each returning a refusal or passing, then the
slot choice that honours tickets.

Tickets make Retry-After a promise. Each refused caller is promised the earliest time a slot
will be free *and not already promised* (see `plane.router.promises`: promises are pooled over the
model's slots, not pinned to one); successive refused callers get successive free times. A
caller back with its ticket takes any free slot unless an earlier promise needs it, and waits
(is parked) for a moment when none is free yet; a newcomer takes a free slot only when no
promise would start late for it. A holder that gave an inbox is called when its slot frees
before its Retry-After (`slot_for`, `plane.router.calls`); for a stream, and work long
beside a call's trip, it is on call, told a late Retry-After. Pure logic: no I/O, monotonic time in.
"""

from __future__ import annotations

import math
import secrets
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from plane.contract.budget import Prediction, ServiceWindow, fits
from plane.contract.messages import Reason, Status
from plane.contract.subjects import InvalidToken, check_token
from plane.router.caller import MIN_REDEMPTION, REDEMPTION_WEIGHT, Redemptions, again_record
from plane.router.fairness import OverLimit, OverShare
from plane.router.occupancy import ModelSlots, SlotView
from plane.router.promises import Promise, simulate, would_delay
from plane.router.slips import Slips
from plane.router.ticket_tally import TicketTally

# A promise is kept this long past its due time for a late holder (then released). It covers
# the reply's trip, the caller's timer, the SDK's jitter (up to 2 ms) and a caller's process
# that was not scheduled for a few tens of ms (a loaded host): a pooled promise that waits
# for a late holder costs newcomers little, a holder refused for being late costs a retry.
LATE_TOLERANCE_MIN_S = 0.050
LATE_TOLERANCE_MAX_S = 0.200
LATE_TOLERANCE_SHARE = 2.0  # of the predicted p50 service time, within [MIN, MAX]
# When a holder is told to come back. A slot is predicted to free at the mean of its cycle;
# a holder told exactly that finds it still busy nearly half the time and waits (parked, below),
# and that wait is latency its caller sees. So promises are due RETURN_LAG_SHARE of the way
# from the mean to the p90 of the cycle later, less the trip back (RETURN_LEAD_S): fewer and
# shorter waits, for a slot that idles a little when it frees early.
RETURN_LEAD_S = 0.001
RETURN_LAG_SHARE = 0.5
# A holder that finds no slot free yet waits for one (woken by done-events) instead of being
# refused again: a slot starts its request the moment it frees. It waits until its predicted
# start plus the p99 - p50 spread and a margin, within [MIN, the p50 service time] from now
# (longer waits showed as the accepted tail; with promises due past the mean they are rare).
PARK_MIN_S = 0.008
PARK_MARGIN_S = 0.002
PARK_MAX_SHARE = 1.0
# Promises pin slot time only while callers come back for them: below MIN_REDEMPTION of
# redeemed tickets (an exponential average, `plane.router.caller.Redemptions`), refusals
# carry a Retry-After estimate and a ticket but pin no slot, so callers who never retry
# cannot leave slots idle, and the promises still pinned are let go (`_unpin`: their
# holders, if they come, go as newcomers).
# A ticket counts as a no-show when its promise lapses (its due time plus the late
# tolerance), pinned or not, so that the average follows the callers there are now; a holder
# that comes back within LAPSED_KEEP_S after counts as redeemed (a burst of late holders
# dips the average, then restores it). With REDEMPTION_WEIGHT 0.1, seven no-shows in a row
# stop pinning. (Counted only LAPSED_KEEP_S after the lapse, and with the promises already
# pinned kept to their end, one caller resending every 5 ms without its tickets, 2 slots of
# 200 ms, held the book full of its promises: both slots idle and every caller refused
# `overloaded` for 2 s and more; found from outside.)
# The average is kept per caller (`Ask.caller`: the connection a request came from, as far as
# the router can tell), so that callers who never come back stop pinning their own tickets
# and nobody else's: kept per model, a burst of HTTP callers through the gateway (which
# retries nothing) unpinned the tickets of NATS callers who came back at their time with
# them, and 0-14% of those found a slot (found from outside). Callers the router cannot tell
# apart (a reply subject of its own per request) share one average, "" (as per model before).
CALLERS_MAX = 4096  # the callers whose averages are kept (the least recently counted go)
Whose = tuple[str, str]  # (model, caller): whose tickets an average counts
# A newcomer that finds every slot busy but one predicted to free (after every open promise)
# within this share of the p50 service time waits for it (parked, as a holder would) instead
# of being refused. A refusal nobody redeems (callers that never retry) leaves the slot idle
# until the next arrival; one that is redeemed by a holder told a time costs its caller a
# trip and leaves the slot idle for as long as the holder is late (at 0.9x of 2 ms work on
# 2 slots that kept the plane in its chain of promises: 55% of first tries refused, 2.3%
# with the wait). A newcomer that would be on call (a stream, long work) is refused as
# before: called when the slot frees, its holder leaves it idle for a trip only, and a wait
# here would be in its time to first token (streams at 0.9x: parked newcomers' TTFT p50
# 4.2 ms against 1.9 ms for holders). One promise per freeing slot, so at most about one
# waiter per slot.
NEWCOMER_PARK_SHARE = 0.25
# A newcomer that says how long it will wait for its start (`Plane-Wait-Ms`: a caller that
# will not come back, a batch sent at once) waits, parked for its own start in the schedule,
# when that start is within its wait and its deadline, and is refused (with its ticket, as
# any) when it is not or when its slot runs past the wait. Without it a burst larger than the
# slots was refused but for one request a slot (`hey -c 10 -q 28` through the gateway, 2
# slots of 5 ms, ~0.9x of the capacity: 20% of the requests answered 200). The plane does
# not choose this wait for a caller: waiting for callers that never came back whenever the
# newcomers stayed under the capacity plus a burst (tried) held a queue at the start of
# every overload, for as long as the load took to tell from a burst (1.5x of 2 x 100 ms:
# seconds, the accepted p99 several times the p50), and "refused at once" is the promise.
# While callers come back, the newcomer waits only until the slot's predicted end plus its
# spread to the p90 and this slack, then gets its ticket. (With a holder's window, at least
# PARK_MIN_S, newcomers waited out slots that ran long and were refused anyway: 3 x 8 ms at
# 0.9x, whole-wait p99 12-15 -> 26-27 ms; BENCHMARKS.md, eleventh session.)
NEWCOMER_PARK_SLACK_S = 0.001
LAPSED_KEEP_S = 0.5
LAPSED_MAX = 10_000
# At most this many open promises per healthy slot, so router state stays bounded under any
# load. Beyond it the refusal says `overloaded`: go elsewhere at once. (How far ahead a promise
# may be is the caller's deadline's business: its start plus the p99 must fit in it.) Telling
# callers past it their turns while the arrivals looked like a burst was tried (2026-12-01)
# and dropped: near saturation (3 x 8 ms at 0.9x of the closed-loop capacity) first retries
# fell from 97% to 35%, newcomers taking the slots the turns counted on.
PROMISE_MAX_LINKS = 8
# A chain of promises that does not drain is a queue: under overload that lasts, every slot
# keeps its PROMISE_MAX_LINKS promises, and links past the first few only add wait, and error,
# to every holder's turn (the schedule runs a little behind its promises at each link: at 2x
# of 2 ms work on 2 slots, slots freed 2.7 ms after the due time at the p50 and holders
# waited, parked, 6.9 ms at the p99). So once the book has not come down to one promise a
# slot for STANDING_CYCLES p50 service times (at least STANDING_MIN_S), a slot keeps
# STANDING_LINKS: enough to stay fed, the rest told `overloaded` at once. A book that drains
# (bursts below capacity) keeps the full depth, and so does a holder on call: called when a
# slot really frees, it does not pay the schedule's error. (2 x 2 ms at 2x: p99/p50 2.0-2.2
# and whole wait p50 34 ms at 8 links, 1.7 and 15 ms at 3, 2-5% fewer answers a second. A
# single stream slot at 3 links idled between streams: 6% of them refused `overloaded` at
# 0.9x, 9% fewer streams a second at 2x. BENCHMARKS.md, twenty-eighth session.)
STANDING_LINKS = 3
STANDING_CYCLES = 16
STANDING_MIN_S = 0.05
# How late holders come back (`Admission.lateness`): the last LATENESS_WINDOW holders, and
# before any came back, a trip, a timer and the 2 ms of jitter a client may add (the SDK adds
# none to a ticket's Retry-After-Ms).
LATENESS_WINDOW = 128
# A promise whose holder is later than most (the p99 of the lateness, at least GONE_MIN_S)
# and not here stops keeping its slot time from newcomers; it stays open until it expires,
# and a holder that does come then ranks before the newcomers there (it parks if it must).
# Callers that never retry left every 429's promise holding a slot for its whole late
# tolerance (50 ms and more) until enough of them lapsed to count as no-shows (half a second
# later): a few refusals after a hiccup pinned enough slots to refuse the next newcomers,
# whose promises pinned more (the cluster test, 150/s of 3 ms on 6 slots: 40% refused).
GONE_MIN_S = 0.002
# A holder that gave an inbox (`Plane-Wake`) is on call (`plane.router.calls`) when it asks for
# a stream (whatever it waits for a slot after it came is in its time to first token), or
# when the median trip of a call (router to holder and back) is at most CALL_TRIP_SHARE of
# its expected service time (long work): called when its slot frees, unless it is told to
# come within WAKE_LEAD_S anyway, and told as its Retry-After (its fallback) the predicted
# start plus the longest of the work's spread to its p99, its expected time and the wait to
# that start (the further back in line, the more the chain ahead can slip). A holder
# told a predicted time comes while the work ahead still runs about half the time and waits
# for it, parked, in its own latency, and a slot that frees before the time idles until it
# comes; a call is timed to the slot's real state instead: the slot idles for a trip, the
# holder never waits for an overrun. (Told only the spread to the p99, holders still came
# while a stream ahead that had slowed down ran on, 5-12% of them: TTFT p99/p50 2.5-5.7 at
# 2x; with the spread or the expected time 2.0-3.8, and 4 x 20 ms at 2x p99/p50 1.10 against
# 1.30; with the wait too 1.7-1.9; BENCHMARKS.md, fourteenth session.) Before any holder was
# called, a trip is taken to be CALL_TRIP_PRIOR_US. A holder of shorter work is told the
# predicted time (and still called if a slot frees for it WAKE_LEAD_S or more before that
# time): calls a trip before the slot's current work was predicted to end were built for it
# and measured worse in a quiet spell (2 and 4 slots x 2 and 5 ms at 2x: first-retry
# 99.0-99.9% against 99.6-100%, p99/p50 up to 2.2 against 1.5-2.0, fewer answers per second;
# fourteenth session), and calls only for slots that freed early, with holders told the usual
# time, cost more than they gave with 1-10 ms work at Poisson arrivals (thirteenth session).
WAKE_LEAD_S = 0.001
CALL_TRIP_SHARE = 0.1
CALL_TRIP_MAX_AGE_S = 2.0  # trips measured under a load that has passed are forgotten
CALL_TRIP_PRIOR_US = 2000
LATENESS_PRIOR_US = 3000


# A ticket's own part: random, so that nobody can guess another caller's ticket and jump the
# line with it (sequential tickets were: `r1-1`, `r1-2`, ...).
TICKET_HEX = 16


def new_ticket(router_id: str) -> str:
    """`<router id>-<16 random hex digits>`: the maker stays readable (a retry on another
    router is forwarded to it), the rest cannot be guessed."""
    return f"{router_id}-{secrets.token_hex(TICKET_HEX // 2)}"


def ticket_owner(ticket: str) -> str | None:
    """The router that made a ticket's promise, or None for something that is not a ticket."""
    owner, _, tail = ticket.rpartition("-")
    if len(tail) != TICKET_HEX or not all(c in string.hexdigits for c in tail):
        return None
    try:
        return check_token("router id", owner)
    except InvalidToken:
        return None


def _within(lo: float, hi: float, x: float) -> float:
    return max(lo, min(hi, x))


def _late_tolerance_s(p: Prediction) -> float:
    """How long a promise is held for a late holder."""
    return _within(LATE_TOLERANCE_MIN_S, LATE_TOLERANCE_MAX_S,
                   LATE_TOLERANCE_SHARE * p.p50_us / 1e6)


def _window(book: dict[str, ServiceWindow], model: str, prior_us: int,
            max_age_s: float | None = None) -> ServiceWindow:
    """`book`'s window for `model` (LATENESS_WINDOW samples), made on first use."""
    if (w := book.get(model)) is None:
        w = book[model] = ServiceWindow(size=LATENESS_WINDOW, prior_us=prior_us,
                                        max_age_s=max_age_s)
    return w


def _wait_ms(at_s: float, now_s: float) -> int:
    """Whole milliseconds from `now_s` until `at_s`, at least 1 (1e-6: float noise)."""
    return max(1, math.ceil((at_s - now_s) * 1000 - 1e-6))


class Ask(msgspec.Struct, frozen=True):
    """One request, as admission sees it."""

    now_s: float
    deadline_s: float  # monotonic
    prediction: Prediction
    ticket: str | None = None
    avoid_node: str | None = None
    park_until_s: float | None = None  # set while a parked holder is re-deciding
    # Streams: the deadline is for the first token (its p99 from the start, `first_p99_us`),
    # and the whole stream's p99 must fit the stream deadline (`end_deadline_s`, monotonic).
    first_p99_us: int | None = None
    end_deadline_s: float | None = None
    wake: str | None = None  # the caller's inbox for calls back (`Plane-Wake`)
    # When it reached the router (monotonic; None: `now_s`). A holder is on time if it came
    # in time, however long the router then took to get to it (`Admission._spared`).
    came_s: float | None = None
    # How long it may wait here for its start, from when it came (`Plane-Wait-Ms`; 0: none).
    wait_s: float = 0.0
    # Who it came from, as far as the router can tell (`plane.router.caller.caller_of`): whose
    # record of coming back decides whether its ticket pins slot time.
    caller: str = ""
    # A retry (it came with a ticket, or said an attempt past 1): a ticket given to it is
    # judged in its caller's record for retries (`plane.router.caller.again_record`).
    retry: bool = False

    @property
    def record(self) -> str:
        """The record a ticket given to it is judged in (`Promise.caller`)."""
        return again_record(self.caller) if self.retry else self.caller

    @property
    def judged_s(self) -> float:
        """When a holder's promise must still hold: when it came, at its first look; now,
        as a parked holder decides again (its park, not its arrival, is what is kept)."""
        if self.came_s is None or self.park_until_s is not None:
            return self.now_s
        return self.came_s

    @property
    def remaining_us(self) -> int:
        return int((self.deadline_s - self.now_s) * 1e6)

    @property
    def due_p99_us(self) -> int:
        """What must fit before `deadline_s` once started: the whole request, or a stream's
        first token."""
        return self.prediction.p99_us if self.first_p99_us is None else self.first_p99_us

    def latest_start_s(self) -> float:
        """The last moment it may start and still meet its deadline(s) at the p99."""
        latest = self.deadline_s - self.due_p99_us / 1e6
        if self.end_deadline_s is not None:
            latest = min(latest, self.end_deadline_s - self.prediction.p99_us / 1e6)
        return latest

    def later(self, now_s: float, *, as_newcomer: bool = False) -> Ask:
        """The same request, looked at again at `now_s` (without its ticket: as a newcomer)."""
        return msgspec.structs.replace(self, now_s=now_s,
                                       ticket=None if as_newcomer else self.ticket)


class Place(msgspec.Struct, frozen=True):
    candidates: list[SlotView]
    redeemed: Promise | None


class Park(msgspec.Struct, frozen=True):
    """A ticket holder for whom a slot frees within moments: wait for one until `until_s`."""

    until_s: float
    holder: Promise


class Refuse(msgspec.Struct, frozen=True):
    status: Status
    reason: Reason
    message: str
    retry_after_ms: int | None = None
    ticket: str | None = None
    delegate: bool = False  # a promise is needed and another router makes them: ask it
    ahead: bool = False  # its ticket's holder is called ahead of a slot's end (`call_ahead`)


@dataclass(frozen=True, slots=True)
class PromiseChange:
    """A promise this router made (`made`) or that is gone (kept, replaced, lapsed): what it
    tells the other routers (`plane.router.peers`)."""

    model: str
    promise: Promise
    made: bool


# The refusals made outside `Admission.decide`, built here all the same: every refusal the
# router sends is made in this module.
def bad_request(why: str) -> Refuse:
    return Refuse(Status.BAD_REQUEST, Reason.BAD_REQUEST, why)


def too_large(size: int, limit: int) -> Refuse:
    return Refuse(Status.TOO_LARGE, Reason.TOO_LARGE,
                  f"body is {size} bytes; the limit is {limit}")


# A router behind on its inbox tells those it refuses unread to come back after as long as it
# has been behind, at most this long. Capped at 1 s, callers with a long budget (pulse's 30 s)
# came back into the same overload and were refused until their attempts ran out: 1,503 of
# 5,400 requests answered at 900/s in `benchmarks/router_limit.py`, against 5,249 uncapped.
BEHIND_WAIT_CAP_MS = 60_000


def shed(router: str, in_hand: int, wait_ms: int) -> Refuse:
    """A flood: more requests in hand than the router's limit (no ticket: no state kept)."""
    return Refuse(Status.BUSY, Reason.BUSY,
                  f"router {router} has {in_hand} requests in hand (its limit): come back "
                  "shortly", retry_after_ms=wait_ms)


def behind_wait_ms(behind_ms: int) -> int:
    """The Retry-After a router behind on its inbox for `behind_ms` gives a request it refuses
    without a decision: as long again, at most BEHIND_WAIT_CAP_MS. A backlog that formed a
    moment ago is likely to clear as soon, one that has lasted ten seconds to last ten more;
    callers told a short wait in a long overload only come back to be refused again (each
    refusal costs the router a reply), and a caller whose budget ends sooner gives up at once
    (the SDK: `plane.contract.backoff`) and can go elsewhere."""
    return min(behind_ms, BEHIND_WAIT_CAP_MS)


def behind(router: str, waited_ms: int, behind_ms: int, deadline_ms: int) -> Refuse:
    """A request that waited in the router's inbox past its bound while the router was
    behind (`plane.router.inbox`): refused unread, no ticket (no state kept), and final:
    `overloaded` (its own deadline passed while it waited: `deadline`). The router's CPU,
    not the slots, is the limit then, and nothing it could promise brings the caller back
    to a start: told to come back after as long as the router had been behind (a retryable
    `busy`), callers came back as newcomers into the same backlog and were refused again (at
    2x of 4 slots of 1 ms, 45-58% of first retries succeeded; a ticket instead brought every
    one of them back into the backlog, and a slowed router's decisions lagged 9 s,
    BENCHMARKS.md, thirty-sixth session). Go elsewhere now; the Retry-After says when a
    fresh request may find room here (as long as it waited, or as the router has been
    behind, `behind_wait_ms`)."""
    wait_ms = max(1, waited_ms, behind_wait_ms(behind_ms))
    said = f"router {router} is behind (for {behind_ms} ms): this request waited {waited_ms} ms"
    if waited_ms >= deadline_ms:
        return Refuse(Status.BUSY, Reason.DEADLINE,
                      f"{said} unread, past its deadline of {deadline_ms} ms: go elsewhere, "
                      "or to another router", retry_after_ms=wait_ms)
    return Refuse(Status.BUSY, Reason.OVERLOADED,
                  f"{said} unread: it is past what it can decide in time; go elsewhere now "
                  "(another router), or come back after Retry-After-Ms without a ticket",
                  retry_after_ms=wait_ms)


def owner_silent(owner: str) -> Refuse:
    """A forwarded request whose router did not answer in time."""
    return Refuse(Status.DEADLINE, Reason.DEADLINE,
                  f"router {owner} (asked for this request's promise) did not answer in time")


def unplaceable(why: str) -> Refuse:
    """The broker would not take the placement (closed connection, no stream, an error)."""
    return Refuse(Status.UNAVAILABLE, Reason.UNHEALTHY, why, retry_after_ms=1000)


def tenant_share(tenant: str, over: OverShare) -> Refuse:
    """Slots are contended and this tenant holds more than its fair share: others first."""
    return Refuse(Status.BUSY, Reason.TENANT_SHARE,
                  f"tenant {tenant} holds {over.used_share:.0%} of the slot time and its fair "
                  f"share is {over.share:.0%}: come back in {over.retry_after_ms} ms",
                  retry_after_ms=over.retry_after_ms)


def tenant_limit(tenant: str, over: OverLimit) -> Refuse:
    """The tenant's own limit: a rate refusal with a ticket books the caller a token
    (`plane.router.rate_limit`); one that could book none in time is final."""
    said = f"tenant {tenant} is at its {over.what} of {over.limit}"
    if over.reason is Reason.DEADLINE:
        why = (f"{said}/s and its next token (in {over.retry_after_ms} ms) comes too late "
               "for your deadline: go elsewhere, raise Plane-Deadline-Ms or send fewer")
    elif over.reason is Reason.OVERLOADED:
        why = (f"{said}/s and its tokens are booked for the next {over.retry_after_ms} ms: "
               "go elsewhere now, or send fewer (come back later without a ticket)")
    elif over.ticket is not None:
        why = f"{said}/s: come back in {over.retry_after_ms} ms with this ticket"
    else:
        why = f"{said}: come back in {over.retry_after_ms} ms"
    return Refuse(Status.BUSY, over.reason, why, retry_after_ms=over.retry_after_ms,
                  ticket=over.ticket)


Check = Callable[[ModelSlots, Ask], Refuse | None]


def check_capacity(ms: ModelSlots, ask: Ask) -> Refuse | None:
    if not ms.any_healthy():
        if ms.silent_count():
            return Refuse(
                Status.UNAVAILABLE, Reason.UNHEALTHY,
                f"the slot streams of model {ms.model!r} answer no publish (no leader: a "
                "cluster electing one takes 4-9 s; or lost, and being made again): retry in "
                "a second", retry_after_ms=1000)
        return Refuse(
            Status.UNAVAILABLE, Reason.NO_CAPACITY,
            f"no healthy slot serves model {ms.model!r} right now", retry_after_ms=1000,
        )
    return None


def check_budget(ms: ModelSlots, ask: Ask) -> Refuse | None:
    if ask.end_deadline_s is not None and (
            ask.now_s + ask.prediction.p99_us / 1e6 > ask.end_deadline_s):
        left_us = max(0, int((ask.end_deadline_s - ask.now_s) * 1e6))
        return Refuse(
            Status.BUSY, Reason.DEADLINE,
            f"a {ms.model} stream this long takes about {ask.prediction.p99_us} us (p99); "
            f"the stream deadline leaves {left_us} us: raise Plane-Stream-Deadline-Ms, ask "
            f"for fewer max_tokens, or go elsewhere",
            retry_after_ms=0,
        )
    if not fits(ask.due_p99_us, ask.remaining_us):
        what = "first token" if ask.first_p99_us is not None else "request"
        return Refuse(
            Status.BUSY, Reason.DEADLINE,
            f"a {ms.model} {what} takes about {ask.due_p99_us} us (p99); the deadline "
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
        self.tickets: dict[str, Promise] = {}  # pinned promises this router made, open
        # Tickets that pinned no slot time, until they lapse: ticket -> (whose, expires_s).
        self._unpinned: dict[str, tuple[Whose, float]] = {}
        # Tickets redeemed, an exponential average in [0, 1]: per model over all callers,
        # and per (model, caller), which decides the pinning.
        self.redemption: dict[str, float] = {}
        self.by_caller: Redemptions[Whose] = Redemptions(CALLERS_MAX)
        # Per model, the same average over callers' first tickets: where a caller the router
        # has no record of starts (a caller that opens a connection a request never returned
        # to one: starting each at 1 it never stopped pinning).
        self.first_tickets: dict[str, float] = {}
        # Per model, tickets settled, counted (`plane status`; the averages start at 1).
        self.ticket_tally: dict[str, TicketTally] = {}
        self._unpin_due: set[Whose] = set()  # callers whose average fell under MIN_REDEMPTION
        self._lapsed: dict[str, tuple[Whose, float]] = {}  # ticket -> (whose, when it lapsed)
        self.foreign: dict[str, Promise] = {}  # promises other routers made, by ticket
        # Whether another router calls the holders of a promise the given router made: the
        # maker while it is alive; once it is gone, the promiser (`Peers.calls_elsewhere`).
        self.called_elsewhere: Callable[[str, str], bool] = lambda maker, model: True
        # Promises made or gone since the router last looked (it tells the other routers).
        self.notes: list[PromiseChange] = []
        self.stats: Counter[str] = Counter()  # what ticket holders found (status endpoint)
        # How late holders come back after their due time, per model (µs, early ones as 0):
        # a promise is made only if a holder this late still starts in time (`_refuse`).
        self.lateness: dict[str, ServiceWindow] = {}
        self.call_trips: dict[str, ServiceWindow] = {}  # per model: from a call to the holder
        # How late, per model, holders start after the start they were promised, by how far
        # ahead: a promise is made only if a start as late still meets the deadline.
        self.slips: dict[str, Slips] = {}

    def issued(self, ticket: str) -> bool:
        """Whether `ticket` is one the plane gave out that this router has in its books: its
        own promises (open, unpinned or lapsed a moment ago) and the others' it was told of.
        A ticket-shaped string that is none of these is a caller's claim, not a promise
        (forged, or so old it was forgotten): its request is judged as a newcomer's."""
        return (ticket in self.tickets or ticket in self.foreign or ticket in self._unpinned
                or ticket in self._lapsed)

    def take_notes(self) -> list[PromiseChange]:
        notes, self.notes = self.notes, []
        return notes

    def adopt(self, ms: ModelSlots, p: Promise) -> None:
        """Another router made promise `p`, or called its holder (due now, told again):
        book its slot time here too."""
        if (known := self.foreign.get(p.ticket)) is not None:
            if p.due_s < known.due_s:  # called: newcomers here leave the slot to it too
                ms.promises.bring_forward(known, p.due_s)
        elif p.ticket not in self.tickets:
            p.foreign = True
            self.foreign[p.ticket] = p
            ms.promises.add(p)

    def drop(self, ms: ModelSlots, ticket: str) -> None:
        """Another router's promise is gone (kept or replaced)."""
        p = self.foreign.pop(ticket, None)
        if p is not None:
            ms.promises.remove(p)

    def after_lost_race(self, ms: ModelSlots, ask: Ask, now_s: float, *,
                        may_promise: bool = True, tried: Sequence[SlotView] = (),
                        holder: Promise | None = None) -> Place | Refuse:
        """Every candidate slot was taken under us (by another router): decide again as a
        newcomer (a ticket, most often; `delegate` where another router makes the promises,
        as for any newcomer here). Slots that look free and are not among those `tried` for
        this request (in every round so far) are tried next: a slot is tried once.
        `holder`: the promise the lost placement kept, kept by the next try, else a start
        that slipped to now (`_slipped`)."""
        decision = self.decide(ms, ask.later(now_s, as_newcomer=True), may_park=False,
                               may_promise=may_promise)
        if isinstance(decision, Place):
            seen = {id(v) for v in tried}
            if left := [v for v in decision.candidates if id(v) not in seen]:
                return Place(left, holder)
        refusal = decision if isinstance(decision, Refuse) else Refuse(
            Status.BUSY, Reason.BUSY, f"all {ms.model} slots are busy",
            retry_after_ms=max(1, math.ceil(ask.prediction.p50_us / 1000)))
        if holder is not None:
            self._slipped(ms.model, holder, now_s)
        return refusal

    def decide_unparked(self, ms: ModelSlots, ask: Ask) -> Place | Refuse:
        """A decision that cannot park (after a forward failed: the promiser is gone)."""
        match self.decide(ms, ask, may_park=False):
            case Place() | Refuse() as decision:
                return decision
            case Park():
                raise AssertionError("may_park=False never parks")

    def decide(self, ms: ModelSlots, ask: Ask, *, may_park: bool = True,
               may_promise: bool = True) -> Place | Park | Refuse:
        """Place, park or refuse `ask`. With `may_promise` false (another router makes this
        model's promises) a refusal that would carry a ticket says `delegate` instead."""
        for check in CHECKS:
            refusal = check(ms, ask)
            if refusal is not None:
                self._drop_holder(ms, ask)
                return refusal
        self._expire(ms, ask.now_s, spare=self._spared(ask))
        if len(ms.promises) <= len(ms.slots):
            ms.drained_s = ask.now_s  # for `depth`
        holder = self._holder(ms, ask)
        scan = ms.free_now(ask.now_s, ask.avoid_node, self._prefix)
        free, avoided = scan.free, scan.avoided
        gone_s = self._gone_s(ms.model)
        if free or avoided:
            # The promises a newcomer leaves its slot time to, read once for both tests below.
            held = self._held(ms, ask.now_s, gone_s) if holder is None else []
            if holder is None and not may_promise and self._spoken_for(
                    ask, held, len(free) + len(avoided), gone_s):
                # Another router makes the promises, and the slots free here are as many as
                # its holders about to need one, or fewer: it places this newcomer, or refuses
                # it. Placed here, newcomers took the slots that router's holders were about
                # to take (it had placed one there, or a holder was parked: we hear of either
                # a note's trip later), and its holders started late (two routers, 2x of 4 x
                # 5 ms at 40 ms deadlines: starts 15-35 ms past their promise, and every
                # ticket after that refused `deadline` for the slips).
                self.stats["newcomer-delegated"] += 1
                return Refuse(Status.BUSY, Reason.BUSY, f"all {ms.model} slots are promised",
                              retry_after_ms=1, delegate=True)
            if not self._would_break_a_promise(ms, ask, holder, gone_s, held):
                if holder is not None:
                    # Kept: its slot time is this placement now (the router tells the others
                    # where it went).
                    self.forget(ms, holder, tell=False, kept=True)
                return Place(free + avoided, holder)
        if holder is None:
            return self._refuse(ms, ask, None, scan.healthy, may_promise, may_park=may_park)
        self.stats["holder-waits" if free or avoided else "holder-no-free-slot"] += 1
        if may_park:
            until_s = ask.park_until_s or self._park_until(ms, ask, holder)
            if ask.now_s < until_s:
                # The promise stands while its holder waits for a slot.
                holder.parked = True
                holder.expires_s = max(holder.expires_s, until_s + PARK_MARGIN_S)
                return Park(until_s, holder)
        self.stats["holder-refused-after-park" if ask.park_until_s else "holder-refused"] += 1
        self._slipped(ms.model, holder, ask.now_s)  # it starts later than this, if ever
        return self._refuse(ms, ask, holder, scan.healthy, may_promise)

    @staticmethod
    def _would_break_a_promise(ms: ModelSlots, ask: Ask, holder: Promise | None,
                               gone_s: float, held: list[Promise]) -> bool:
        """Whether starting this request now makes a promise that ranks before it late.

        A newcomer ranks after the promises whose holders are here (parked) or not later
        than `gone_s` past their due time or their call (as late as holders come back,
        `_gone_s`): `held`, given (`_held`). A holder ranks after the earlier promises whose
        holders are here, not yet due or called within `gone_s`; one that is late and not here
        does not keep a present holder waiting.
        """
        now = ask.now_s
        if holder is None:
            protected = held
            hold_s = ask.prediction.p99_us / 1e6
        else:
            protected = [p for p in ms.promises if p is not holder
                         and p.due_s <= holder.due_s
                         and (p.parked or p.due_s > now or p.called_s + gone_s > now)]
            hold_s = ask.prediction.expected_us / 1e6
        # No promise open (the common case below capacity): nothing to simulate.
        return bool(protected) and would_delay(ms.free_times(now), protected, now, hold_s)

    @staticmethod
    def _held(ms: ModelSlots, now_s: float, gone_s: float) -> list[Promise]:
        """The promises whose slot time newcomers leave to them: their holders are here
        (parked), or not later than `gone_s` past their due time or their call. (Every
        decision under overload reads it: one comprehension, no call per promise.)"""
        return [p for p in ms.promises if p.parked or p.due_s + gone_s > now_s
                or p.called_s + gone_s > now_s]

    @staticmethod
    def _spoken_for(ask: Ask, held: list[Promise], free: int, gone_s: float) -> bool:
        """Whether the `free` slots are no more than the promises newcomers leave their
        slot time to (`held`, `_held`) that may need one while a newcomer placed now runs
        (to its p99): their holders here or called, or due by then."""
        now, until_s = ask.now_s, ask.now_s + ask.prediction.p99_us / 1e6
        return sum(1 for p in held
                   if p.due_s <= until_s or p.parked or p.called_s + gone_s > now) >= free

    @staticmethod
    def _park_until(ms: ModelSlots, ask: Ask, holder: Promise) -> float:
        """Until the holder's predicted start (after the earlier promises) plus the spread."""
        now, p = ask.now_s, ask.prediction
        ahead = [q for q in ms.promises if q is holder or q.due_s <= holder.due_s]
        starts, _ = simulate(ms.free_times(now), ahead, now)
        start_s = starts.get(holder.ticket, now)
        until_s = start_s + (p.p99_us - p.p50_us) / 1e6 + PARK_MARGIN_S
        longest_s = max(PARK_MIN_S, PARK_MAX_SHARE * p.p50_us / 1e6)
        until_s = _within(now + PARK_MIN_S, now + longest_s, until_s)
        return min(until_s, ask.latest_start_s())

    def slot_for(self, ms: ModelSlots, now_s: float) -> Promise | None:
        """A slot of `ms` just freed and no holder waits here for it: the promise it goes
        to, the first in due order neither here nor given a slot already (None: none waits).
        Its holder is called (`called_s`) when it gave an inbox, is ours (or its maker is
        gone and this router makes the promises now: nobody else would call it), and is not
        told to come within WAKE_LEAD_S anyway (on call or not: one told the predicted time
        is called when a slot frees before it): made due now at the latest, so newcomers
        leave the slot to it for as long as holders take to come back. A holder without an
        inbox is never skipped: its own timer brings it, and the next freed slot goes to the
        next promise."""
        for p in ms.promises:
            if p.parked or p.slotted:
                continue
            p.slotted = True
            if (p.wake is not None
                    and (not p.foreign or not self.called_elsewhere(p.maker, ms.model))
                    and p.back_s - now_s >= WAKE_LEAD_S):
                self._call(ms, p, now_s, "holder-called")
            return p
        return None

    def _call(self, ms: ModelSlots, p: Promise, now_s: float, stat: str) -> None:
        """`p`'s holder is called now: due now at the latest."""
        self.stats[stat] += 1
        p.called_s = now_s
        if p.due_s > now_s:
            ms.promises.bring_forward(p, now_s)
            # The other routers book it due now too (a called holder may come back through
            # any of them).
            self.notes.append(PromiseChange(ms.model, p, made=True))

    def call_ahead(self, ms: ModelSlots, now_s: float, trip_s: float) -> Promise | None:
        """A slot of `ms` is predicted to free one call's trip (`trip_s`) from now: the
        holder that slot will go to, called now so that it comes as the slot frees rather
        than a trip after (`plane.router.calls`); None when that holder is not one to call
        ahead. The holder it goes to is the first in due order neither here, called, nor
        given a slot already, as `slot_for` will count it; called ahead only when it is on
        call for work long beside the trip (`Promise.ahead`: not a stream, whose slot's end
        is a guess), the call is this router's to make, and its own time is not as soon.
        Called, it is not given a slot yet: the next slot that frees is counted as its
        (`slot_for`, without a second call), and one that comes while every slot is still
        busy waits, parked, for the first to free."""
        for p in ms.promises:
            if p.parked or p.slotted or p.called_s:
                continue
            if (not p.ahead or p.wake is None
                    or (p.foreign and self.called_elsewhere(p.maker, ms.model))
                    or p.back_s - now_s < trip_s + WAKE_LEAD_S):
                return None
            self._call(ms, p, now_s, "holder-called-ahead")
            return p
        return None

    def call_trip_s(self, model: str) -> float:
        """The median trip of a call to a holder of `model` (from the call to its return)."""
        return self._call_trip(model).p50_us / 1e6

    def redeemed(self, ms: ModelSlots, promise: Promise, now_s: float) -> None:
        """The holder was placed (the broker took it onto its slot at `now_s`): its promise is
        kept (and out of the book already)."""
        self._slipped(ms.model, promise, now_s)
        self.forget(ms, promise, kept=True)

    def _slipped(self, model: str, promise: Promise, start_s: float) -> None:
        """A holder of a promise this router made started at `start_s`, or had not yet and
        will not on this promise (a lower bound, kept as a sample all the same: the
        holders that miss their deadline are the slips that count)."""
        if promise.promised_s and not promise.foreign:
            if (slips := self.slips.get(model)) is None:
                slips = self.slips[model] = Slips()
            slips.add(promise, start_s)

    def _margin_s(self, model: str, ahead_s: float, service_s: float, now_s: float) -> float:
        """How far past a start promised `ahead_s` from `now_s` its holder may start, as most
        do (the p99): as late as holders come back, or as late as the starts promised about
        as far ahead were (`plane.router.slips`)."""
        slips = self.slips.get(model)
        slip_us = slips.p99_us(ahead_s, service_s, now_s) if slips is not None else 0
        return max(self._lateness(model).p99_us, slip_us) / 1e6

    def _holder(self, ms: ModelSlots, ask: Ask) -> Promise | None:
        if ask.ticket is None:
            return None
        r = self.tickets.get(ask.ticket)
        if r is None and (r := self.foreign.get(ask.ticket)) is not None:
            # Made by a router that did not take this retry (it is gone): kept here.
            self.stats["ticket-foreign"] += 1
            return r
        if r is None:
            if (unpinned := self._unpinned.pop(ask.ticket, None)) is not None:
                # A ticket that held no slot time: the caller goes as a newcomer.
                self.stats["ticket-unpinned"] += 1
                self._count(*unpinned[0], redeemed=True)
                return None
            if (lapsed := self._lapsed.pop(ask.ticket, None)) is not None:
                # Came back after its promise lapsed: late, not a no-show.
                self.stats["ticket-late"] += 1
                self._count(*lapsed[0], redeemed=True, lapsed=True)
                return None
            self.stats["ticket-unknown"] += 1
            return None
        if ask.park_until_s is None:  # first look at this holder (not a parked re-decide)
            late_s = ask.now_s - r.back_s  # after its call, or after the time it was told
            self.on_lateness(ms.model, late_s)
            self._lateness(ms.model).add(int(late_s * 1e6))
            if r.called_s:
                self._call_trip(ms.model).add(int(late_s * 1e6), ask.now_s)
        if r.expires_s < ask.judged_s:
            self.stats["ticket-late"] += 1
            self.forget(ms, r)
            self._count(ms.model, r.caller or ask.caller, redeemed=True)
            return None
        if ask.park_until_s is None:
            # In the record it was given under (another router's promise names none here:
            # the caller that came).
            self._count(ms.model, r.caller or ask.caller, redeemed=True)
        self.stats["ticket-valid"] += 1
        return r

    @staticmethod
    def _links(ms: ModelSlots, slots: int, now_s: float, p50_us: int) -> int:
        """How many promises a slot may hold, for a request whose p50 is `p50_us`
        (`depth`); `slots`: the healthy ones."""
        ms.standing_s = STANDING_CYCLES * p50_us / 1e6
        return Admission.depth(ms, now_s, slots)

    @staticmethod
    def depth(ms: ModelSlots, now_s: float, slots: int | None = None) -> int:
        """How many promises a slot of `ms` may hold now (holders told a time):
        PROMISE_MAX_LINKS, or STANDING_LINKS while the book has not drained (to one promise a
        slot, `decide`) for STANDING_CYCLES service times (of the last request refused), at
        least STANDING_MIN_S. A book never seen drained keeps the full depth."""
        if len(ms.promises) <= (len(ms.slots) if slots is None else slots):
            return PROMISE_MAX_LINKS
        if ms.drained_s is None or now_s - ms.drained_s <= max(STANDING_MIN_S, ms.standing_s):
            return PROMISE_MAX_LINKS
        return STANDING_LINKS

    @staticmethod
    def promise_room(ms: ModelSlots, now_s: float, healthy: int) -> int:
        """How many promises the `healthy` slots of `ms` may hold now, together (`depth` a
        slot, as `_links` counts it): what each tenant's guaranteed share of the promises
        is a share of."""
        return Admission.depth(ms, now_s, healthy) * healthy

    def _gone_s(self, model: str) -> float:
        """How long past its due time a promise whose holder is not here still keeps its slot
        time from newcomers: as late as holders come back (the p99), at least GONE_MIN_S."""
        return max(GONE_MIN_S, self._lateness(model).p99_us / 1e6)

    def _call_trip(self, model: str) -> ServiceWindow:
        """How long a called holder takes to come (the call's trip and the caller's)."""
        return _window(self.call_trips, model, CALL_TRIP_PRIOR_US, CALL_TRIP_MAX_AGE_S)

    def _on_call(self, model: str, ask: Ask) -> bool:
        """Whether a holder is put on call (`plane.router.calls`): it gave an inbox, and asks
        for a stream or a call's trip is short beside the work it waits to start."""
        if ask.wake is None:
            return False
        if ask.first_p99_us is not None:  # a stream: its wait after it came is its TTFT
            return True
        trips = self._call_trip(model)
        trips.expire(ask.now_s)  # back to the prior once nobody was called for a while
        return trips.p50_us <= CALL_TRIP_SHARE * ask.prediction.expected_us

    def _lateness(self, model: str) -> ServiceWindow:
        return _window(self.lateness, model, LATENESS_PRIOR_US)

    def _drop_holder(self, ms: ModelSlots, ask: Ask) -> None:
        """A holder answered by a check (its deadline no longer fits, no healthy slot) is
        gone for good: its promise goes with it. Left in the book, a parked one (a holder
        whose park window ran to its deadline) kept the next holders from free slots until
        it expired, each of them parked to its own deadline and left the same behind: at
        1.5x overload the accepted p99 went from 1.04x to 2x the p50 (100 ms jobs)."""
        if ask.ticket is None:
            return
        p = self.tickets.get(ask.ticket) or self.foreign.get(ask.ticket)
        if p is None or not any(q is p for q in ms.promises):
            return
        if ask.park_until_s is None:  # it did come back (a parked re-decide counted already)
            self._count(ms.model, p.caller or ask.caller, redeemed=True)
        self.stats["holder-refused-by-check"] += 1
        self._slipped(ms.model, p, ask.now_s)
        self.forget(ms, p)

    def _count(self, model: str, caller: str, *, redeemed: bool, lapsed: bool = False
               ) -> None:
        """One of `caller`'s tickets for `model` settled: `redeemed`, or a no-show; `lapsed`:
        redeemed after it was counted a no-show (the averages take both; the tally, the
        ticket once)."""
        tally = self.ticket_tally.setdefault(model, TicketTally())
        if lapsed:
            tally.came_after_all()
        else:
            tally.settled(redeemed=redeemed)
        step = REDEMPTION_WEIGHT * float(redeemed)
        rate = self.redemption.get(model, 1.0)
        self.redemption[model] = rate + step - REDEMPTION_WEIGHT * rate
        whose = (model, caller)
        first = self.first_tickets.get(model, 1.0)
        if self.by_caller.get(whose) is None:  # its first ticket settled
            self.first_tickets[model] = first + step - REDEMPTION_WEIGHT * first
        before, _ = self.by_caller.settle(whose, redeemed=redeemed, prior=first)
        if before >= MIN_REDEMPTION and not self.by_caller.pins(whose):
            self._unpin_due.add(whose)  # its promises pinned meanwhile go at the next look

    def pins(self, model: str, caller: str) -> bool:
        """Whether a ticket for `caller` holds slot time: while it comes back for them."""
        return self.by_caller.pins((model, caller), prior=self.first_tickets.get(model, 1.0))

    def _unpin(self, ms: ModelSlots, caller: str) -> None:
        """`caller` stopped coming back for its tickets: the promises this router pinned for
        it, for holders not here (neither parked nor called), stop holding slot time, and
        count as the tickets made unpinned do (a holder that comes goes as a newcomer,
        redeemed). Kept pinned to their end, a book filled by one caller who never came back
        left the slots idle through its whole chain."""
        for p in [p for p in ms.promises if p.caller == caller and not (
                p.foreign or p.parked or p.called_s) and p.ticket in self.tickets]:
            self.forget(ms, p)
            self._unpinned[p.ticket] = ((ms.model, caller), p.expires_s)
            self.stats["promise-unpinned"] += 1

    def _spared(self, ask: Ask) -> Promise | None:
        """The promise of a holder that came before it expired, at its first look: kept for
        it even if it has expired since. A router behind its inbox decides a request tens of
        ms after it came (on an H200 host at 6,000/s offered, 60-120 ms), longer than a
        promise is held for a late holder (LATE_TOLERANCE_MIN_S), and its holders, on time,
        found their promises lapsed: 6-22% of first retries succeeded (BENCHMARKS.md, "GPU",
        second session)."""
        if ask.ticket is None:
            return None
        p = self.tickets.get(ask.ticket) or self.foreign.get(ask.ticket)
        return p if p is not None and p.expires_s >= ask.judged_s else None

    def _expire(self, ms: ModelSlots, now_s: float, spare: Promise | None = None) -> None:
        for p in ms.promises.expire(now_s, spare=spare):
            if p.foreign:
                self.foreign.pop(p.ticket, None)
            elif self.tickets.pop(p.ticket, None) is not None and not p.newcomer:
                # (A waiting newcomer's promise was no ticket handed out: no no-show.)
                self._lapse(p.ticket, (ms.model, p.caller), now_s)
        # Unpinned tickets lapse at their expiry (oldest first: dicts keep order) ...
        unpinned = self._unpinned
        while unpinned:
            ticket, (whose, expires_s) = next(iter(unpinned.items()))
            if expires_s >= now_s and len(unpinned) <= LAPSED_MAX:
                break
            del unpinned[ticket]
            self._lapse(ticket, whose, now_s)
        # ... and a lapsed ticket is known for LAPSED_KEEP_S more (a late holder's).
        lapsed = self._lapsed
        while lapsed:
            ticket, (_, lapsed_s) = next(iter(lapsed.items()))
            if lapsed_s >= now_s - LAPSED_KEEP_S and len(lapsed) <= LAPSED_MAX:
                break
            del lapsed[ticket]
        if self._unpin_due:
            for whose in [w for w in self._unpin_due if w[0] == ms.model]:
                self._unpin_due.discard(whose)
                if not self.pins(*whose):
                    self._unpin(ms, whose[1])

    def tidy(self, ms: ModelSlots, now_s: float) -> None:
        """Lapse what has lapsed without a decision to see it (the watchdog's tick): the
        book and its gauges, and `plane status`, say what is open now, not at the last
        request."""
        self._expire(ms, now_s)

    def _lapse(self, ticket: str, whose: Whose, now_s: float) -> None:
        """A ticket whose holder did not come in time: a no-show, unless it still comes
        within LAPSED_KEEP_S (then redeemed, late: `_holder`)."""
        self._lapsed[ticket] = (whose, now_s)
        self._count(*whose, redeemed=False)

    def forget(self, ms: ModelSlots, p: Promise, *, tell: bool = True,
               kept: bool = False) -> None:
        """`p` is out of the book: `kept` (its holder placed now: `PromiseBook.remove`), or
        lapsed, replaced or dropped."""
        self.tickets.pop(p.ticket, None)
        self.foreign.pop(p.ticket, None)
        p.parked = False
        if ms.promises.remove(p, kept=kept) and tell:
            self.notes.append(PromiseChange(ms.model, p, made=False))

    def _refuse(self, ms: ModelSlots, ask: Ask, holder: Promise | None, healthy: int,
                may_promise: bool = True, *, may_park: bool = False) -> Refuse | Park:
        """Refuse `ask`, with a ticket for the next start the promises leave. `healthy`: how
        many slots are healthy (`ModelSlots.free_now` counted them). `may_park`: a newcomer
        for whom a slot frees within moments may wait here instead."""
        if holder is not None:
            self.forget(ms, holder)  # a new promise replaces the old one
        now = ask.now_s
        free_s = ms.free_times_when_read(now, healthy)
        start_s = ms.promises.next_start(free_s, now)
        p = ask.prediction
        lag_s = RETURN_LAG_SHARE * (p.likely_us - p.expected_us) / 1e6
        due_s = max(now, start_s + lag_s - RETURN_LEAD_S)
        wait_ms = _wait_ms(due_s, now)
        pinned = self.pins(ms.model, ask.record)
        on_call = pinned and self._on_call(ms.model, ask)
        # A holder on call comes when a slot really frees, whatever the schedule's error. A
        # holder refused again keeps a place (its new promise replaces its old one: the book
        # does not grow), also while a book that stood comes down to the standing depth.
        links = PROMISE_MAX_LINKS if on_call or holder is not None else self._links(
            ms, len(free_s), now, p.p50_us)
        if len(ms.promises) >= links * len(free_s):
            return Refuse(
                Status.BUSY, Reason.OVERLOADED,
                f"overloaded: every {ms.model} slot already has {links} callers promised "
                f"(earliest free in {wait_ms} ms): go elsewhere now, or come back later "
                "without a ticket",
                retry_after_ms=wait_ms,
            )
        if may_park and may_promise and holder is None and ask.wait_s:
            # It waits here for its start (no trip back to be late by: the lateness of
            # holders, below, is not its), for as long as it said, never past it: a caller
            # that does not retry loses a request refused because its slot ran late. (Kept
            # only to its start plus the p99-p50 spread, a burst of six SDK calls on a busy
            # host had four refused 150 ms into a wait of 1 s: the spread learned on a
            # quiet moment was ~0.)
            latest_s = min(self._waits_until(ask), ask.latest_start_s())
            if start_s <= latest_s:
                return self._park_newcomer(ms, ask, start_s, latest_s)
        # A promise its holder cannot keep is worse than none: one due so near the last
        # start its deadline allows that a holder starting as late as most (`_margin_s`)
        # misses it is refused at once, `deadline`, as one past it is. (At 100 ms
        # deadlines, 20 ms jobs, 2x: promises made to the last moment came back late by the
        # caller's trip and jitter and were refused then, 40% of first retries. Counted from
        # the holder's return alone, holders at 25 ms deadlines, 2 x 3 ms, were still
        # refused on their return, 2-4% of them, 3-11% with 8 x 10 ms at 60 ms: the work ahead
        # had run past the schedule's prediction, and the further ahead a start, the more it
        # slips. BENCHMARKS.md, thirty-ninth session.)
        late_s = self._margin_s(ms.model, due_s - now, p.expected_us / 1e6, now)
        if due_s + late_s > ask.latest_start_s():
            return Refuse(
                Status.BUSY, Reason.DEADLINE,
                f"every {ms.model} slot is busy and none frees in time for your deadline "
                f"(earliest in {wait_ms} ms): go elsewhere or raise Plane-Deadline-Ms",
                retry_after_ms=wait_ms,
            )
        if not may_promise:
            return Refuse(Status.BUSY, Reason.BUSY, f"all {ms.model} slots are busy",
                          retry_after_ms=wait_ms, delegate=True)
        if (may_park and holder is None and not on_call and not ask.wait_s
                and start_s - now <= NEWCOMER_PARK_SHARE * p.p50_us / 1e6):
            # While callers come back, only until the slot's end plus its spread to the p90
            # (NEWCOMER_PARK_SLACK_S); else a holder's window (`_park_until`).
            return self._park_newcomer(ms, ask, start_s, min(
                start_s + (p.likely_us - p.expected_us) / 1e6 + NEWCOMER_PARK_SLACK_S,
                ask.latest_start_s()) if pinned else None)
        due_s = now + wait_ms / 1000  # the whole millisecond the caller will wait
        told_ms = wait_ms
        if on_call:
            # Called when a slot frees for it (`plane.router.calls`); told to come when the
            # work ahead has run on well past its prediction (its fallback): the further back
            # in line, the more a chain of predictions can slip, so at least as long again
            # as it waits.
            late_by_s = max((p.p99_us - p.expected_us) / 1e6, p.expected_us / 1e6,
                            start_s - now)
            told_s = min(start_s + late_by_s, ask.latest_start_s() - late_s)
            told_ms = max(wait_ms, _wait_ms(told_s, now))
        told_s = now + told_ms / 1000
        promise = Promise(
            ticket=new_ticket(self._prefix), due_s=due_s, told_s=told_s,
            expires_s=told_s + _late_tolerance_s(ask.prediction),
            service_s=ask.prediction.expected_us / 1e6,
            issued_s=now, pinned=pinned, wake=ask.wake, promised_s=due_s,
            ahead=on_call and ask.first_p99_us is None, caller=ask.record,
        )
        if promise.pinned:
            ms.promises.add(promise)
            self.notes.append(PromiseChange(ms.model, promise, made=True))
            self.tickets[promise.ticket] = promise
        else:
            self._unpinned[promise.ticket] = ((ms.model, ask.record), promise.expires_s)
        return Refuse(
            Status.BUSY, Reason.BUSY,
            f"all {ms.model} slots are busy: come back in {told_ms} ms with this ticket"
            + (" (or when called)" if told_ms > wait_ms else ""),
            retry_after_ms=told_ms, ticket=promise.ticket, ahead=promise.ahead and pinned,
        )

    @staticmethod
    def _waits_until(ask: Ask) -> float:
        """Until when a newcomer that said how long it waits (`Ask.wait_s`) may wait."""
        return (ask.came_s if ask.came_s is not None else ask.now_s) + ask.wait_s

    def _park_newcomer(self, ms: ModelSlots, ask: Ask, start_s: float,
                       until_s: float | None) -> Park:
        """A newcomer, when a slot frees within moments (NEWCOMER_PARK_SHARE), or one whose
        start is within the wait it asked for (`Ask.wait_s`): it waits here for that start
        until `until_s` (None: a holder's window, `_park_until`), holding it with a promise
        of its own (kept like a parked holder's: woken by the done-event, refused with a
        ticket if the window closes first)."""
        promise = Promise(
            ticket=new_ticket(self._prefix), due_s=start_s, expires_s=start_s,
            service_s=ask.prediction.expected_us / 1e6, issued_s=ask.now_s, pinned=True,
            caller=ask.record, newcomer=True,
        )
        promise.parked = True
        ms.promises.add(promise)
        if until_s is None:
            until_s = self._park_until(ms, ask, promise)
        ms.promises.expires_at(promise, until_s + PARK_MARGIN_S)
        self.notes.append(PromiseChange(ms.model, promise, made=True))
        self.tickets[promise.ticket] = promise
        self.stats["newcomer-waits" if ask.wait_s else "newcomer-parked"] += 1
        return Park(until_s, promise)
