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
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.service import Service

from plane.contract import replies
from plane.contract.config import ConnectOptions, RouterConfig
from plane.contract.doze import Doze
from plane.contract.identity import Heard, Instances
from plane.contract.lifecycle import Lifecycle, TaskOwner, cancel_and_wait
from plane.contract.messages import (
    DoneEvent,
    Reason,
    Status,
    heartbeat_decoder,
    json_encoder,
    read_done,
)
from plane.contract.metrics import Children, PlaneMetrics
from plane.contract.models import MODELS
from plane.contract.natsconn import connected_since_s, on_overflow
from plane.contract.ownership import NOT_ANSWERED, ask_answered, reply_answered
from plane.contract.provision import ProvisionPlan, Reprovisioner, ensure_all_at_start
from plane.contract.reply_inbox import ReplyInbox
from plane.contract.settings import LiveSettings
from plane.contract.slot_leaders import keep_apart
from plane.contract.soon_flush import use_soon_flush
from plane.contract.subjects import ROUTER_QUEUE_GROUP
from plane.contract.taken_as_read import take_as_read
from plane.contract.tracing import Tracing
from plane.router.admission import Admission
from plane.router.calls import Calls
from plane.router.inbox import Inbox
from plane.router.inflight import InFlight, InFlightBook
from plane.router.memory import FloodMemory
from plane.router.micro import InferEndpoint
from plane.router.occupancy import ModelSlots, slot_key
from plane.router.parking import ParkingLot
from plane.router.peers import PRESENCE, Peers
from plane.router.requests import RequestPath, RouterParts
from plane.router.slot_publish import SlotPublisher, TimedOut
from plane.router.stall import LoopStalls

log = structlog.get_logger("plane.router")

WATCHDOG_PERIOD_S = 0.02
# With nothing to watch (no placement awaiting its PubAck or done-event, no request in hand,
# no holder parked, no promise open) the watchdog only looks after nodes' heartbeats (a
# second's silence), peers and the connection: it wakes this often, and the first slot publish
# after such a spell wakes it at once. On this project's VMs a timer's wake from idle costs
# ~220 us of CPU (`benchmarks/wake_cost.py`): 50 a second were an idle router's main cost.
IDLE_WATCHDOG_PERIOD_S = 0.1
# Promises lapse on the watchdog's tick (`Admission.tidy`) this long after their time, when
# no decision saw them lapse first: a forward's hop and a busy loop's turns.
TIDY_GRACE_S = 0.25
ASK_NODE_TIMEOUT_S = 0.25
ASK_NODE_WITHIN_S = 2.0
# A node not heard from for this share of the heartbeat timeout (`node_timeout_ms`, four of
# its heartbeat periods: two periods) cannot say now whether it answered a request whose
# deadline passed (it is stopped, dead or cut off): the router answers for it at once rather
# than ask on until its heartbeats lapse. Asked on, a killed or stopped node's requests were
# answered 0.3-0.6 s after deadline + grace, after an SDK caller had made its own 504
# (/tmp/probeF finding 3). Our own connection must have been up this long, and our loop
# keeping time, for its silence to mean that.
HEARTBEAT_OVERDUE_SHARE = 0.5
# The watchdog judges nodes by their heartbeats only while the router's own loop keeps time:
# a tick this late means heartbeats may sit unread in our buffers (a burst of requests), not
# that nodes died. Cycle samples measured while the loop lags measure the lag, not the slot,
# and are not added to the estimate for LAG_QUIET_S after.
LOOP_LAG_S = 0.05
LAG_QUIET_S = 1.0
BEHIND_PATIENCE = 5
# How long a starting router waits to hear the advertised nodes before it takes requests.
LEARN_SLOTS_S = 1.0
# How often a router in a cluster looks at where the slot streams are led from.
SPREAD_LEADERS_S = 10.0
# Room for headers in every message the router sends on a caller's behalf: the caller's own
# (bounded, see plane.contract.headers), ours, and the reply subject (the server's
# max_control_line).
WIRE_HEADROOM_BYTES = 16 * 1024



