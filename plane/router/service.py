"""The router: serves `plane.infer.<model>` in the queue group `plane-routers`.

Per request: validate, read the deadline, ask admission for a slot (or a refusal with a
ticket), publish to the slot's depth-one subject with the caller's inbox in a header, and step
to the next candidate when the broker refuses. The node answers the caller directly; the
router answers only refusals, bad requests, and (as the deadline owner) a 503/504 for a
request whose node died or went silent, so that every request ends in exactly one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.service import Service

from plane import replies
from plane.budget import predict
from plane.config import FALLBACK_DEADLINE_MS, RouterConfig
from plane.errors import BadRequest
from plane.headers import read_caller
from plane.identity import Heard, Instances
from plane.lifecycle import Lifecycle, TaskOwner
from plane.messages import (
    DoneEvent,
    Reason,
    Status,
    done_decoder,
    heartbeat_decoder,
    json_encoder,
)
from plane.metrics import PlaneMetrics
from plane.models import MODELS, model_spec
from plane.ownership import NOT_ANSWERED
from plane.provision import ProvisionPlan, ensure_all
from plane.router.admission import Admission, Ask, Park, Place, Refuse, ticket_owner
from plane.router.inflight import InFlight, InFlightBook
from plane.router.memory import FloodMemory
from plane.router.occupancy import ModelSlots, SlotView, slot_key
from plane.router.parking import ParkingLot
from plane.router.peers import Peers
from plane.router.slot_publish import NoStream, Outcome, Published, Refused, SlotPublisher, TimedOut
from plane.settings import LiveSettings
from plane.subjects import ROUTER_QUEUE_GROUP, Header, InvalidToken, check_token

log = structlog.get_logger("plane.router")

WATCHDOG_PERIOD_S = 0.02
ASK_NODE_TIMEOUT_S = 0.25
ASK_NODE_WITHIN_S = 2.0
# The broker frees a WorkQueue message a moment after the node's ack (it applies acks in the
# consumer's own goroutine, so the done-event, sent after the ack, can overtake it): when it
# still refuses a slot whose done-event came within SETTLE_WITHIN_S, wait and try again, a
# few times with growing waits (on a loaded host the ack can take milliseconds to land).
# Without this, callers = slots in a closed loop saw 28-46% false 429s.
BROKER_SETTLE_S = (0.0003, 0.0007, 0.0015, 0.003)
SETTLE_WITHIN_S = 0.010
# The watchdog judges nodes by their heartbeats only while the router's own loop keeps time:
# a tick this late means heartbeats may sit unread in our buffers (a burst of requests), not
# that nodes died. Cycle samples measured while the loop lags measure the lag, not the slot,
# and are not added to the estimate for LAG_QUIET_S after.
LOOP_LAG_S = 0.05
LAG_QUIET_S = 1.0
BEHIND_PATIENCE = 5
# How long a starting router waits to hear the advertised nodes before it takes requests.
LEARN_SLOTS_S = 1.0
# Room for headers in every message the router sends on a caller's behalf: the caller's own
# (bounded, see plane.headers), ours, and the reply subject (the server's max_control_line).
WIRE_HEADROOM_BYTES = 16 * 1024


def _is_depth_refusal(exc: APIError) -> bool:
    """The depth-one refusal. err_code 10077 is shared by other stream limits: match the
    description too."""
    return exc.err_code == 10077 and "maximum messages per subject" in (exc.description or "")


@dataclass(slots=True)
class Routing:
    """One request being decided: what the router read from it and what it asks for."""

    msg: Msg
    rid: str
    model: str
    ms: ModelSlots
    deadline_ms: int
    work_us: int
    ask: Ask
    t0: float  # perf_counter at receipt: the decision metric
    forwarded: bool  # came from another router (never forwarded twice)
    promiser: str  # the router that makes promises now
    may_promise: bool  # this router is it


@dataclass(slots=True)
class Placing:
    """A placement in progress: the candidate slots, the one being tried, its in-flight
    entry, and how often the broker has been asked again for it (`BROKER_SETTLE_S`)."""

    routing: Routing
    place: Place
    headers: dict[str, str]
    i: int = 0
    fl: InFlight | None = None
    settles: int = 0


class Router(Lifecycle, TaskOwner):
    def __init__(
        self,
        nc: Client,
        cfg: RouterConfig,
        metrics: PlaneMetrics | None = None,
        *,
        replicas: int = 1,
    ) -> None:
        super().__init__()
        self.nc = nc
        self.cfg = cfg
        self.metrics = metrics or PlaneMetrics()
        self.names = cfg.names
        self.js = nc.jetstream(timeout=cfg.publish_timeout_s)
        self.admission = Admission(
            ticket_prefix=cfg.router_id,
            on_lateness=lambda model, s: self.metrics.ticket_lateness.labels(model).observe(s))
        self.models: dict[str, ModelSlots] = {}
        self.inflight = InFlightBook(self.js, answer=self._answer_for_node,
                                     freed=self._freed, spawn=self._spawn,
                                     asked=self._node_answered)
        self.node_seen_s: dict[str, float] = {}
        self.instances = Instances()  # which process speaks for each node id
        self.parking = ParkingLot()  # holders waiting for a slot to free
        self.peers = Peers(nc, cfg.names, cfg.router_id, self.admission, self._model)
        self.settings = LiveSettings(cfg.names)
        self._plan = ProvisionPlan(names=cfg.names, replicas=replicas)
        self._subs: list[Subscription] = []
        self._request_subs: list[Subscription] = []  # drained, not dropped, at stop
        self._service: Service | None = None
        self._health_sub: Subscription | None = None
        self._done_sub: Subscription | None = None
        self._heard = asyncio.Event()  # set by each heartbeat (start-up waits on it)
        # Slot publishes whose PubAck comes to a callback (no task, future or timer each).
        self.publisher = SlotPublisher(nc, cfg.publish_timeout_s)
        self._waiting = 0  # requests in a task of their own (parked, forwarded)
        self.max_body_bytes = cfg.max_body_bytes  # at most what the server carries (start)
        self._lagged_s = -math.inf  # when the loop was last seen lagging
        self._started = False
        self._stopping = False
        # Set when the connection is closed for good (nats-py does not reconnect after some
        # server errors): the process must exit so its supervisor restarts it, never linger
        # deaf. The composition root waits on it (see `plane.serve`).
        self.lost = asyncio.Event()
        self.flood_memory = FloodMemory()

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        await self.peers.ensure_id_free()  # before we listen: we must not hear ourselves
        self._started = True
        self._fit_body_limit()
        nodes_kv, config_kv = await ensure_all(self.js, self._plan)
        await self.settings.start(config_kv)
        n = self.names
        self._health_sub = await self.nc.subscribe(n.health_all(), cb=self._on_heartbeat)
        self._subs.append(self._health_sub)
        self._done_sub = await self.nc.subscribe(n.done_all(), cb=self._on_done)
        self._subs.append(self._done_sub)
        self._subs.append(await self.nc.subscribe(n.admission_all(), cb=self.peers.on_note))
        await self.publisher.start()
        self._spawn(self._watchdog())
        await self._learn_slots(nodes_kv)
        self._request_subs = [
            await self.nc.subscribe(n.infer_all(), queue=ROUTER_QUEUE_GROUP, cb=self._on_request),
            # Our own subject: ticket holders whose retry reached another router come here.
            await self.nc.subscribe(n.router_infer_all(self.cfg.router_id), cb=self._on_request),
        ]
        self._subs.extend(self._request_subs)
        self._service = await add_service(
            self.nc, name=n.router_service, version="0.1.0",
            description="the plane's router: admission onto depth-one slots",
            metadata={"router_id": self.cfg.router_id, "prefix": n.prefix},
        )
        await self._service.add_endpoint(
            name="status", subject=n.router_status(self.cfg.router_id), handler=self._on_status
        )
        await self.nc.flush()
        log.info("router started", router=self.cfg.router_id, subject=n.infer_all())

    def _fit_body_limit(self) -> None:
        """Every message the router sends (a slot publish, a forward) is a caller's body plus
        headers; one over the server's max_payload makes the server close our connection.
        So the body limit is at most what the server carries, less room for the headers."""
        room = self.nc.max_payload - WIRE_HEADROOM_BYTES
        if self.max_body_bytes > room:
            log.warning("body limit lowered to fit the server's max_payload",
                        configured=self.max_body_bytes, limit=room,
                        max_payload=self.nc.max_payload)
            self.max_body_bytes = max(0, room)

    async def _learn_slots(self, nodes_kv: KeyValue, within_s: float = LEARN_SLOTS_S) -> None:
        """Before joining the queue group, hear the nodes that advertise slots (their
        heartbeats come every 250 ms): a router that took requests first answered each one
        503 `no-capacity` for a moment after every restart."""
        try:
            keys = await nodes_kv.keys()
        except Exception:  # no advert at all (a new plane), or the bucket cannot say
            return
        models = {key.rpartition(".")[2] for key in keys}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while not all((ms := self.models.get(m)) is not None and ms.healthy_count()
                              for m in models):
                    self._heard.clear()
                    await self._heard.wait()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking requests, let placements in progress finish, then close."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        # Drain, not unsubscribe, the subjects that bring requests: nats-py discards what a
        # subscription has read but not yet handed to us when it unsubscribes, and a request
        # already delivered to this router is answered by no one else (the soak lost one
        # request per few router SIGTERMs). Drain tells the server to stop, waits for the
        # round trip that ends its deliveries, and hands us every request it brought.
        taking = [s for s in self._subs if s in self._request_subs]
        await asyncio.gather(*(self._drain(s) for s in taking))
        # Placements whose PubAck is on its way: the broker answers within its timeout.
        await self.publisher.drained(timeout_s)
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            for t in still:
                t.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        # Heartbeats, done-events and peers' notes served the placements above until now.
        for sub in self._subs:
            if sub not in taking:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        with contextlib.suppress(Exception):
            await self.publisher.stop()
        await self.settings.stop()
        log.info("router stopped", router=self.cfg.router_id)

    async def _drain(self, sub: Subscription) -> None:
        try:
            await sub.drain()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped
        except Exception as exc:  # a closed connection: nothing more can arrive anyway
            log.info("request subscription not drained", error=repr(exc))

    # -- control plane ----------------------------------------------------------------------
    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad heartbeat ignored", subject=msg.subject)
            return
        if msg.subject != self.names.health(hb.node):
            return  # a node speaks only for itself, on its own subject
        now = time.monotonic()
        heard = self.instances.compare(hb.node, hb.instance, hb.started_ms)
        if heard is Heard.OLDER:
            return  # a process its id's newer one replaced: it speaks for nothing now
        if heard is Heard.NEWER:  # a restart: what the old process ran is a dead node's
            self._forget_node(hb.node, "a new process took over its id")
        self.instances.adopt(hb.node, hb.instance, hb.started_ms)
        self.node_seen_s[hb.node] = now
        if hb.stopping:
            self._forget_node(hb.node, "node stopping", draining=True)
            return
        for advert in hb.adverts:
            if advert.model not in MODELS or advert.node != hb.node:
                continue  # router state only for the plane's models and the sender's own slots
            for subject in self._model(advert.model).apply_advert(advert, self.names.slot):
                log.warning("slot advert ignored: its subject is not the slot's",
                            node=advert.node, subject=subject[:120])
        self._gauge_slots()
        self._heard.set()

    async def _on_done(self, msg: Msg) -> None:
        try:
            ev: DoneEvent = done_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        ms = self.models.get(ev.model)
        key = slot_key(ev.node, ev.k)
        if ms is not None:
            view = ms.slots.get(key)
            if view is not None and ev.status != NOT_ANSWERED:
                view.release(time.monotonic())
                self.parking.wake_one(ev.model)
            fl = self.inflight.entries.get(key)
            now = time.monotonic()
            if (ev.status == int(Status.OK) and fl is not None and fl.request_id == ev.request_id
                    and now - self._lagged_s > LAG_QUIET_S):
                # The slot's whole cycle as this router sees it (publish -> done-event), not
                # only the node's service time: that is when the slot is free again, and what
                # promises must be spaced by.
                cycle_us = int((now - fl.placed_s) * 1e6)
                ms.window.add(cycle_us - ev.work_us, now)
        self.inflight.done(key, ev.request_id, ev.status)

    def _freed(self, fl: InFlight) -> None:
        ms = self.models.get(fl.model)
        view = ms.slots.get(fl.key) if ms is not None else None
        if view is not None and view.request_id == fl.request_id:
            view.release(time.monotonic())
            self.parking.wake_one(fl.model)

    async def _on_status(self, req: Any) -> None:
        body = {
            "router": self.cfg.router_id,
            "models": {
                m: {
                    "slots": len(ms.slots), "healthy": ms.healthy_count(),
                    "busy": ms.busy_count(time.monotonic()), "p50_overhead_us": ms.window.p50_us,
                    "p99_overhead_us": ms.window.p99_us,
                }
                for m, ms in self.models.items()
            },
            "tickets": len(self.admission.tickets),
            "ticket_stats": dict(self.admission.stats),
            "redemption": self.admission.redemption,
            "inflight": len(self.inflight),
        }
        await req.respond(json_encoder.encode(body))

    def _model(self, model: str) -> ModelSlots:
        ms = self.models.get(model)
        if ms is None:
            ms = self.models[model] = ModelSlots(model=model)
        return ms

    def _forget_node(self, node: str, why: str, *, draining: bool = False) -> None:
        """Place nothing more on `node`. A draining node answers what it runs (the deadline
        and heartbeat-loss rules still hold); any other is dead: its requests in flight are
        taken and answered here (plane.router.inflight)."""
        for ms in self.models.values():
            if ms.remove_node(node):
                log.warning("node's slots removed", node=node, model=ms.model, why=why)
        if not draining:
            self.node_seen_s.pop(node, None)
            self.instances.forget(node)
            self.inflight.node_dead(node, why)
        self._gauge_slots()

    async def _watchdog(self) -> None:
        """Dead nodes (no heartbeat) and requests past their deadline with no done-event:
        the in-flight book takes their slot messages and answers 503 / 504."""
        timeout_s = self.cfg.node_timeout_ms / 1000
        reconnects = self.nc.stats["reconnects"]
        last = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            if self.nc.is_closed:
                log.error("connection to NATS closed for good: stopping so that this router "
                          "is restarted", router=self.cfg.router_id,
                          error=repr(self.nc.last_error))
                self.lost.set()
                return
            if self.nc.stats["reconnects"] != reconnects and self.nc.is_connected:
                reconnects = self.nc.stats["reconnects"]
                self._spawn(self._reprovision())
            now = time.monotonic()
            if now - last > WATCHDOG_PERIOD_S + LOOP_LAG_S:
                self._lagged_s = now
            last = now
            behind = self._behind(now)
            for node, seen in list(self.node_seen_s.items()):
                # While behind, only a silence far past the timeout counts (a loop that lags
                # for good must still find a dead node).
                if now - seen > timeout_s * (BEHIND_PATIENCE if behind else 1):
                    self._forget_node(node, f"no heartbeat for {now - seen:.1f} s")
            for ms in self.models.values():
                ms.window.expire(now)
            for then in self.publisher.expire(now):
                self._spawn(then(TimedOut()))
            self.inflight.tick(now)
            self.flood_memory.observe(self._in_hand() + self._backlog(), now)
            await self.peers.announce_if_due(now)

    def _behind(self, now_s: float) -> bool:
        """Whether this router may not have read the heartbeats that were sent to it: its loop
        lagged just now, or heartbeats wait unread in the subscription."""
        pending = self._health_sub.pending_msgs if self._health_sub is not None else 0
        return pending > 0 or now_s - self._lagged_s < WATCHDOG_PERIOD_S * 5

    async def _reprovision(self) -> None:
        """After a reconnect (a broker restart loses memory streams): provision again, in its
        own task so the watchdog keeps running while there is no JetStream leader."""
        log.warning("reconnected: re-provisioning", router=self.cfg.router_id)
        for _ in range(50):
            try:
                await ensure_all(self.js, self._plan)
                return
            except Exception as exc:
                log.info("re-provisioning waits for JetStream", error=repr(exc))
                await asyncio.sleep(0.2)

    async def _node_answered(self, fl: InFlight, placement: str, patient: bool) -> bool:
        """True only when the node says it answered that placement. Asked again while the
        question cannot get through (our own server may be failing over); False when the
        node stays silent for `ASK_NODE_WITHIN_S` (it is dead: nobody else will answer)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (ASK_NODE_WITHIN_S if patient else 0.0)
        while True:
            try:
                msg = await self.nc.request(self.names.node_answered(fl.node),
                                            placement.encode(), timeout=ASK_NODE_TIMEOUT_S)
                return msg.data == b"1"
            except Exception:
                if loop.time() >= give_up:
                    return False
                await asyncio.sleep(0.05)

    async def _answer_for_node(self, fl: InFlight, status: Status, reason: Reason,
                               text: str) -> None:
        body, headers = replies.error_reply(fl.request_id, status, reason, text, node=fl.node)
        self.metrics.watchdog_answers.labels(fl.model, str(int(status))).inc()
        self.metrics.router_requests.labels(fl.model, str(int(status))).inc()
        await self.nc.publish(fl.reply, body, headers=headers)
        log.warning("router answered for node", request_id=fl.request_id, node=fl.node,
                    status=int(status))

    def _gauge_slots(self) -> None:
        for m, ms in self.models.items():
            self.metrics.slots_known.labels(m, "healthy").set(ms.healthy_count())
            self.metrics.slots_known.labels(m, "busy").set(ms.busy_count(time.monotonic()))

    # -- data plane -------------------------------------------------------------------------
    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("request without reply subject dropped", subject=msg.subject)
            return
        if self._in_hand() >= self.cfg.max_routing:
            # A flood: refuse at once, in the callback, without a task or any state per
            # request, so the loop keeps up with heartbeats and done-events (and memory stays
            # bounded). Come back after about one slot cycle.
            await self._shed(msg)
            return
        if self._done_sub is not None and self._done_sub.pending_msgs:
            # Done-events read before this request are still queued for their own task: let
            # them land first (one turn of the loop; they were scheduled before us), so a
            # slot whose caller already has its answer is seen free. Deciding ahead of them
            # refused callers = slots 13% of the time.
            await asyncio.sleep(0)
        await self._route_one(msg)

    def _backlog(self) -> int:
        """Requests delivered to us and not read yet."""
        return sum(s.pending_msgs for s in self._request_subs)

    def _in_hand(self) -> int:
        """Requests decided or placed now: those whose PubAck is awaited, and those waiting
        in a task (parked holders, forwards). Counted, never kept: it cannot drift."""
        return len(self.publisher) + self._waiting

    async def _shed(self, msg: Msg) -> None:
        model = self.names.infer_model_of(msg.subject)
        ms = self.models.get(model)
        label = model if ms is not None else "unknown"  # metric labels stay bounded
        wait_ms = max(1, math.ceil(ms.window.mean_us / 1000)) if ms is not None else 1000
        self.metrics.shed.labels(label).inc()
        await self._refuse(msg, self.nc.new_inbox()[7:], label, Refuse(
            Status.BUSY, Reason.BUSY,
            f"router {self.cfg.router_id} has {self._in_hand()} requests in hand (its "
            "limit): come back shortly", retry_after_ms=wait_ms))

    async def _route_one(self, msg: Msg) -> None:
        """Decide, on the subscription's own task: the common cases (a placement, a refusal)
        finish here or in the PubAck's callback, with no task per request; only a request
        that must wait (a parked holder, a forward to another router) gets a task."""
        t0 = time.perf_counter()
        hdrs = msg.headers or {}
        model = self.names.infer_model_of(msg.subject)
        label = model if model in MODELS else "unknown"  # metric labels stay bounded
        try:
            caller = read_caller(hdrs)  # before anything of the caller's is echoed
        except BadRequest as exc:
            # A request id that failed the check is never echoed: the 400 gets a fresh one.
            await self._refuse(msg, exc.request_id or self.nc.new_inbox()[7:], label, Refuse(
                Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc)))
            return
        rid = caller.request_id or self.nc.new_inbox()[7:]
        try:
            check_token("model", model)
            if len(msg.data) > self.max_body_bytes:
                await self._refuse(msg, rid, label, Refuse(
                    Status.TOO_LARGE, Reason.TOO_LARGE,
                    f"body is {len(msg.data)} bytes; the limit is {self.max_body_bytes}"))
                return
            spec = model_spec(model)
            deadline_ms = self._deadline_ms(model, caller.deadline_ms)
            req = spec.decode(msg.data, caller.content_type)
        except (InvalidToken, BadRequest) as exc:
            await self._refuse(msg, rid, label,
                               Refuse(Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc)))
            return
        forwarded = Header.FORWARDED_BY in hdrs  # never forwarded twice
        owner = ticket_owner(caller.ticket) if caller.ticket else None
        ms = self._model(model)
        work_us = spec.work_us(req)
        now = time.monotonic()
        # One router makes every promise (so no two promise the same slot time); the others
        # place what fits now and hand it what needs a promise.
        promiser = self.cfg.router_id if forwarded else self.peers.promiser()
        r = Routing(
            msg=msg, rid=rid, model=model, ms=ms, deadline_ms=deadline_ms, work_us=work_us,
            t0=t0, forwarded=forwarded, promiser=promiser,
            may_promise=promiser == self.cfg.router_id,
            ask=Ask(now_s=now, deadline_s=now + deadline_ms / 1000,
                    prediction=predict(ms.window, work_us), ticket=caller.ticket,
                    avoid_node=caller.avoid_node),
        )
        if owner is not None and owner != self.cfg.router_id and not forwarded:
            self._spawn(self._decide_slowly(r, None, ticket_owner=owner))
            return
        decision = self.admission.decide(ms, r.ask, may_promise=r.may_promise)
        if isinstance(decision, Park) or (isinstance(decision, Refuse) and decision.delegate):
            self._spawn(self._decide_slowly(r, decision))
            return
        await self._conclude(r, decision, parked=False)

    async def _decide_slowly(self, r: Routing, decision: Place | Park | Refuse | None, *,
                             ticket_owner: str | None = None) -> None:
        """What must wait: a ticket holder's retry that belongs to another router (forwarded
        to it), a holder parked until a slot frees, a refusal that needs the promiser."""
        self._waiting += 1
        try:
            await self._decide_waiting(r, decision, ticket_owner)
        finally:
            self._waiting -= 1

    async def _decide_waiting(self, r: Routing, decision: Place | Park | Refuse | None,
                              ticket_owner: str | None) -> None:
        if ticket_owner is not None:
            if await self._forward(r, ticket_owner, "ticket"):
                await self._decided(r, "forwarded")
                return
            decision = self.admission.decide(r.ms, r.ask, may_promise=r.may_promise)
        assert decision is not None
        decided, parked = await self._admit(r.ms, r.ask, decision, may_promise=r.may_promise)
        if isinstance(decided, Refuse) and decided.delegate:
            if await self._forward(r, r.promiser, "promise"):
                await self._decided(r, "forwarded")
                return
            r.ask = r.ask.later(time.monotonic(), as_newcomer=True)  # it is gone: promise here
            decided = self._decide_now(r)
        await self._conclude(r, decided, parked=parked)

    def _decide_now(self, r: Routing) -> Place | Refuse:
        """A decision that cannot park (a re-decision after a forward or a lost race)."""
        decision = self.admission.decide(r.ms, r.ask, may_park=False)
        assert not isinstance(decision, Park)
        return decision

    async def _conclude(self, r: Routing, decision: Place | Park | Refuse, *,
                        parked: bool) -> None:
        if isinstance(decision, Refuse):
            await self._refuse(r.msg, r.rid, r.model, decision)
            await self._decided(r, "refused-after-park" if parked else "refused")
            return
        assert isinstance(decision, Place)
        await self._try_candidate(Placing(routing=r, place=decision,
                                          headers=self._slot_headers(r)))

    async def _decided(self, r: Routing, outcome: str) -> None:
        """The one record of a request's decision; then tell the other routers what changed
        (nothing, and nothing sent, when this router is alone)."""
        self.metrics.router_decision_seconds.labels(r.model, outcome).observe(
            time.perf_counter() - r.t0)
        await self.peers.tell()

    async def _forward(self, r: Routing, owner: str, why: str) -> bool:
        """Hand a request to router `owner` and relay its answer: a ticket holder's to the
        router that made its promise (the routers share one queue group, so a retry lands on
        any of them), or one that needs a promise to the router that makes them. False when
        that router is gone: the request is decided here."""
        msg, model = r.msg, r.model
        headers = dict(msg.headers or {})
        headers[Header.FORWARDED_BY] = self.cfg.router_id
        # Longer than the owner's own deadline handling (deadline + grace + its takeover), so
        # its answer, whatever it is, comes back before we give up on it.
        wait_s = r.deadline_ms / 1000 + self.cfg.deadline_grace_ms / 1000 + 1.0
        try:
            answer = await self.nc.request(self.names.router_infer(owner, model), msg.data,
                                           timeout=wait_s, headers=headers)
        except NoRespondersError:
            self.metrics.forwarded.labels(model, why, "owner-gone").inc()
            return False
        except (NatsTimeoutError, TimeoutError):
            self.metrics.forwarded.labels(model, why, "no-answer").inc()
            await self._refuse(msg, r.rid, model, Refuse(
                Status.DEADLINE, Reason.DEADLINE,
                f"router {owner} (asked for this request's promise) did not answer in time"))
            return True
        self.metrics.forwarded.labels(model, why, "relayed").inc()
        if msg.reply:
            await self.nc.publish(msg.reply, answer.data, headers=dict(answer.headers or {}))
        return True

    async def _admit(self, ms: ModelSlots, ask: Ask, decision: Place | Park | Refuse, *,
                     may_promise: bool) -> tuple[Place | Refuse, bool]:
        """Wait out a parked holder's decision; the final one, and whether it was parked."""
        parked = isinstance(decision, Park)
        if isinstance(decision, Park):
            self.metrics.parked.labels(ms.model).inc()
        while isinstance(decision, Park):
            # Wait for a slot to free for this holder (the lot wakes holders in due order),
            # then look again, until the park window closes.
            loop_until = asyncio.get_running_loop().time() + (
                decision.until_s - time.monotonic())
            await self.parking.wait(ms.model, decision.holder.due_s, loop_until)
            now = time.monotonic()
            ask = replace(ask.later(now), park_until_s=decision.until_s)
            decision = self.admission.decide(ms, ask, may_park=now < decision.until_s,
                                             may_promise=may_promise)
        return decision, parked

    def _deadline_ms(self, model: str, asked_ms: int | None) -> int:
        """The caller's deadline (already checked, `plane.headers`), else the model's live
        setting, else its configured default."""
        if asked_ms is not None:
            return asked_ms
        return self.settings.deadline_ms(model) or self.cfg.default_deadline_ms.get(
            model, FALLBACK_DEADLINE_MS)

    def _slot_headers(self, r: Routing) -> dict[str, str]:
        hdrs = r.msg.headers or {}
        deadline_ms = max(1, int((r.ask.deadline_s - time.monotonic()) * 1000))
        out = {
            Header.REPLY_TO: r.msg.reply,
            Header.REQUEST_ID: r.rid,
            Header.DEADLINE_AT: str(replies.now_ms() + deadline_ms),
            Header.DEADLINE_MS: str(deadline_ms),
            Header.WORK_US: str(r.work_us),
            Header.ROUTER: self.cfg.router_id,
            Header.ATTEMPT: hdrs.get(Header.ATTEMPT, "1"),
            # A backstop that frees an orphaned slot, in whole seconds (the server's unit):
            # the deadline rounded up plus one, so the message outlives the router's takeover
            # at the deadline (an expired message would look "taken by the node").
            Header.NATS_TTL: f"{math.ceil(deadline_ms / 1000) + 1}s",
        }
        if ct := hdrs.get(Header.CONTENT_TYPE):
            out[Header.CONTENT_TYPE] = ct
        return out

    async def _try_candidate(self, p: Placing) -> None:
        """Publish onto the next candidate slot; the broker's answer comes to `_placed`."""
        r = p.routing
        if p.i >= len(p.place.candidates):
            # Every candidate was taken under us (another router): refuse with a ticket now.
            r.ask = r.ask.later(time.monotonic(), as_newcomer=True)
            again = self._decide_now(r)
            refusal = again if isinstance(again, Refuse) else Refuse(
                Status.BUSY, Reason.BUSY, "all slots are busy", retry_after_ms=max(
                    1, math.ceil(r.ask.prediction.p50_us / 1000)))
            await self._refuse(r.msg, r.rid, r.model, refusal)
            await self._decided(r, "refused")
            return
        view = p.place.candidates[p.i]
        # Track before publishing: the node's done-event can arrive before our PubAck.
        p.fl = self._track(view, r.rid, r.model, r.msg.reply, r.ask)
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
                if p.place.redeemed is not None:
                    self.admission.redeemed(r.ms, p.place.redeemed)
                    self.metrics.tickets_honoured.labels(r.model).inc()
                await self.peers.tell_taken(r.model, view, p.place, r.ask)
                await self._decided(r, "placed")
            case TimedOut():
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
                        wait_s, lambda: self._spawn(self._send(p)))
                    return
                # Someone else's request is there (another router's): busy until its
                # done-event, or its p99 at most.
                self._untrack(view, fl)
                self.metrics.broker_refusals.labels(r.model).inc()
                view.occupy(time.monotonic(), None, r.ask.prediction.expected_us / 1e6,
                            r.ask.prediction.p99_us / 1e6)
                p.i, p.settles = p.i + 1, 0
                await self._try_candidate(p)
            case Refused(error=exc):
                await self._unplaced(p, f"the broker refused: {exc}")
            case NoStream():
                self._spawn(self._reprovision())
                await self._unplaced(p, "no JetStream slot stream answers: is the broker up?")

    @staticmethod
    def _settling(p: Placing, view: SlotView) -> bool:
        """A depth refusal just after the slot's done-event: try again a few times."""
        if p.settles == 0:
            return time.monotonic() - view.freed_s < SETTLE_WITHIN_S
        return p.settles < len(BROKER_SETTLE_S)

    async def _unplaced(self, p: Placing, why: str) -> None:
        r, view = p.routing, p.place.candidates[p.i]
        if p.fl is not None:
            self._untrack(view, p.fl)
        await self._refuse(r.msg, r.rid, r.model, Refuse(
            Status.UNAVAILABLE, Reason.UNHEALTHY, why, retry_after_ms=1000))
        await self._decided(r, "refused")

    def _untrack(self, view: SlotView, fl: InFlight) -> None:
        self.inflight.untrack(fl)
        if view.request_id == fl.request_id:
            view.busy, view.request_id = False, None

    def _track(self, view: SlotView, rid: str, model: str, reply: str, ask: Ask) -> InFlight:
        now = time.monotonic()
        view.occupy(now, rid, ask.prediction.expected_us / 1e6, ask.prediction.p99_us / 1e6)
        return self.inflight.track(InFlight(
            request_id=rid, model=model, reply=reply, node=view.node, key=view.key,
            placed_s=now,
            subject=view.subject, stream=self.names.slot_stream_for(view.node),
            deadline_s=ask.deadline_s,
            answer_by_s=ask.deadline_s + self.cfg.deadline_grace_ms / 1000,
        ))

    async def _refuse(self, msg: Msg, rid: str, model: str, r: Refuse) -> None:
        body, headers = replies.error_reply(
            rid, r.status, r.reason, r.message, retry_after_ms=r.retry_after_ms, ticket=r.ticket)
        self.metrics.router_requests.labels(model, str(int(r.status))).inc()
        if r.status == Status.BUSY:
            self.metrics.refusals.labels(model, r.reason.value).inc()
            if r.ticket is not None:
                self.metrics.tickets_issued.labels(model).inc()
        if msg.reply:
            await self.nc.publish(msg.reply, body, headers=headers)
