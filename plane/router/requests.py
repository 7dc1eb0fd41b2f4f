"""The path of one request through the router: read it, decide (admission), then place it
on a slot, park it, forward it to the router that makes promises, or refuse it.

The common cases (a placement, a refusal) are decided on the subscription's own task and
finish in the PubAck's callback (`plane.router.slot_publish`), with no task, future or timer
per request; only a request that must wait (a parked ticket holder, a forward) gets a task.
Every refusal is built by admission (`plane.router.admission`); each admitted request's
decision is recorded once (`_decided`). The router's service (`plane.router.service`) owns
the subscriptions and the control plane, and hands each request to `RequestPath.on_request`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError

from plane.contract import replies
from plane.contract.budget import predict
from plane.contract.canonical import CanonicalLog
from plane.contract.config import MAX_DEADLINE_MS, RouterConfig
from plane.contract.errors import BadRequest
from plane.contract.header_lines import REPEATED
from plane.contract.headers import (
    RequestInfo,
    across_import,
    asked_ms,
    echoed_request_id,
    is_no_responders,
    read_caller,
)
from plane.contract.identity import RequestIds
from plane.contract.messages import Status
from plane.contract.metrics import Children, PlaneMetrics
from plane.contract.models import MODELS, model_spec
from plane.contract.natsconn import connected_since_s
from plane.contract.ownership import slot_ttl
from plane.contract.publish import publish
from plane.contract.reply_inbox import ReplyInbox
from plane.contract.settings import LiveSettings
from plane.contract.streams import ASKED, kind_of
from plane.contract.streams import Kind as StreamKind
from plane.contract.subjects import Header, InvalidToken, check_token
from plane.contract.tracing import Span, Tracing, epoch_ns_of, trace_headers
from plane.router import admission as refusals
from plane.router.admission import (
    Admission,
    Ask,
    Park,
    Place,
    Refuse,
    ticket_owner,
)
from plane.router.caller import caller_of
from plane.router.fairness import FairShare
from plane.router.inbox import Inbox, stale, turn, turn_due
from plane.router.inflight import InFlight, InFlightBook
from plane.router.metering import Meter
from plane.router.occupancy import ModelSlots, SlotView
from plane.router.owner_watch import OwnerWatch
from plane.router.parking import InLine, ParkingLot
from plane.router.peers import Peers
from plane.router.receipt import received_s
from plane.router.slot_publish import (
    NoStream,
    Outcome,
    Published,
    Refused,
    SlotPublisher,
    TimedOut,
)
from plane.router.tenancy import DEFAULT_TENANT, Tenants

log = structlog.get_logger("plane.router.requests")

# The broker frees a WorkQueue message a moment after the node's ack (it applies acks in the
# consumer's own goroutine, so the done-event, sent after the ack, can overtake it): when it
# still refuses a slot whose done-event came within SETTLE_WITHIN_S, wait and try again, a
# few times with growing waits (on a loaded host the ack can take milliseconds to land).
# Without this, callers = slots in a closed loop saw 28-46% false 429s.
BROKER_SETTLE_S = (0.0003, 0.0007, 0.0015, 0.003)
SETTLE_WITHIN_S = 0.010
# A slot stream that answered no-responders: its slots are unhealthy this long, and until the
# next advert after it (a cluster's leader election takes 4-9 s; one publish per stream per
# period, ~0.25-0.5 s with adverts every 250 ms, finds it back).
SILENT_STREAM_S = 0.25
TENANT_LIMITS = ("max_rate.", "max_slots.")  # the live settings of a tenant's own limits
# A tenant's ticket counts against its share of the promises until its due time and this
# long after (the holder's way back; a promise kept earlier is let go at once).
PROMISE_OPEN_S = 0.05


# A forward that reaches its owner this close to its `Plane-Forward-Until` is dropped: its
# "taken" could reach the forwarder after it gave up and answered the caller (two answers).
# The forwarder waits a second past the deadline and its grace, so nothing that could still
# be served falls in it.
FORWARD_MARGIN_MS = 500
# The owner's word that it took a forwarded request over (`RequestPath._taken_over`).
TAKEN = b"NATS/1.0\r\n" + Header.FORWARDED_BY.encode() + b": taken\r\n\r\n"


def _is_taken(m: Msg) -> bool:
    """Whether a forward's first answer is the owner's "taken", not an answer of its own."""
    return (m.headers or {}).get(Header.FORWARDED_BY) == "taken" and not m.data


def _held_s(hdrs: Mapping[str, str]) -> float:
    """How long the router that forwarded a request held it before (`Plane-Forward-Held-Us`),
    within [0, the longest deadline]; 0 when it did not say (a forwarder of before)."""
    try:
        us = int(hdrs.get(Header.FORWARD_HELD_US, "0"))
    except ValueError:
        return 0.0
    return min(max(us, 0), MAX_DEADLINE_MS * 1000) / 1e6


def _is_depth_refusal(exc: APIError) -> bool:
    """The depth-one refusal. err_code 10077 is shared by other stream limits: match the
    description too."""
    return exc.err_code == 10077 and "maximum messages per subject" in (exc.description or "")


class Routing(msgspec.Struct):
    """One request being decided: what the router read from it and what it asks for."""

    msg: Msg
    rid: str
    model: str
    ms: ModelSlots
    work_us: int
    max_tokens: int  # a generation's; 0 for other models
    ask: Ask
    t0: float  # perf_counter at receipt: the decision metric
    tenant: str  # who sent it (plane.router.tenancy)
    # The server's word on a caller across a tenant's import (`Nats-Request-Info`), read once:
    # None for one inside the plane's own account.
    across: RequestInfo | None
    span: Span | None  # plane.admission, when spans are on (plane.contract.tracing)
    forwarded: bool  # came from another router (never forwarded twice)
    promiser: str  # the router that makes promises now
    may_promise: bool  # this router is it


class Placing(msgspec.Struct):
    """A placement in progress: the candidate slots, the one being tried, its in-flight
    entry, and how often the broker has been asked again for it (`BROKER_SETTLE_S`)."""

    routing: Routing
    place: Place
    headers: dict[str, str]
    i: int = 0
    fl: InFlight | None = None
    settles: int = 0
    passed_silent: bool = False  # a candidate's stream had no leader (`NoStream`)
    # The slots tried in the rounds before this one (each lost to another router's request:
    # `_try_candidate`); none is tried twice.
    tried: tuple[SlotView, ...] = ()


@dataclass(slots=True)
class RouterParts:
    """What the request path shares with the rest of the router (built by the service)."""

    nc: Client
    cfg: RouterConfig
    metrics: PlaneMetrics
    admission: Admission
    models: dict[str, ModelSlots]
    model: Callable[[str], ModelSlots]  # the model's slots, made on first use
    publisher: SlotPublisher
    forwards: ReplyInbox  # the forwards' answers (`_send_forward`)
    inflight: InFlightBook
    peers: Peers
    parking: ParkingLot
    settings: LiveSettings
    spawn: Callable[[Coroutine[Any, Any, None]], object]
    reprovision: Callable[[], Coroutine[Any, Any, None]]
    tracing: Tracing = field(default_factory=Tracing.off)
    # A ticket given whose holder is called ahead of a slot's end (True), or a request placed
    # (False): the calls ahead look again (`plane.router.calls.Calls.ahead`).
    look_ahead: Callable[[ModelSlots, bool], None] = lambda ms, made: None


class RequestPath:
    def __init__(self, parts: RouterParts) -> None:
        self.nc = parts.nc
        self.cfg = parts.cfg
        self.metrics = parts.metrics
        # Children looked up once: these count every request (tickets: every refusal at
        # overload, every retry let in).
        self._decision_s = Children(parts.metrics.router_decision_seconds)
        self._answered = Children(parts.metrics.router_requests)
        self._refusals = Children(parts.metrics.refusals)
        self._tickets_issued = Children(parts.metrics.tickets_issued)
        self._tickets_honoured = Children(parts.metrics.tickets_honoured)
        self.admission = parts.admission
        self._models = parts.models
        self._model = parts.model
        self.publisher = parts.publisher
        self.forwards = parts.forwards
        self._owner_watch = OwnerWatch(parts.forwards, parts.cfg.names)
        self.inflight = parts.inflight
        self.peers = parts.peers
        self.parking = parts.parking
        self.settings = parts.settings
        self._spawn = parts.spawn
        self._reprovision = parts.reprovision
        self.tracing = parts.tracing
        self._look_ahead = parts.look_ahead
        self.max_body_bytes = parts.cfg.max_body_bytes  # at most what the server carries
        # Ids for requests that came without one (a NUID drawn once, and a count).
        self._rids = RequestIds(parts.nc.new_inbox()[len("_INBOX."):])
        self._own_prefix = parts.cfg.names.router_infer_all(parts.cfg.router_id)[:-1]
        self._waiting = 0  # requests in a task of their own (parked, forwarded)
        settings = parts.settings
        self.tenants = Tenants()
        self.fair = FairShare(weight=lambda t: settings.get("share", t) or 1,
                              max_rate=lambda t: settings.get("max_rate", t),
                              max_slots=lambda t: settings.get("max_slots", t),
                              new_ticket=lambda: refusals.new_ticket(parts.cfg.router_id))
        self.meter = Meter(parts.metrics)
        self.canonical = CanonicalLog("plane.router.requests")
        # Whether any tenant has a max_rate or max_slots (else no request asks): kept by the
        # settings' listener, not looked up per request.
        self._limits_set = False
        settings.on_change(self._setting_changed)
        # The request subscriptions' inboxes (the service adds them): how far behind it is.
        self.inboxes: list[Inbox] = []
        # Told of each error the router answers (status, text): the micro endpoint's count.
        # Counts an error answer in the micro endpoint that took the model's requests.
        self.errored: Callable[[str, int, str], None] = lambda model, status, text: None

    def _setting_changed(self, key: str, value: int | None) -> None:
        if key.startswith(TENANT_LIMITS):
            self._limits_set = any(k.startswith(TENANT_LIMITS) for k in self.settings.values)

    def fit_body_limit(self, max_payload: int, headroom: int) -> None:
        """Every message the router sends (a slot publish, a forward) is a caller's body plus
        headers; one over the server's max_payload makes the server close our connection.
        So the body limit is at most what the server carries, less room for the headers."""
        room = max_payload - headroom
        if self.max_body_bytes > room:
            log.warning("body limit lowered to fit the server's max_payload",
                        configured=self.max_body_bytes, limit=room, max_payload=max_payload)
            self.max_body_bytes = max(0, room)

    async def on_request(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("request without reply subject dropped", subject=msg.subject)
            return
        if turn_due(msg):
            # A backlog is handled here without a pause (a publish does not wait), so nothing
            # else runs: the socket is not read (done-events: a slot seen busy long after it
            # freed, so newcomers refused and promised while it idles), the replies pile up
            # in nats-py's write buffer (a burst of 20,000 left RSS 11% up for good). Let the
            # loop turn once the run has lasted TURN_EVERY_S (`plane.router.inbox`). It used
            # to turn every 32 requests: ~10 ms on a GPU host's saturated router (~300 us a
            # decision), 58 ms in `benchmarks/router_limit.py`, whose goodput that cut from
            # 648/s to 83/s.
            await turn()
        if (late := stale(msg)) is not None:
            await self._shed_stale(msg, *late)
            return
        if self.in_hand() >= self.cfg.max_routing:
            # A flood: refuse at once, in the callback, without a task or any state per
            # request, so the loop keeps up with heartbeats and done-events (and memory stays
            # bounded). Come back after about one slot cycle.
            await self._shed(msg)
            return
        if self._forwarded(msg, hdrs := msg.headers or {}) and not await self._taken_over(
                msg, hdrs):
            return
        await self._route_one(msg)

    def _forwarded(self, msg: Msg, hdrs: Mapping[str, str]) -> bool:
        """Whether `msg` is a forward from another router: marked so, on this router's own
        subject, the only one forwards are sent to. The mark on `plane.infer.<model>` is a
        caller's claim (it would pass the tenant's limits, make this router promise in the
        promiser's place and put it first in a router that is behind): ignored there."""
        return Header.FORWARDED_BY in hdrs and msg.subject.startswith(self._own_prefix)

    def read_first(self, msg: Msg) -> bool:
        """Whether the inbox reads `msg` first while the router is behind (and never refuses
        it for its wait): it holds the plane's promise, a forward from another router or a
        ticket a router issued (`Admission.issued`), not merely a header that says so."""
        if not (hdrs := msg.headers):
            return False
        if self._forwarded(msg, hdrs):
            return True
        ticket = hdrs.get(Header.TICKET)
        return ticket is not None and self.admission.issued(ticket)

    async def _taken_over(self, msg: Msg, hdrs: Mapping[str, str]) -> bool:
        """A request another router forwarded to this one (a ticket of ours, or one that needs
        a promise), on our own subject: when it names the caller's reply (`Plane-Reply-To`),
        take it over. Tell the forwarder at once (an empty message, no `Plane-Status`), then
        answer the caller directly, and so does the node it is placed on: its answer, and a
        stream's every message, go to the caller without the forwarder relaying them (a hop
        each), and a stream's caller that goes away is seen by the node. False: dropped, as
        it came when its forwarder gives up on it (and answers the caller itself)."""
        reply_to = hdrs.get(Header.REPLY_TO)
        if reply_to is None:
            return True  # a forwarder of an earlier version relays the answer: answer it
        until = hdrs.get(Header.FORWARD_UNTIL, "")
        if until.isdigit() and replies.now_ms() > int(until) - FORWARD_MARGIN_MS:
            log.warning("forwarded request dropped: it came after its forwarder gave up",
                        forwarded_by=hdrs.get(Header.FORWARDED_BY), request_id=hdrs.get(
                            Header.REQUEST_ID))
            return False
        if not self.nc.is_connected or received_s(msg, math.inf) < connected_since_s(self.nc):
            # Read on a connection now gone, or taken now into the reconnect buffer: our
            # "taken" would come after the server told the forwarder we were gone, and it
            # has decided the request itself (`plane.router.owner_watch`).
            log.warning("forwarded request dropped: our connection to it dropped since",
                        forwarded_by=hdrs.get(Header.FORWARDED_BY), request_id=hdrs.get(
                            Header.REQUEST_ID))
            return False
        await publish(self.nc, msg.reply, b"", TAKEN)
        msg.reply = reply_to
        return True

    def in_hand(self) -> int:
        """Requests decided or placed now: those whose PubAck is awaited, and those waiting
        in a task (parked holders, forwards). Counted, never kept: it cannot drift."""
        return len(self.publisher) + self._waiting

    async def overflowed(self, subject: str, reply: str) -> None:
        """A request nats-py dropped: more were read than this router has room to hold
        (`RouterConfig.max_pending`). Shed like any flood, with what the drop left us (its
        subject and reply: no headers, so a fresh request id and the default tenant)."""
        if reply:
            label, refusal = self._shed_refusal(subject)
            await self._answer(reply, {}, self._new_rid(), label, refusal, DEFAULT_TENANT)

    async def _shed(self, msg: Msg) -> None:
        label, refusal = self._shed_refusal(msg.subject)
        rid = echoed_request_id(msg.headers or {}) or self._new_rid()
        await self._refuse_early(msg, rid, label, refusal)

    def behind_ms(self) -> int:
        """How long the router has been behind on its inbox (`plane.router.inbox`), ms."""
        return round(max((i.behind_s() for i in self.inboxes), default=0.0) * 1000)

    async def _shed_stale(self, msg: Msg, waited_s: float, behind_s: float) -> None:
        """A request the inbox gives to be refused unread: it waited past
        `max_inbox_wait_ms` while the router was behind (`plane.router.inbox`)."""
        model = self.cfg.names.infer_model_of(msg.subject)
        label = model if model in self._models else "unknown"
        self.metrics.behind.labels(label).inc()
        # Its caller's wait for the 429, from the router's receipt: the longest of any
        # refusal's, and the one the refusal decision time must not leave out.
        self._decision_s(label, "refused-behind").observe(waited_s)
        hdrs = msg.headers or {}
        rid = echoed_request_id(hdrs) or self._new_rid()
        waited_ms, behind_ms = round(waited_s * 1000), round(behind_s * 1000)
        # Its deadline as asked (an invalid one: the model's; the refusal is for its wait).
        deadline_ms = self._deadline_ms(model, asked_ms(hdrs, Header.DEADLINE_MS))
        await self._refuse_early(msg, rid, label, refusals.behind(
            self.cfg.router_id, waited_ms, behind_ms, deadline_ms))

    def _shed_refusal(self, subject: str) -> tuple[str, Refuse]:
        """A flood's refusal for a request on `subject`: come back after about one slot
        cycle, or after as long as the router has been behind on its inbox where that is
        longer. The model's metric label (bounded: an unknown model is `unknown`)."""
        model = self.cfg.names.infer_model_of(subject)
        ms = self._models.get(model)
        label = model if ms is not None else "unknown"
        wait_ms = max(1, math.ceil(ms.window.mean_us / 1000)) if ms is not None else 1000
        # Behind on its inbox (a flood that lasts), the router's own backlog is the wait:
        # callers told one cycle come straight back to be refused again.
        wait_ms = max(wait_ms, refusals.behind_wait_ms(self.behind_ms()))
        self.metrics.shed.labels(label).inc()
        return label, refusals.shed(self.cfg.router_id, self.in_hand(), wait_ms)

    async def _route_one(self, msg: Msg) -> None:
        """Decide, on the subscription's own task: the common cases (a placement, a refusal)
        finish here or in the PubAck's callback, with no task per request; only a request
        that must wait (a parked holder, a forward to another router) gets a task. Budgets
        and the decision's time run from the request's receipt (`plane.router.receipt`)."""
        now = time.monotonic()
        received = received_s(msg, now)
        t0 = time.perf_counter() - (now - received)
        hdrs = msg.headers or {}
        model = self.cfg.names.infer_model_of(msg.subject)
        label = model if model in MODELS else "unknown"  # metric labels stay bounded
        try:
            caller = read_caller(hdrs)  # before anything of the caller's is echoed
        except BadRequest as exc:
            # A request id that failed the check is never echoed: the 400 gets a fresh one.
            await self._refuse_early(msg, exc.request_id or self._new_rid(), label,
                                     refusals.bad_request(str(exc)))
            return
        rid = caller.request_id or self._new_rid()
        try:
            check_token("model", model)
            if len(msg.data) > self.max_body_bytes:
                await self._refuse_early(msg, rid, label,
                                         refusals.too_large(len(msg.data), self.max_body_bytes))
                return
            spec = model_spec(model)
            deadline_ms = self._deadline_ms(model, caller.deadline_ms)
            req = spec.decode(msg.data, caller.content_type)
            if (caller.stream or caller.stream_deadline_ms) and not spec.streams:
                raise BadRequest(f"model {model!r} does not stream: send it without "
                                 f"{Header.STREAM} and {Header.STREAM_DEADLINE_MS}")
        except (InvalidToken, BadRequest) as exc:
            await self._refuse_early(msg, rid, label, refusals.bad_request(str(exc)))
            return
        forwarded = self._forwarded(msg, hdrs)  # never forwarded twice
        if forwarded:  # its deadline runs from when the forwarder received it
            received -= _held_s(hdrs)
        owner = ticket_owner(caller.ticket) if caller.ticket else None
        ms = self._model(model)
        first_p99_us = end_deadline_s = None
        if (shape := spec.tokens(req)) is None:
            work_us = spec.work_us(req)
            prediction = predict(ms.window, work_us)
        else:  # a generation: its slot time from its tokens, at the rates learned
            prediction, first_p99, work_us = ms.rates.predict(ms.window, *shape)
            if caller.stream:
                stream_ms = self._stream_deadline_ms(caller.stream_deadline_ms, deadline_ms,
                                                     prediction.p99_us)
                if stream_ms is None:
                    first = (f"{Header.DEADLINE_MS} ({deadline_ms})" if caller.deadline_ms
                             is not None else f"the first token's default budget for {model} "
                             f"({deadline_ms} ms; no {Header.DEADLINE_MS} was sent)")
                    await self._refuse_early(msg, rid, label, refusals.bad_request(
                        f"{Header.STREAM_DEADLINE_MS} ({caller.stream_deadline_ms}) is shorter "
                        f"than {first}, the budget for the first token: give the whole stream "
                        "at least as long"))
                    return
                first_p99_us, end_deadline_s = first_p99, received + stream_ms / 1000
        # One router makes every promise (so no two promise the same slot time); the others
        # place what fits now and hand it what needs a promise.
        promiser = self.cfg.router_id if forwarded else self.peers.promiser(model)
        across = across_import(hdrs)
        r = Routing(
            msg=msg, rid=rid, model=model, ms=ms, work_us=work_us,
            max_tokens=shape[1] if shape is not None else 0,
            t0=t0, tenant=self.tenants.of(hdrs, across), across=across,
            forwarded=forwarded, promiser=promiser,
            span=self.tracing.start("plane.admission", hdrs, epoch_ns_of(int(t0 * 1e9)),
                                    {"model": model, "request_id": rid})
            if self.tracing.on else None,
            may_promise=promiser == self.cfg.router_id,
            ask=Ask(now_s=now, deadline_s=received + deadline_ms / 1000,
                    prediction=prediction, ticket=caller.ticket, avoid_node=caller.avoid_node,
                    first_p99_us=first_p99_us, end_deadline_s=end_deadline_s,
                    # A caller across a service import (the server's Nats-Request-Info):
                    # its inbox is in its own account, out of the router's reach; told the
                    # usual Retry-After, not one that counts on a call.
                    wake=None if across is not None else caller.wake,
                    came_s=received, wait_s=(caller.wait_ms or 0) / 1000,
                    caller=caller_of(msg.reply, across),
                    retry=caller.ticket is not None or (caller.attempt or 1) > 1),
        )
        self.fair.asked(model, r.tenant, r.ask.prediction.expected_us, now)
        if owner is not None and owner != self.cfg.router_id and not forwarded:
            # Its maker judges it (the ticket's promise, the tenant's limits when the ticket
            # is no promise of its own).
            self._spawn(self._decide_slowly(r, None, ticket_owner=owner,
                                            sent=await self._send_forward(r, owner)))
            return
        if refusal := self._tenant_refusal(r, now):
            await self._refuse(msg, rid, model, refusal, r.tenant)
            await self._decided(r, "refused")
            return
        match decision := self.admission.decide(ms, r.ask, may_promise=r.may_promise):
            case Park():  # in line from now: the task that waits runs a moment later
                self._spawn(self._decide_slowly(r, decision, place=self.parking.hold(
                    model, decision.holder.due_s)))
            case Refuse(delegate=True):
                self._spawn(self._decide_slowly(r, decision,
                                                sent=await self._send_forward(r, r.promiser)))
            case Place() | Refuse():
                await self._conclude(r, decision, parked=False)

    def _tenant_refusal(self, r: Routing, now_s: float) -> Refuse | None:
        """The tenant's own limits, then (only while the slots are contended: none free, or
        holders promised) its fair share: a tenant over it is refused first, so that the
        others keep being admitted. A ticket holder was promised its turn: never refused
        here (a ticket the plane issued, `Admission.issued`: any other is a newcomer's
        claim); nor a request another router forwarded without a ticket (it judged it)."""
        if r.ask.ticket is not None:
            if self.admission.issued(r.ask.ticket):
                return None
        elif r.forwarded:
            return None
        if self._limits_set:
            over_limit = self.fair.limit(r.model, r.tenant, now_s, r.ask.prediction.expected_us,
                                         ticket=r.ask.ticket,
                                         latest_start_s=r.ask.latest_start_s(),
                                         caller=r.ask.record)
            if over_limit is not None:
                return refusals.tenant_limit(r.tenant, over_limit)
        if not self.fair.shared(r.model):
            return None  # one tenant: nothing to share (the usual case, and the cheapest test)
        ms = r.ms
        healthy = ms.healthy_count()
        if not ms.promises and ms.busy_count(now_s) < healthy:
            return None  # not contended: a free slot, nobody promised
        # The promises the slots may hold now (fewer while the chain stands): each tenant
        # asking is guaranteed its weight's share of those, not of more than exist.
        over = self.fair.over_share(r.model, r.tenant, now_s, healthy * 1e6,
                                    self.admission.promise_room(ms, now_s, healthy))
        return refusals.tenant_share(r.tenant, over) if over is not None else None

    def ended(self, fl: InFlight, status: int, service_us: int, sms: int) -> None:
        """A placed request is over (its done-event, or the watchdog answered for it)."""
        self.fair.ended(fl.model, fl.tenant)
        if status:  # NOT_ANSWERED: the router's own answer is metered where it is given
            self.meter.answered(fl.tenant, fl.model, status)
        if service_us:
            self.meter.used(fl.tenant, fl.model, service_us, sms)

    async def _decide_slowly(self, r: Routing, decision: Place | Park | Refuse | None, *,
                             ticket_owner: str | None = None,
                             place: InLine | None = None,
                             sent: asyncio.Future[Msg] | None = None) -> None:
        """What must wait: a ticket holder's retry that belongs to another router (forwarded
        to it), a holder parked until a slot frees (its `place` in the line held already),
        a refusal that needs the promiser. `sent`: the answer to the forward to the ticket's
        owner, or to the promiser, sent already (`_send_forward`)."""
        self._waiting += 1
        try:
            await self._decide_waiting(r, decision, ticket_owner, place, sent)
        finally:
            self._waiting -= 1
            if place is not None:
                self.parking.release(place)

    async def _decide_waiting(self, r: Routing, decision: Place | Park | Refuse | None,
                              ticket_owner: str | None, place: InLine | None = None,
                              sent: asyncio.Future[Msg] | None = None) -> None:
        if ticket_owner is not None:
            if await self._forward(r, ticket_owner, "ticket", sent):
                await self._decided(r, "forwarded")
                return
            sent = None
            # Its maker is gone (or never was: a forged ticket): judged here.
            if refusal := self._tenant_refusal(r, time.monotonic()):
                await self._refuse(r.msg, r.rid, r.model, refusal, r.tenant)
                await self._decided(r, "refused")
                return
            decision = self.admission.decide(r.ms, r.ask, may_promise=r.may_promise)
        assert decision is not None
        decided, parked = await self._admit(r.ms, r.ask, decision, may_promise=r.may_promise,
                                            place=place)
        if isinstance(decided, Refuse) and decided.delegate:
            if await self._forward(r, r.promiser, "promise", None if parked else sent):
                await self._decided(r, "forwarded")
                return
            # The promiser is gone: this router promises, as for a newcomer.
            r.ask = r.ask.later(time.monotonic(), as_newcomer=True)
            decided = self.admission.decide_unparked(r.ms, r.ask)
        await self._conclude(r, decided, parked=parked)

    async def _conclude(self, r: Routing, decision: Place | Refuse, *, parked: bool) -> None:
        match decision:
            case Refuse():
                if decision.ticket is not None and decision.retry_after_ms is not None:
                    self.fair.promised(r.model, r.tenant, decision.ticket,
                                       time.monotonic() + decision.retry_after_ms / 1000
                                       + PROMISE_OPEN_S)
                await self._refuse(r.msg, r.rid, r.model, decision, r.tenant)
                if decision.ahead:
                    self._look_ahead(r.ms, True)
                await self._decided(r, "refused-after-park" if parked else "refused")
            case Place():
                await self._try_candidate(Placing(routing=r, place=decision,
                                                  headers=self._slot_headers(r)))

    async def _decided(self, r: Routing, outcome: str, slot: SlotView | None = None) -> None:
        """The one record of a request's decision (its metric and its canonical line); then
        tell the other routers what changed (nothing, and nothing sent, when alone)."""
        took_s = time.perf_counter() - r.t0
        self._decision_s(r.model, outcome).observe(took_s)
        if r.span is not None:
            r.span.end(time.time_ns(), outcome=outcome, tenant=r.tenant)
        if self.canonical.due():
            self.canonical.write("request decided", request_id=r.rid, model=r.model,
                                 tenant=r.tenant, outcome=outcome,
                                 decision_us=int(took_s * 1e6),
                                 slot=slot.key if slot is not None else None,
                                 attempt=(r.msg.headers or {}).get(Header.ATTEMPT, "1"))
        await self.peers.tell()

    async def _refuse_early(self, msg: Msg, rid: str, model: str, r: Refuse) -> None:
        """A refusal before admission (a flood, a bad request): answered, and its line."""
        await self._refuse(msg, rid, model, r)
        self.canonical.line("request refused", error=r.status is not Status.BUSY,
                            request_id=rid, model=model, status=int(r.status),
                            reason=r.reason.value)

    def _forward_headers(self, r: Routing) -> dict[str, str]:
        """The caller's headers, and what the owner of a forward needs (docs/design.md)."""
        now = time.monotonic()
        headers = dict(r.msg.headers or {})
        headers.pop(REPEATED, None)  # our reader's note, no header (nats-py refuses its name)
        headers[Header.FORWARDED_BY] = self.cfg.router_id
        headers[Header.REPLY_TO] = r.msg.reply
        headers[Header.FORWARD_UNTIL] = str(replies.now_ms() + int(self._forward_wait_s(r) * 1000))
        # The owner counts the deadline from when we received it, not from when it does.
        came = r.ask.came_s if r.ask.came_s is not None else r.ask.now_s
        headers[Header.FORWARD_HELD_US] = str(max(0, int((now - came) * 1e6)))
        return headers

    def _forward_wait_s(self, r: Routing) -> float:
        """How long a forwarder waits for the owner's word: longer than the owner's own
        deadline handling (deadline + grace + its takeover), so that its word, whatever it
        is, comes back before we give up on it."""
        return (r.ask.end_deadline_s or r.ask.deadline_s) - time.monotonic() + (
            self.cfg.deadline_grace_ms / 1000 + 1.0)

    async def _send_forward(self, r: Routing, owner: str) -> asyncio.Future[Msg] | None:
        """Send a request's forward to router `owner` now, in the turn that decided it, not
        from the task that waits for its answer (`plane.contract.reply_inbox`); the future of
        that answer. None for a stream: relayed message by message from the task that waits
        (`_relay_stream`)."""
        if r.ask.end_deadline_s is not None:
            return None
        return await self.forwards.send(self.cfg.names.router_infer(owner, r.model),
                                        r.msg.data, self._forward_headers(r))

    async def _forward(self, r: Routing, owner: str, why: str,
                       sent: asyncio.Future[Msg] | None = None) -> bool:
        """Hand a request to router `owner`: a ticket holder's to the router that made its
        promise (the routers share one queue group, so a retry lands on any of them), or one
        that needs a promise to the router that makes them. The owner takes it over (says
        "taken" and answers the caller itself: `_taken_over`); an owner of an earlier version
        answers us, and we relay. False when that router is gone: decided here. `sent`: the
        forward's answer, when `_send_forward` sent it already."""
        msg, model = r.msg, r.model
        if sent is None and (sent := await self._send_forward(r, owner)) is None:  # a stream
            return await self._relay_stream(r, owner, why, self._forward_headers(r),
                                            self._forward_wait_s(r))
        try:
            answer = await self._owner_watch.word(sent, owner, max(0.001, self._forward_wait_s(r)))
            if answer is not None:
                answer = ReplyInbox.checked(answer)
        except NoRespondersError:
            answer = None
        except NatsTimeoutError:
            self.metrics.forwarded.labels(model, why, "no-answer").inc()
            await self._refuse(msg, r.rid, model, refusals.owner_silent(owner), r.tenant)
            return True
        if answer is None:  # the owner is gone (`plane.router.owner_watch`): decided here
            self.metrics.forwarded.labels(model, why, "owner-gone").inc()
            self.peers.gone(owner)
            return False
        if _is_taken(answer):
            self.metrics.forwarded.labels(model, why, "taken").inc()
            return True
        self.metrics.forwarded.labels(model, why, "relayed").inc()  # an owner of before
        if msg.reply:
            await self.nc.publish(msg.reply, answer.data, headers=dict(answer.headers or {}))
        return True

    async def _relay_stream(self, r: Routing, owner: str, why: str, headers: dict[str, str],
                            wait_s: float) -> bool:
        """`_forward` for a stream. The owner's "taken" ends our part. An owner of an earlier
        version sends its placement's every message to an inbox of ours, and each goes on to
        the caller, up to and including the final one; its node then sees our inbox as the
        reader, so a caller that stops reading is not noticed through the relay (its cancel
        still reaches the node directly) and the stream ends at its deadline at the latest.
        No responders (the server's status on our inbox, before anything else) means the
        owner is gone, and so does one that leaves before its first word
        (`plane.router.owner_watch`)."""
        msg, model = r.msg, r.model
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        give_up = time.monotonic() + wait_s
        try:
            await self.nc.publish(self.cfg.names.router_infer(owner, model), msg.data,
                                  reply=inbox, headers=headers)
            first = True
            while True:
                try:
                    m: Msg | None
                    if first:  # the owner's first word, unless it leaves before it
                        m = await self._owner_watch.word(asyncio.ensure_future(
                            sub.next_msg(timeout=wait_s)), owner, wait_s)
                    else:
                        m = await sub.next_msg(timeout=max(0.001, give_up - time.monotonic()))
                except (NatsTimeoutError, TimeoutError):
                    self.metrics.forwarded.labels(model, why, "no-answer").inc()
                    await self._refuse(msg, r.rid, model, refusals.owner_silent(owner),
                                       r.tenant)
                    return True
                if m is None or (first and is_no_responders(m.headers)):
                    self.metrics.forwarded.labels(model, why, "owner-gone").inc()
                    self.peers.gone(owner)
                    return False
                h = m.headers or {}
                if first and _is_taken(m):
                    self.metrics.forwarded.labels(model, why, "taken").inc()
                    return True
                if first:  # an owner of before: every message comes through us
                    self.metrics.forwarded.labels(model, why, "relayed").inc()
                first = False
                if msg.reply:
                    await self.nc.publish(msg.reply, m.data, headers=dict(h))
                if kind_of(h) in (StreamKind.END, StreamKind.FINAL):
                    return True
        finally:
            await sub.unsubscribe()

    async def _admit(self, ms: ModelSlots, ask: Ask, decision: Place | Park | Refuse, *,
                     may_promise: bool, place: InLine | None = None
                     ) -> tuple[Place | Refuse, bool]:
        """Wait out a parked holder's decision; the final one, and whether it was parked.
        `place`: its place in the line, held when it was first parked."""
        parked = isinstance(decision, Park)
        if parked:
            self.metrics.parked.labels(ms.model).inc()
        while isinstance(decision, Park):
            # Wait for a slot to free for this holder (the lot wakes holders in due order),
            # then look again, until the park window closes.
            loop_until = asyncio.get_running_loop().time() + (
                decision.until_s - time.monotonic())
            await self.parking.wait(ms.model, decision.holder.due_s, loop_until, place)
            place = None  # (a park after this one takes its place as it waits)
            now = time.monotonic()
            ask = msgspec.structs.replace(ask.later(now), park_until_s=decision.until_s,
                                          ticket=decision.holder.ticket)  # a parked newcomer's too
            decision = self.admission.decide(ms, ask, may_park=now < decision.until_s,
                                             may_promise=may_promise)
        return decision, parked

    def _deadline_ms(self, model: str, asked_ms: int | None) -> int:
        """The caller's deadline (already checked, `plane.contract.headers`), else the model's live
        setting, else its configured default."""
        if asked_ms is not None:
            return asked_ms
        return self.settings.deadline_or_default(model, self.cfg.default_deadline_ms)

    @staticmethod
    def _stream_deadline_ms(asked_ms: int | None, deadline_ms: int, p99_us: int) -> int | None:
        """A stream's whole budget: the caller's (None when shorter than its first-token
        budget), else the first token's plus twice the stream's predicted p99."""
        if asked_ms is not None:
            return asked_ms if asked_ms >= deadline_ms else None
        return min(MAX_DEADLINE_MS, deadline_ms + 2 * math.ceil(p99_us / 1000))

    def _new_rid(self) -> str:
        return self._rids.next()

    def _slot_headers(self, r: Routing) -> dict[str, str]:
        hdrs = r.msg.headers or {}
        now_s, now_ms = time.monotonic(), replies.now_ms()
        deadline_ms = max(1, int((r.ask.deadline_s - now_s) * 1000))
        # The message's own end: a request's deadline, or a stream's.
        end_ms = deadline_ms if r.ask.end_deadline_s is None else max(
            deadline_ms, int((r.ask.end_deadline_s - now_s) * 1000))
        out = {
            Header.REPLY_TO: r.msg.reply,
            Header.REQUEST_ID: r.rid,
            Header.DEADLINE_AT: str(now_ms + deadline_ms),
            Header.DEADLINE_MS: str(deadline_ms),
            Header.WORK_US: str(r.work_us),
            Header.ROUTER: self.cfg.router_id,
            # The caller's attempt, made this placement's own (a caller may give two requests
            # one id): how router and node name it when the broker cannot say who answers
            # (`plane.contract.ownership.attempt_id`; a node reads it as an opaque string).
            Header.ATTEMPT: f"{hdrs.get(Header.ATTEMPT, '1')}~{self._new_rid()}",
            # A backstop that frees an orphaned slot; it outlives any takeover (ownership).
            Header.NATS_TTL: slot_ttl(end_ms),
        }
        if r.ask.end_deadline_s is not None:  # a stream
            out[Header.STREAM] = ASKED
            out[Header.STREAM_DEADLINE_AT] = str(now_ms + end_ms)
            if (info := r.across) is not None:
                if info.acc:
                    out[Header.CALLER_ACCOUNT] = info.acc
                if info.client:
                    out[Header.CALLER_CLIENT] = info.client
        if ct := hdrs.get(Header.CONTENT_TYPE):
            out[Header.CONTENT_TYPE] = ct
        # The trace goes on: under our admission span when spans are on, else as it came.
        out.update(r.span.context_headers() if r.span is not None else trace_headers(hdrs))
        return out

    async def _try_candidate(self, p: Placing) -> None:
        """Publish onto the next candidate slot; the broker's answer comes to `_placed`."""
        r = p.routing
        if p.passed_silent:  # candidates chosen before their stream fell silent: pass them
            now = time.monotonic()
            while (p.i < len(p.place.candidates)
                   and p.place.candidates[p.i].silent_until_s > now):
                p.i += 1
        if p.i >= len(p.place.candidates):
            # Every candidate was taken under us (another router), or its stream fell silent:
            # decide again as for a newcomer. Slots that look free and were not tried are
            # tried at once, each once (told to come back in a p50 without a ticket, the
            # caller found them gone; tried in a second round only, two routers of one caller
            # a slot each took the other's and refused 0.3% of the requests); else a ticket
            # on the busy ones, most often, the promiser's where another router makes them
            # (this one gave its own here, for slot time the promiser gave too); a 503 when
            # every slot's stream is silent (`admission.check_capacity`).
            tried = (*p.tried, *p.place.candidates)
            match self.admission.after_lost_race(
                    r.ms, r.ask, time.monotonic(), may_promise=r.may_promise,
                    tried=tried, holder=p.place.redeemed):
                case Place() as place:
                    await self._try_candidate(Placing(routing=r, place=place,
                                                      headers=self._slot_headers(r),
                                                      tried=tried))
                case Refuse(delegate=True) as refusal:
                    self._spawn(self._decide_slowly(
                        r, refusal, sent=await self._send_forward(r, r.promiser)))
                case Refuse() as refusal:
                    await self._conclude(r, refusal, parked=False)
            return
        view = p.place.candidates[p.i]
        # Track before publishing: the node's done-event can arrive before our PubAck.
        p.fl = self._track(view, r, p.headers[Header.ATTEMPT])
        await self._send(p)

    async def _send(self, p: Placing) -> None:
        view = p.place.candidates[p.i]
        try:
            await self.publisher.publish(view.subject, p.routing.msg.data, p.headers,
                                         time.monotonic(), partial(self._placed, p))
        except Exception as exc:  # the connection is closed or closing
            await self._unplaced(p, f"the router could not publish: {exc!r}")

    async def _placed(self, p: Placing, outcome: Outcome) -> None:
        """The broker's answer to a slot publish."""
        r, view, fl = p.routing, p.place.candidates[p.i], p.fl
        assert fl is not None
        match outcome:
            case Published(seq=seq):
                self.inflight.placed(fl, seq)
                self.fair.placed(r.model, r.tenant, r.ask.prediction.expected_us,
                                 time.monotonic())
                if r.ask.ticket is not None:
                    self.fair.kept(r.model, r.tenant, r.ask.ticket)
                if p.place.redeemed is not None:
                    self.admission.redeemed(r.ms, p.place.redeemed, time.monotonic())
                    if not p.place.redeemed.newcomer:  # a ticket's, not a waiting newcomer's
                        self._tickets_honoured(r.model).inc()
                await self.peers.tell_taken(r.model, view, p.place, r.ask, r.rid)
                self._look_ahead(r.ms, False)
                await self._decided(r, "placed", view)
            case TimedOut():
                self.fair.placed(r.model, r.tenant, r.ask.prediction.expected_us,
                                 time.monotonic())
                # Unknown outcome: the message may be on the slot. Answering now could make a
                # second answer; the in-flight book owns it (done-event, or a take at the
                # deadline).
                self.inflight.placed(fl, None)
                await self._decided(r, "unknown")
            case Refused(error=exc) if _is_depth_refusal(exc):
                if self._settling(p, view):
                    # The node's ack is still on its way into the stream (it is sent before
                    # the done-event, but the stream applies it a moment later): again soon.
                    wait_s = BROKER_SETTLE_S[p.settles]
                    p.settles += 1
                    asyncio.get_running_loop().call_later(
                        wait_s, lambda: self._spawn(self._send_again(p)))
                    return
                await self._lost(p)
            case Refused(error=exc):
                await self._unplaced(p, f"the broker refused: {exc}")
            case NoStream():
                self._spawn(self._reprovision())
                # No stream listens on the subject: the slot's stream has no leader (a cluster
                # electing one, 4-9 s) or is gone. Slots in another stream may be free.
                self._silence(view.stream)
                self._untrack(view, fl)
                p.i, p.settles, p.passed_silent = p.i + 1, 0, True
                await self._try_candidate(p)

    def _silence(self, stream: str) -> None:
        until_s = time.monotonic() + SILENT_STREAM_S
        n = sum(ms.silence(stream, until_s) for ms in self._models.values())
        self.metrics.stream_silences.labels(stream).inc()
        log.warning("slot stream silent: its slots pass", stream=stream, slots=n,
                    for_s=SILENT_STREAM_S)

    async def _send_again(self, p: Placing) -> None:
        """`_send` after a depth refusal that looked like the last ack settling, unless
        another router has said meanwhile that it took the slot."""
        if p.place.candidates[p.i].taken_by_peer():
            await self._lost(p)
        else:
            await self._send(p)

    async def _lost(self, p: Placing) -> None:
        """Someone else's request is on the candidate (another router's): busy until its
        done-event, or its p99 at most; the next candidate is tried."""
        r, view = p.routing, p.place.candidates[p.i]
        assert p.fl is not None
        self._untrack(view, p.fl)
        self.metrics.broker_refusals.labels(r.model).inc()
        view.occupy(time.monotonic(), None, r.ask.prediction.expected_us / 1e6,
                    r.ask.prediction.p99_us / 1e6)
        p.i, p.settles = p.i + 1, 0
        await self._try_candidate(p)

    @staticmethod
    def _settling(p: Placing, view: SlotView) -> bool:
        """A depth refusal just after the slot's done-event, while no other router has said
        it took the slot: try again a few times. (A refusal that is another router's request
        was tried again for all of BROKER_SETTLE_S, 5.5 ms, and most often lost then; or won
        when that request was over: the loser waited out the winner's work.)"""
        if view.taken_by_peer():
            return False
        if p.settles == 0:
            return time.monotonic() - view.freed_s < SETTLE_WITHIN_S
        return p.settles < len(BROKER_SETTLE_S)

    async def _unplaced(self, p: Placing, why: str) -> None:
        r, view = p.routing, p.place.candidates[p.i]
        if p.fl is not None:
            self._untrack(view, p.fl)
        await self._refuse(r.msg, r.rid, r.model, refusals.unplaceable(why), r.tenant)
        await self._decided(r, "refused")

    def _untrack(self, view: SlotView, fl: InFlight) -> None:
        self.inflight.untrack(fl)
        view.release(time.monotonic(), fl.request_id)

    def _track(self, view: SlotView, r: Routing, attempt: str) -> InFlight:
        now = time.monotonic()
        ask = r.ask
        view.occupy(now, r.rid, ask.prediction.expected_us / 1e6, ask.prediction.p99_us / 1e6)
        return self.inflight.track(InFlight(
            request_id=r.rid, model=r.model, reply=r.msg.reply, node=view.node, key=view.key,
            placed_s=now, tenant=r.tenant,
            subject=view.subject, stream=view.stream,
            deadline_s=ask.deadline_s,
            # The router owns the deadline of what it placed: a stream's whole one.
            answer_by_s=(ask.end_deadline_s or ask.deadline_s) + self.cfg.deadline_grace_ms / 1000,
            max_tokens=r.max_tokens, attempt=attempt,
            received_s=ask.came_s if ask.came_s is not None else ask.now_s,
            streams=ask.end_deadline_s is not None,
        ))

    async def _refuse(self, msg: Msg, rid: str, model: str, r: Refuse,
                      tenant: str | None = None) -> None:
        """Answer `msg` with refusal `r` (`tenant`: who sent it, when already known)."""
        hdrs = msg.headers or {}
        await self._answer(msg.reply, hdrs, rid, model, r,
                           tenant if tenant is not None
                           else self.tenants.of(hdrs, across_import(hdrs)))

    async def _answer(self, reply: str, hdrs: Mapping[str, str], rid: str, model: str,
                      r: Refuse, tenant: str) -> None:
        """Every refusal the router sends goes out here, counted once: by status and
        reason, for the tenant, as an error of the micro endpoint when it is one."""
        body, block = replies.error_block(rid, r.status, r.reason, r.message,
                                          retry_after_ms=r.retry_after_ms, ticket=r.ticket,
                                          extra=trace_headers(hdrs))
        self._answered(model, str(int(r.status))).inc()
        self.meter.answered(tenant, model, int(r.status))
        if r.status is Status.BUSY:  # a 429 is admission at work, not an error
            self._refusals(model, r.reason.value).inc()
            if r.ticket is not None:
                self._tickets_issued(model).inc()
        else:
            self.errored(model, int(r.status), r.message)
        if reply:
            await publish(self.nc, reply, body, block)