def router_connection(opts: ConnectOptions) -> ConnectOptions:
    """A router's connection options: without echo. Nothing a router subscribes to is
    published by itself (requests, done-events and heartbeats, other routers' notes, PubAcks),
    but with echo on the server handed it back every admission note it sent (a `SlotTaken`
    per placement while other routers are up): a message read, decoded and dropped per
    placement, on top of the others' notes."""
    return replace(opts, no_echo=True)


class Router(Lifecycle, TaskOwner):
    def __init__(
        self,
        nc: Client,
        cfg: RouterConfig,
        metrics: PlaneMetrics | None = None,
        *,
        replicas: int = 1,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__()
        # Written as the plane's own connections are (a borrowed one too): then the flush at
        # the end of `start` is a barrier for the subscriptions made before it. nats-py's own
        # writes its PING ahead of them, and a request sent right after `start` found no
        # responder (tests/test_abuse_router.py, in CI).
        use_soon_flush(nc)
        self.nc = nc
        self.cfg = cfg
        self.metrics = metrics or PlaneMetrics()
        self._answered_s = Children(self.metrics.router_answered_seconds)
        self.names = cfg.names
        self.js = nc.jetstream(timeout=cfg.publish_timeout_s)
        self.admission = Admission(
            ticket_prefix=cfg.router_id,
            on_lateness=lambda model, s: self.metrics.ticket_lateness.labels(model).observe(s))
        self.models: dict[str, ModelSlots] = {}
        self.instances = Instances()  # which process speaks for each node id
        self.inflight = InFlightBook(self.js, answer=self._answer_for_node,
                                     freed=self._freed, spawn=self._spawn,
                                     asked=self._node_answered,
                                     instance_of=self.instances.token)
        self.node_seen_s: dict[str, float] = {}
        self.parking = ParkingLot()  # holders waiting for a slot to free
        self.peers = Peers(nc, cfg.names, cfg.router_id, self.admission, self._model,
                           models=cfg.models)
        self.admission.called_elsewhere = self.peers.calls_elsewhere
        # Ticket holders with an inbox, called back when a slot frees for them (or a call's
        # trip before it is predicted to, for long work).
        self.calls = Calls(nc, self.admission, self.parking, self.peers.tell, self._spawn)
        self.settings = LiveSettings(cfg.names)
        self._plan = ProvisionPlan(names=cfg.names, replicas=replicas)
        self._reprovisioner = Reprovisioner(self.js, self._plan, who=cfg.router_id)
        self._subs: list[Subscription] = []
        self._request_subs: list[Subscription] = []  # drained, not dropped, at stop
        self._service: Service | None = None
        self._health_sub: Subscription | None = None
        self._done_subs: list[Subscription] = []
        self._infer: dict[str, InferEndpoint] = {}  # by model ("" for every model)
        self._heard = asyncio.Event()  # set by each heartbeat (start-up waits on it)
        # Slot publishes whose PubAck comes to a callback (no task, future or timer each).
        self.publisher = SlotPublisher(nc, cfg.publish_timeout_s, on_busy=self._rouse_watchdog)
        self.forwards = ReplyInbox(nc)  # forwards to other routers, and their answers
        self.requests = RequestPath(RouterParts(
            nc=nc, cfg=cfg, metrics=self.metrics, admission=self.admission, models=self.models,
            model=self._model, publisher=self.publisher, forwards=self.forwards,
            inflight=self.inflight,
            peers=self.peers, parking=self.parking, settings=self.settings,
            spawn=self._spawn, reprovision=self._reprovision,
            tracing=tracing or Tracing.off(), look_ahead=self.calls.ahead))
        self._lagged_s = -math.inf  # when the loop was last seen lagging
        self._overdue_s = HEARTBEAT_OVERDUE_SHARE * cfg.node_timeout_ms / 1000
        # When the loop stood still (the watchdog's tick says): what the inboxes read after.
        self.stalls = LoopStalls(cfg.max_inbox_wait_ms / 1000)
        self._gone: dict[str, str] = {}  # nodes known dead (`nodes_gone`), and why
        self._started = False
        self._stopping = False
        # Set when the connection is closed for good (nats-py does not reconnect after some
        # server errors): the process must exit so its supervisor restarts it, never linger
        # deaf. The composition root waits on it (see `plane.serve`).
        self.lost = asyncio.Event()
        self.flood_memory = FloodMemory()
        self._doze = Doze()  # the idle watchdog's sleep, cut short by a slot publish
        self._leaders: asyncio.Task[None] | None = None  # `_spread_leaders`, in a cluster
        self.watchdog_ticks = 0

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        await self.peers.ensure_id_free()  # before we listen: we must not hear ourselves
        self._started = True
        self.requests.fit_body_limit(self.nc.max_payload, WIRE_HEADROOM_BYTES)
        nodes_kv, config_kv = await ensure_all_at_start(self.js, self._plan, who="router")
        await self.settings.start(config_kv)
        n = self.names
        self._health_sub = await self.nc.subscribe(n.health_all(), cb=self._on_heartbeat)
        self._subs.append(self._health_sub)
        served = sorted(self.cfg.models) if self.cfg.models is not None else None
        # A router that serves some models hears their done-events and notes only: none of
        # the traffic of the models other routers serve.
        for subject in ([n.done_all()] if served is None else [n.done_model(m) for m in served]):
            self._done_subs.append(take_as_read(
                await self.nc.subscribe(subject, cb=self._on_done), self._done_read))
        self._subs.extend(self._done_subs)
        for subject in ([n.admission_all()] if served is None
                        else [n.admission(PRESENCE), *(n.admission(m) for m in served)]):
            self._subs.append(await self.nc.subscribe(subject, cb=self.peers.on_note))
        self._subs.append(await self.nc.subscribe(n.router_answered(self.cfg.router_id),
                                                  cb=self._on_answered_query))
        await self.publisher.start()
        self._spawn(self._watchdog())
        if self._plan.replicas > 1:  # a cluster's slot streams: their leaders kept apart
            self._leaders = asyncio.create_task(self._spread_leaders(), name="slot-leaders")
        await self._learn_slots(nodes_kv)
        self._service = await add_service(
            self.nc, name=n.router_service, version="0.1.0",
            description="the plane's router: admission onto depth-one slots",
            metadata={"router_id": self.cfg.router_id, "prefix": n.prefix},
        )
        await self._service.add_endpoint(
            name="status", subject=n.router_status(self.cfg.router_id), handler=self._on_status
        )
        await self._service.add_endpoint(
            name="meter", subject=n.router_meter(self.cfg.router_id), handler=self._on_meter)
        # Inference itself is a micro endpoint (listed and counted by $SRV.INFO / STATS): one
        # for every model, or one per model served (`infer-<model>`).
        self._infer = {"": InferEndpoint(
            self._service, subject=n.infer_all(), queue=ROUTER_QUEUE_GROUP,
            handler=self.requests.on_request, metadata={"models": ",".join(sorted(MODELS))},
        )} if served is None else {m: InferEndpoint(
            self._service, subject=n.infer(m), queue=ROUTER_QUEUE_GROUP,
            handler=self.requests.on_request, metadata={"models": m}, name=f"infer-{m}",
        ) for m in served}
        self.requests.errored = self._count_error
        self._request_subs = [
            *[await e.start(self.nc, self.cfg.max_pending) for e in self._infer.values()],
            # Our own subject: ticket holders whose retry reached another router come here.
            await self.nc.subscribe(n.router_infer_all(self.cfg.router_id),
                                    cb=self.requests.on_request,
                                    pending_msgs_limit=self.cfg.max_pending),
        ]
        for sub in self._request_subs:
            self.requests.inboxes.append(Inbox(sub, max_wait_s=self.cfg.max_inbox_wait_ms / 1000,
                                               read_first=self.requests.read_first,
                                               stalls=self.stalls))
            on_overflow(sub, self.requests.overflowed)
        self._subs.extend(self._request_subs)
        await self.nc.flush()
        log.info("router started", router=self.cfg.router_id, models=served or "all",
                 subject=n.infer_all() if served is None else [n.infer(m) for m in served])

    def _count_error(self, model: str, status: int, text: str) -> None:
        """An error answer, in the micro endpoint that took the model's requests."""
        endpoint = self._infer.get(model) or self._infer.get("")
        if endpoint is not None:
            endpoint.count_error(status, text)

    async def _learn_slots(self, nodes_kv: KeyValue, within_s: float = LEARN_SLOTS_S) -> None:
        """Before joining the queue group, hear the nodes that advertise slots (their
        heartbeats come every 250 ms): a router that took requests first answered each one
        503 `no-capacity` for a moment after every restart."""
        try:
            keys = await nodes_kv.keys()
        except Exception:  # no advert at all (a new plane), or the bucket cannot say
            return
        models = {m for key in keys if self.cfg.serves(m := key.rpartition(".")[2])}
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
        self.calls.close()
        if self._leaders is not None:
            await cancel_and_wait(self._leaders)
        # Drain, not unsubscribe, the subjects that bring requests: nats-py discards what a
        # subscription has read but not yet handed to us when it unsubscribes, and a request
        # already delivered to this router is answered by no one else (the soak lost one
        # request per few router SIGTERMs). Drain tells the server to stop, waits for the
        # round trip that ends its deliveries, and hands us every request it brought.
        taking = [s for s in self._subs if s in self._request_subs]
        await asyncio.gather(*(self._drain(s) for s in taking))
        for endpoint in self._infer.values():
            endpoint.detach()
        # Placements whose PubAck is on its way: the broker answers within its timeout.
        await self.publisher.drained(timeout_s)
        for node, why in self._gone.items():  # what was on its way to them is theirs no more
            self.inflight.node_dead(node, why)
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
            if (advert.model not in MODELS or not self.cfg.serves(advert.model)
                    or advert.node != hb.node):
                continue  # state only for the models it serves and the sender's own slots
            for named in self._model(advert.model).apply_advert(advert, self.names, now):
                log.warning("slot advert ignored: its subject or stream is not the plane's",
                            node=advert.node, named=named[:120])
        self._gauge_slots()
        self._heard.set()

    async def _on_done(self, msg: Msg) -> None:
        """What nats-py would call (it takes only coroutines); `take_as_read` goes round it."""
        self._done_read(msg)

    def _done_read(self, msg: Msg) -> None:
        """A done-event, as it is read (`take_as_read`): the slot is free in our books before
        anything read after it is handled (a request whose caller had its answer first
        found the slot busy: callers = slots refused 13% of the time), and its cycle ends
        at its receipt, not when our loop got round to it (a volley of requests ahead of it
        taught the router 50+ ms cycles for a 1 ms model)."""
        try:
            events = read_done(msg.data, batch=self.names.is_done_batch(msg.subject))
        except msgspec.DecodeError:
            return
        now = time.monotonic()
        for ev in events:  # a node's one loop turn's (`gpu_node.done_batch`), in order
            self._done_event(ev, now)

    def _done_event(self, ev: DoneEvent, now: float) -> None:
        ms = self.models.get(ev.model)
        key = slot_key(ev.node, ev.k)
        if ms is not None:
            view = ms.slots.get(key)
            if view is not None and ev.status != NOT_ANSWERED:
                view.finished(now, ev.request_id, ev.router)
                self._slot_freed(ms, now)
            fl = self.inflight.entries.get(key)
            if fl is not None and fl.request_id == ev.request_id:
                self._placed_done(ms, fl, ev, now)
        self.inflight.done(key, ev.request_id, ev.status)

    def _placed_done(self, ms: ModelSlots, fl: InFlight, ev: DoneEvent, now: float) -> None:
        """A done-event for a request this router placed: meter it, and learn its cycle."""
        if ev.status != NOT_ANSWERED and not fl.resolving:
            self.requests.ended(fl, ev.status, ev.service_us, ev.sms)
        if ev.status != int(Status.OK):
            return
        if not fl.streams and fl.received_s:
            self._answered_s(fl.model).observe(now - fl.received_s)
        if ev.tokens or ev.prompt_tokens:
            # A generation: its per-token rates, timed by the node on the slot's thread, so
            # they hold whatever our own loop was doing (a lag here made a stream that ran
            # right after a router's start teach nothing: CI, test_streams_client).
            ms.rates.learn(ev.prompt_tokens, ev.tokens, ev.prefill_us, ev.decode_us,
                           fl.max_tokens, now, ev.cut)
        # The slot's whole cycle as this router sees it (publish -> done-event), not only the
        # node's service time: that is when the slot is free again, and what promises must be
        # spaced by. Not while our loop lags (it would measure the lag), nor from a 200 whose
        # done-event came after the request's answer-by: that one was held up on its way (its
        # node's server died: the event waited out the failover in the node's reconnect
        # buffer), not on the slot, and such a sample (seconds) would refuse every request
        # `deadline` for the window's age.
        if now - self._lagged_s > LAG_QUIET_S and now <= fl.answer_by_s:
            cycle_us = int((now - fl.placed_s) * 1e6)
            ms.window.add(cycle_us - ev.work_us, now)

    def _freed(self, fl: InFlight) -> None:
        self.requests.ended(fl, 0, 0, 0)  # the watchdog's answer is metered where it is given
        ms = self.models.get(fl.model)
        view = ms.slots.get(fl.key) if ms is not None else None
        if ms is not None and view is not None and view.request_id == fl.request_id:
            now = time.monotonic()
            view.release(now)
            self._slot_freed(ms, now)

    def _slot_freed(self, ms: ModelSlots, now: float) -> None:
        """A slot of `ms` is free: a parked holder woken, or the one it goes to called."""
        if (called := self.calls.freed(ms, now)) is not None:
            self._spawn(self.calls.call(called))

    async def _on_status(self, req: Any) -> None:
        body = {
            "router": self.cfg.router_id,
            # What it serves (`plane router --models`), and below what it knows of each.
            "serves": sorted(self.cfg.models) if self.cfg.models is not None else "all",
            "models": {
                m: {
                    "slots": len(ms.slots), "healthy": ms.healthy_count(),
                    "busy": ms.busy_count(time.monotonic()), "p50_overhead_us": ms.window.p50_us,
                    "p99_overhead_us": ms.window.p99_us,
                    # 0: the two above are the window's prior, not measured (`plane status`
                    # shows `-`): nothing placed lately, or ever.
                    "overhead_samples": ms.window.count,
                    **({"call_trip_p50_us": trips.p50_us, "call_trip_p99_us": trips.p99_us}
                       if (trips := self.admission.call_trips.get(m)) is not None
                       and trips.count else {}),
                    # How late holders start past their promised start, by how far ahead
                    # it was (`plane.router.slips`).
                    **({"start_slip_p99_us": counted}
                       if (slips := self.admission.slips.get(m)) is not None
                       and (counted := slips.summary(time.monotonic())) else {}),
                    **({"decode_ns_per_token_p50": ms.rates.decode.p50_us,
                        "prefill_ns_per_token_p50": ms.rates.prefill.p50_us,
                        "fill_per_mille_mean": ms.rates.fill.mean_us}
                       if ms.rates.decode.count else {}),
                }
                for m, ms in self.models.items()
            },
            "tickets": len(self.admission.tickets),
            "ticket_stats": dict(self.admission.stats),
            # The recent average of tickets redeemed over all callers (from 1; each caller's
            # own decides whether its promises pin slot time: `Admission.pins`), and the
            # tickets settled, counted (`plane.router.ticket_tally`).
            "redemption": self.admission.redemption,
            "ticket_returns": {m: t.as_dict() for m, t in self.admission.ticket_tally.items()},
            "inflight": len(self.inflight),
            # How long it has been behind on its inbox (`plane.router.inbox`; 0: it is not).
            "behind_ms": self.requests.behind_ms(),
        }
        await req.respond(json_encoder.encode(body))

    async def _on_answered_query(self, msg: Msg) -> None:
        """A node took a message of ours after its deadline: did we answer that attempt
        without the broker's word (`plane.contract.ownership`)?"""
        await reply_answered(self.nc, msg, self.inflight.answered_unsure.seen)

    async def _on_meter(self, req: Any) -> None:
        """Per tenant and model: requests by final status, slot µs, SM·ms (this router's)."""
        await req.respond(json_encoder.encode(
            {"router": self.cfg.router_id, "meter": self.requests.meter.readings()}))

    def _model(self, model: str) -> ModelSlots:
        ms = self.models.get(model)
        if ms is None:
            ms = self.models[model] = ModelSlots(model=model)
        return ms

    def nodes_gone(self, nodes: Iterable[str], why: str) -> None:
        """`nodes` are dead, known now rather than from their silence a second later (`plane
        up`'s router process whose `plane up` died: its nodes lived there). Their requests
        in flight are taken and answered here at once, and at the stop again those whose
        placement was on its way; the stop waits for those answers."""
        for node in nodes:
            self._gone[node] = why
            self._forget_node(node, why)

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

    async def _spread_leaders(self) -> None:
        """Now and then, the slot streams' leaders apart and each consumer led from its
        stream's (`plane.contract.slot_leaders`): after a failover moved leaders together,
        the next dead server would stop more slots than its share. The router that makes
        promises does it (two would step the same leader down twice)."""
        while True:
            if self.peers.leader() == self.cfg.router_id:
                with contextlib.suppress(Exception):
                    await keep_apart(self.nc, self.js, self.names)
            await asyncio.sleep(SPREAD_LEADERS_S)

    async def _watchdog(self) -> None:
        """Dead nodes (no heartbeat) and requests past their deadline with no done-event:
        the in-flight book takes their slot messages and answers 503 / 504. Its ticks are
        the loop's sign of life (`plane.router.stall`) while it runs."""
        try:
            await self._watch()
        finally:
            self.stalls.off()

    async def _watch(self) -> None:
        timeout_s = self.cfg.node_timeout_ms / 1000
        reconnects = self.nc.stats["reconnects"]
        last = time.monotonic()
        while not self._stopping:
            period = await self._pause()
            self.watchdog_ticks += 1
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
            if now - last > period + LOOP_LAG_S:
                self._lagged_s = now
            last = now
            behind = self._behind(now)
            for node, seen in list(self.node_seen_s.items()):
                # While behind, only a silence far past the timeout counts (a loop that lags
                # for good must still find a dead node).
                if now - seen > timeout_s * (BEHIND_PATIENCE if behind else 1):
                    self._forget_node(node, f"no heartbeat for {now - seen:.1f} s")
            # Promises no decision looked at lapse here too, only while no request waits to
            # be read or decided (a holder's promise is spared at its decision, however late
            # the router gets to it), and only TIDY_GRACE_S after their time (a holder's retry
            # forwarded from another router is on its way meanwhile).
            idle = not self._backlog() and not self.requests.in_hand()
            for ms in self.models.values():
                ms.window.expire(now)
                ms.rates.expire(now)
                if idle:
                    self.admission.tidy(ms, now - TIDY_GRACE_S)
                self.metrics.promises_open.labels(ms.model).set(len(ms.promises))
                self.metrics.promise_depth.labels(ms.model).set(self.admission.depth(ms, now))
            await self.peers.tell()  # what the tick dropped (none: returns at once)
            for then in self.publisher.expire(now):
                self._spawn(then(TimedOut()))
            self.inflight.tick(now)
            self.flood_memory.observe(self.requests.in_hand() + self._backlog(), now)
            await self.peers.announce_if_due(now)

    def _watching(self) -> bool:
        """Whether anything needs the watchdog's short period: a placement awaiting its
        PubAck or its done-event, a request in hand or unread, a holder parked, a promise
        open."""
        return bool(self.requests.in_hand() or self.inflight.entries or self._backlog()
                    or any(len(ms.promises) or self.parking.waiting(m)
                           for m, ms in self.models.items()))

    async def _pause(self) -> float:
        """Sleep one watchdog period, the short one while anything is watched, else the idle
        one, which `_rouse_watchdog` cuts short; the period slept for."""
        period = WATCHDOG_PERIOD_S if self._watching() else IDLE_WATCHDOG_PERIOD_S
        self.stalls.sleeping(time.monotonic(), period)
        if period == WATCHDOG_PERIOD_S:
            await asyncio.sleep(period)
        else:
            await self._doze.sleep(period)
        self.stalls.woke(time.monotonic())
        return period

    def _rouse_watchdog(self) -> None:
        """A slot publish after an idle spell: its deadline is watched from now."""
        self._doze.wake()

    def _behind(self, now_s: float) -> bool:
        """Whether this router may not have read the heartbeats that were sent to it: its loop
        lagged just now, or heartbeats wait unread in the subscription."""
        pending = self._health_sub.pending_msgs if self._health_sub is not None else 0
        return pending > 0 or now_s - self._lagged_s < WATCHDOG_PERIOD_S * 5

    async def _reprovision(self) -> None:
        """After a reconnect (a broker restart loses memory streams) or a publish that found
        no slot stream: provision again, in its own task so the watchdog keeps running while
        there is no JetStream leader (one run at a time: `Reprovisioner`)."""
        await self._reprovisioner.again()

    async def _node_answered(self, fl: InFlight, asked: str, patient: bool) -> bool | None:
        """True only when the node says it answered that placement (or attempt); a live node
        is asked patiently (our own server may be failing over), until its heartbeats lapse
        (then it is dead: asked patiently on, a request on a node killed at its deadline was
        answered 2 s late, found from outside), a dead one once. One whose heartbeats are
        overdue is not asked (it cannot say now), nor asked again once the server says
        nobody listens for it, unless it may be failing over (`_nobody_is_gone`)."""
        if patient and self._cannot_say(fl.node):
            log.info("node silent past its heartbeats: answering for it at once",
                     request_id=fl.request_id, node=fl.node)
            return None
        return await ask_answered(self.nc, self.names.node_answered(fl.node), asked,
                                  timeout_s=ASK_NODE_TIMEOUT_S,
                                  within_s=ASK_NODE_WITHIN_S if patient else 0.0,
                                  gone=partial(self._cannot_say, fl.node),
                                  instance=fl.instance, nobody_is_gone=self._nobody_is_gone)

    def _cannot_say(self, node: str) -> bool:
        """Whether `node` can say nothing now of what it answered: dead (forgotten), or its
        heartbeats overdue while our connection and loop were up to hear them."""
        seen = self.node_seen_s.get(node)
        if seen is None:
            return True
        now = time.monotonic()
        return now - seen > self._overdue_s and self._steady(now) and not self._behind(now)

    def _steady(self, now_s: float) -> bool:
        """Our own connection is up, and has been long enough to hear every node's
        heartbeats: its reconnect is no reason for a node's silence."""
        return self.nc.is_connected and now_s - connected_since_s(self.nc) > self._overdue_s

    def _nobody_is_gone(self) -> bool:
        """Whether a no-responders reply to a node's question means the node is gone (its
        connection closed: killed, or exited) rather than on its way back: on one server with
        our own connection steady. With more servers known, a node whose server died is
        unreachable while it fails over to another (it may have answered, its ack lost with
        the server): it is asked on, until its heartbeats are overdue."""
        return len(self.nc.servers) <= 1 and self._steady(time.monotonic())

    async def _answer_for_node(self, fl: InFlight, status: Status, reason: Reason,
                               text: str) -> None:
        body, headers = replies.error_reply(fl.request_id, status, reason, text, node=fl.node)
        self.metrics.watchdog_answers.labels(fl.model, str(int(status))).inc()
        self.metrics.router_requests.labels(fl.model, str(int(status))).inc()
        self.requests.meter.answered(fl.tenant, fl.model, int(status))
        await self.nc.publish(fl.reply, body, headers=headers)
        log.warning("router answered for node", request_id=fl.request_id, node=fl.node,
                    status=int(status))

    def _gauge_slots(self) -> None:
        for m, ms in self.models.items():
            self.metrics.slots_known.labels(m, "healthy").set(ms.healthy_count())
            self.metrics.slots_known.labels(m, "busy").set(ms.busy_count(time.monotonic()))

    def _backlog(self) -> int:
        """Requests delivered to us and not read yet."""
        return sum(s.pending_msgs for s in self._request_subs)
