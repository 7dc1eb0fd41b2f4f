"""A GPU node: claims N slots for one model, advertises them, keeps them healthy, follows
live settings, and shuts down in phases.

Shutdown: tell routers we are stopping (heartbeats `stopping`, sent on through the drain, so
they place nothing more here but leave what runs to us), stop fetching, let running requests
finish within `drain_timeout_s` (answering 503 for any still running), answer what landed
unfetched, flush, close. While draining, every answer first takes its message through the
broker (`plane.contract.ownership`), so it is the only one even if a router acted too.

Identity: one process serves a node id. A node refuses to start while another live process
serves its id, waits for one that is stopping, and stands down when a process with its id
started after it (see `plane.contract.identity`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.service import Service

from gpu_node.compute import Backend, make_backend
from gpu_node.done_batch import DoneBatch
from gpu_node.faults import WatchedRunner
from gpu_node.generation import generation_for
from gpu_node.health import Supervisor
from gpu_node.partitions import NONE
from gpu_node.retiring import Retirements
from gpu_node.slot import INLINE_WORK_US_CPU, Enrich, Slot
from gpu_node.standing import Other, Standing
from gpu_node.streaming import StreamControl
from gpu_node.telemetry import GpuTelemetry, make_telemetry, partition_sms
from plane.contract import replies
from plane.contract.config import GPU_GIL_SWITCH_US, NodeConfig
from plane.contract.identity import ensure_node_id_free
from plane.contract.lifecycle import Lifecycle, TaskOwner
from plane.contract.messages import (
    Heartbeat,
    NodeAdvert,
    SlotAdvert,
    fault_decoder,
    heartbeat_decoder,
    json_encoder,
)
from plane.contract.metrics import PlaneMetrics
from plane.contract.models import model_spec
from plane.contract.ownership import reply_answered
from plane.contract.provision import (
    ProvisionPlan,
    Reprovisioner,
    at_start,
    ensure_all_at_start,
)
from plane.contract.recent import RecentIds
from plane.contract.settings import MAX_SLOTS, LiveSettings, refused
from plane.contract.soon_flush import use_soon_flush
from plane.contract.subjects import advert_key, config_key
from plane.contract.tracing import Tracing

log = structlog.get_logger("plane.node")

# A process with this id that is stopping may still drain for its drain timeout plus this.
STOPPING_GRACE_S = 5.0
# A slot a resize removed serves on this long (`gpu_node.retiring`), at least this many
# heartbeat periods: a router places nothing more on it once it hears one, and one that
# hears none for a second gives the whole node up.
RETIRE_LINGER_S = 1.0
RETIRE_LINGER_HEARTBEATS = 4


def hand_gil_on(switch_us: int) -> None:
    """This process's GIL switch interval (`NodeConfig.gil_switch_us`; 0 leaves Python's
    own). A setting of the whole process: its nodes ask for the same (`plane up`'s share a
    backend)."""
    if switch_us > 0:
        sys.setswitchinterval(switch_us / 1e6)


class Node(Lifecycle, TaskOwner):
    def __init__(
        self, nc: Client, cfg: NodeConfig, metrics: PlaneMetrics | None = None, *,
        backend: Backend | None = None, enrich: Enrich | None = None, replicas: int = 1,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__()
        # Written as the plane's own connections are (a borrowed one too): then the flush in
        # `start` is a barrier for what was sent before it (nats-py's own PING overtakes it).
        use_soon_flush(nc)
        self.nc = nc
        self.cfg = cfg
        self.names = cfg.names
        self.metrics = metrics or PlaneMetrics()
        self.js = nc.jetstream(timeout=5.0)
        self.spec = model_spec(cfg.model)
        self.backend = backend or make_backend(cfg.backend, seed=cfg.seed,
                                               sms_per_slot=cfg.sms_per_slot)
        # tinylm: one model per process (each slot gets its own state), built once here.
        self.generation = generation_for(self.spec, self.backend, cfg.seed)
        self.streams = StreamControl(nc, cfg.names, cfg.node_id, lambda: self.slots)
        self.enrich = enrich
        self.tracing = tracing or Tracing.off()
        self.settings = LiveSettings(cfg.names)
        self.slots: list[Slot] = []
        # Slots a resize removed, serving on for a moment (routers may not have heard yet).
        self.retiring = Retirements(
            linger_s=max(RETIRE_LINGER_S, RETIRE_LINGER_HEARTBEATS * cfg.heartbeat_period_s),
            wait_s=cfg.drain_timeout_s)
        self._resizing = asyncio.Lock()  # one reconcile at a time (settings change quickly)
        self.answered = RecentIds()
        # Its slots' done-events of a loop turn, as one message ahead of their answers.
        self.dones = DoneBatch(nc, cfg.names, self.spec.name, cfg.node_id)
        self._plan = ProvisionPlan(names=cfg.names, replicas=replicas,
                                   advert_ttl_s=cfg.advert_ttl_s)
        self._reprovisioner = Reprovisioner(self.js, self._plan, who=cfg.node_id)
        self._service: Service | None = None
        self._fault_sub: Any = None
        self._answered_sub: Any = None
        self._supervisor: Supervisor | None = None
        self._nodes_kv: Any = None
        self._started = False
        self._stopping = False
        self._publish_pending = False
        self.standing = Standing(period_s=cfg.heartbeat_period_s)  # instance, replaced?
        self._own_sub: Any = None
        self._older_logged_s = -math.inf
        self._telemetry: GpuTelemetry | None = None

    @property
    def slot_limit(self) -> int:
        """The most slots a live setting may ask of this node: four per partition its backend
        makes by default (a CPU: 2 slots, one thread each, so 8; a GPU: its SMs over the
        smallest partition), at least what it was started with, at most the settings' cap.
        Each slot is a JetStream consumer, a thread and its buffers; past a few per partition
        they only queue for the same cores or SMs (`slots.<node>=300` on a CPU started 300
        consumers and 302 threads)."""
        return min(MAX_SLOTS, max(4 * self.backend.default_slots(), self.cfg.slots or 0))

    def default_slots(self) -> int:
        """The backend's count, except for a generation on a CPU: its steps keep a core busy
        the whole stream, so one slot per core the node's loop, the broker and the router do
        not need. Measured with tinylm on a 2-core box (`plane pulse --stream --capacity-x 2`):
        2 slots 34 streams/s at 0.76 ms a token, 1 slot 49 streams/s at 0.28 ms. On a
        partitioned device that this process's other nodes share, its share of the
        partitions (`NodeConfig.device_share`)."""
        slots = self.backend.default_slots()
        if self.partitioned:
            slots = max(1, slots // self.cfg.device_share)
        if self.generation is not None and self.generation.lm.device.type == "cpu":
            slots = max(1, min(slots, (os.cpu_count() or 2) - 1))
        return slots

    def gil_switch_us(self) -> int:
        """`NodeConfig.gil_switch_us`, or the backend's: GPU_GIL_SWITCH_US on a partitioned
        device, 0 (Python's own) on a CPU."""
        if self.cfg.gil_switch_us is not None:
            return self.cfg.gil_switch_us
        return GPU_GIL_SWITCH_US if self.partitioned else 0

    @property
    def partitioned(self) -> bool:
        """The backend cuts the device into partitions (a GPU's SMs), not a CPU's threads."""
        return self.backend.partition != NONE

    @property
    def target_slots(self) -> int:
        live = self.settings.get("slots", self.cfg.node_id)
        configured = self.cfg.slots or self.default_slots()
        if live is None:
            return configured
        if live <= self.slot_limit:
            return live
        refused(config_key("slots", self.cfg.node_id), str(live), 1, self.slot_limit,
                f"more than the {self.backend.name} backend runs well")
        return len(self.slots) or configured  # keep what runs

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        await ensure_node_id_free(
            self.nc, self.names, self.cfg.node_id, period_s=self.cfg.heartbeat_period_s,
            stopping_wait_s=self.cfg.drain_timeout_s + STOPPING_GRACE_S)
        self._started = True
        hand_gil_on(self.gil_switch_us())
        self._nodes_kv, config_kv = await ensure_all_at_start(self.js, self._plan, who="node")
        await self.settings.start(config_kv)
        self._own_sub = await self.nc.subscribe(self.names.health(self.cfg.node_id),
                                                cb=self._on_own_heartbeat)
        # Routers hear of this process before any of its slots fetches (standing.SETTLE_S).
        await self._send_heartbeat()
        await self.nc.flush()
        if self.generation is not None:
            await self.streams.start()  # before any slot can run a stream
        await self._reconcile_slots()
        self._supervisor = Supervisor(
            slots=lambda: list(self.slots), metrics=self.metrics,
            period_s=lambda: (self.settings.get("probe_ms") or self.cfg.probe_period_ms) / 1000,
            misses=self.cfg.probe_misses, budget_us=self._budget_us, changed=self.changed,
        )
        self._spawn(self._supervisor.run())
        self._spawn(self._heartbeat_loop())
        self._telemetry = await asyncio.to_thread(  # nvmlInit blocks
            make_telemetry, self.backend, self.metrics, node=self.cfg.node_id,
            period_s=self.cfg.gpu_sample_period_s)
        if self._telemetry is not None:
            await self._telemetry.start()
        self.settings.on_change(self._on_setting)
        self._answered_sub = await self.nc.subscribe(
            self.names.node_answered(self.cfg.node_id), cb=self._on_answered_query)
        if self.cfg.allow_faults:
            self._fault_sub = await self.nc.subscribe(self.names.fault(self.cfg.node_id),
                                                      cb=self._on_fault)
        self._service = await add_service(
            self.nc, name=self.names.node_service, version="0.1.0",
            description="the plane's GPU node: depth-one slots",
            metadata={"node": self.cfg.node_id, "model": self.cfg.model,
                      "backend": self.backend.name, "partition": self.backend.partition},
        )
        await self._service.add_endpoint(
            name="status", subject=self.names.node_status(self.cfg.node_id),
            handler=self._on_status)
        await self.publish_advert()
        decode = {"decode": gen.decode_path} if self.slots and (
            gen := self.slots[-1].generator) is not None else {}
        log.info("node started", node=self.cfg.node_id, model=self.cfg.model,
                 backend=self.backend.name, partition=self.backend.partition,
                 slots=len(self.slots), choice=self.backend.describe(len(self.slots)), **decode,
                 gil_switch_us=round(sys.getswitchinterval() * 1e6))  # the process's now

    async def stop(self) -> None:
        if not self._started or self._stopping:
            return
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.stop()
        with contextlib.suppress(Exception):
            await self._send_heartbeat()  # stopping; the heartbeat loop goes on saying so
            await self.nc.flush(timeout=2)
        await asyncio.gather(self.retiring.end_all(sweep=not self.standing.superseded),
                             *(s.withdraw("shutdown", wait_s=self.cfg.drain_timeout_s)
                               for s in self.slots), return_exceptions=True)
        if self.nc.is_connected and not self.standing.superseded:
            await asyncio.gather(*(s.sweep("the node stopped") for s in self.slots),
                                 return_exceptions=True)
        # Else the key is the process's that replaced us; and with the connection down the
        # delete would wait out JetStream's 5 s timeout to no end (its advert's TTL ends it).
        if not self.standing.superseded and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self._nodes_kv.delete(advert_key(self.cfg.node_id, self.cfg.model))
        # Gone from the status endpoint before the heartbeats stop: a process starting with
        # this id waits while the endpoint answers (plane.contract.identity), and finds the id
        # clean.
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        if self._telemetry is not None:
            await self._telemetry.stop()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Routers ask whether we answered a placement until our drain is over: last to go.
        for sub in (self._fault_sub, self._own_sub, self._answered_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        await self.streams.stop()
        await self.settings.stop()
        for s in self.slots:
            await s.close()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)
        log.info("node stopped", node=self.cfg.node_id)

    # -- slots ------------------------------------------------------------------------------
    def _inline_work_us(self) -> int:
        """`NodeConfig.inline_work_us`, or the backend's: on a CPU only."""
        if self.cfg.inline_work_us is not None:
            return self.cfg.inline_work_us
        return 0 if self.partitioned else INLINE_WORK_US_CPU

    async def _reconcile_slots(self) -> None:
        async with self._resizing:
            await self._reconcile_slots_now()

    async def _reconcile_slots_now(self) -> None:
        """As many slots as `target_slots`. A slot removed leaves the adverts at once and
        serves on for a moment (`gpu_node.retiring`): a router that placed on it before it
        heard of the removal is answered by the slot, not by its own 504 at the deadline."""
        want = self.target_slots
        while len(self.slots) < want:
            k = len(self.slots)
            kept = await self.retiring.take_back(k)
            if kept is not None:  # removed a moment ago and still serving: as it is
                self.slots.append(kept)
                log.info("removed slot taken back", node=self.cfg.node_id, slot=k)
                continue
            runner = self.backend.make_slot(self.cfg.first_partition + k)
            generator = None
            if self.generation is not None:  # its state and warm-up, off the event loop
                generator = await asyncio.to_thread(self.generation.make_slot,
                                                    runner.lane_context)
            slot = Slot(
                k=k, runner=WatchedRunner(runner), nc=self.nc, js=self.js,
                names=self.names, node=self.cfg.node_id, spec=self.spec,
                metrics=self.metrics,
                pull_expiry_s=self.cfg.pull_expiry_s, inline_work_us=self._inline_work_us(),
                device_waits=self.cfg.device_waits == "loop",
                enrich=self.enrich,
                answered=self.answered, must_take=self.must_take,
                presumed_gone=self.presumed_gone,
                sms=partition_sms(self.backend), tracing=self.tracing,
                generator=generator, stream_reply=self.streams.reply_subject(k),
                changed=self.changed, dones=self.dones,
            )
            self.slots.append(slot)
            # Its consumer is made through JetStream's meta leader: a cluster electing one
            # (a server just died) does not answer for seconds.
            await at_start(slot.claim, who="node", what=f"claiming slot {k}")
        while len(self.slots) > want:
            self.retiring.retire(self.slots.pop())
        self.changed()  # routers hear of it now: the slots removed serve on meanwhile

    def _budget_us(self) -> int:
        ms = self.settings.deadline_or_default(self.cfg.model, self.cfg.default_deadline_ms)
        return ms * 1000

    def _on_setting(self, key: str, value: int | None) -> None:
        if key == config_key("slots", self.cfg.node_id) and not self._stopping:
            self._spawn(self._reconcile_slots())

    async def _on_fault(self, msg: Msg) -> None:
        try:
            cmd = fault_decoder.decode(msg.data)
            self.slots[cmd.k].runner.set_fault(cmd.mode, cmd.extra_us)
            answer = b"ok"
        except Exception as exc:
            answer = f"error: {exc}".encode()
        log.warning("fault injected", node=self.cfg.node_id, answer=answer.decode())
        if msg.reply:
            await self.nc.publish(msg.reply, answer)

    async def _on_answered_query(self, msg: Msg) -> None:
        await reply_answered(self.nc, msg, self.answered.seen, self.standing.instance)

    async def _on_status(self, req: Any) -> None:
        """The advert, plus what `plane status` and `plane top` show: which slots run a
        request now, and the device's last NVML reading (absent without one)."""
        body = msgspec.to_builtins(self.advert())
        body["busy"] = [s.current is not None for s in self.slots]
        if self.generation is not None:
            body["streams"] = {"cancelled": self.streams.cancelled,
                               "readers_gone": self.streams.readers_gone,
                               "cancels_refused": self.streams.refused}
        if self._telemetry is not None and self._telemetry.last is not None:
            body["gpu"] = msgspec.to_builtins(self._telemetry.last)
        await req.respond(json_encoder.encode(body))

    # -- adverts ----------------------------------------------------------------------------
    def advert(self) -> NodeAdvert:
        return NodeAdvert(
            node=self.cfg.node_id, model=self.cfg.model, backend=self.backend.name,
            partition=self.backend.partition, at_ms=replies.now_ms(),
            slots=[
                SlotAdvert(
                    k=s.k, subject=s.subject, stream=s.stream,
                    healthy=s.claimed and s.healthy and s.withdrawn_for is None and s.reaches,
                    p50_us=s.window.p50_us, p99_us=s.window.p99_us,
                )
                for s in self.slots
            ],
        )

    def changed(self) -> None:
        """Something routers must know changed: publish adverts now (coalesced)."""
        if self._publish_pending or self._stopping or self.standing.superseded:
            return
        self._publish_pending = True
        self._spawn(self._publish_now())

    async def _publish_now(self) -> None:
        self._publish_pending = False
        await self._send_heartbeat()
        await self.publish_advert()

    async def publish_advert(self) -> None:
        with contextlib.suppress(Exception):
            await self._nodes_kv.put(advert_key(self.cfg.node_id, self.cfg.model),
                                     json_encoder.encode(self.advert()))

    async def _send_heartbeat(self) -> None:
        st = self.standing
        stopping = self._stopping or st.superseded
        hb = Heartbeat(node=self.cfg.node_id, at_ms=replies.now_ms(),
                       adverts=[] if stopping else [self.advert()], stopping=stopping,
                       instance=st.instance, started_ms=st.started_ms)
        await self.nc.publish(self.names.health(self.cfg.node_id), json_encoder.encode(hb))
        st.heartbeat(time.monotonic())

    def must_take(self, fetched_s: float) -> bool:
        """Whether a router may already have acted on a request this node fetched at
        `fetched_s` (monotonic), so that its answer must take the message through the broker
        rather than ack it: while draining, or as `Standing.must_take` says."""
        return self._stopping or self.presumed_gone(fetched_s)

    def presumed_gone(self, fetched_s: float) -> bool:
        """Whether a router may have taken this node for gone (and acted on a request it
        fetched at `fetched_s` before its deadline), as `Standing.must_take` says."""
        return self.standing.must_take(fetched_s, time.monotonic())

    async def _on_own_heartbeat(self, msg: Msg) -> None:
        """A heartbeat on our own subject from another process with our id. The one started
        later serves the id (routers listen to it alone); this one, if older, stands down."""
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self.standing.superseded or self._stopping:
            return
        other = self.standing.heard(hb)
        if other is Other.OLDER and time.monotonic() - self._older_logged_s >= 10.0:
            self._older_logged_s = time.monotonic()
            log.error("another process has this node id (it started earlier and will stand "
                      "down); give each node a distinct --node-id", node=self.cfg.node_id,
                      other_instance=hb.instance)
        if other is not Other.NEWER:
            return
        log.error("a process with this node id started after this one: it serves the id now "
                  "and this one stands down; give each node a distinct --node-id",
                  node=self.cfg.node_id, other_instance=hb.instance)
        self._spawn(self._stand_down())

    async def _stand_down(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
        with contextlib.suppress(Exception):
            await self._send_heartbeat()
        await asyncio.gather(self.retiring.end_all(sweep=False),
                             *(s.withdraw("superseded", wait_s=self.cfg.drain_timeout_s)
                               for s in self.slots), return_exceptions=True)

    async def _heartbeat_loop(self) -> None:
        """Until stop() cancels it after the drain: routers must hear a draining node too."""
        ticks = 0
        per_advert = max(1, round(self.cfg.advert_period_s / self.cfg.heartbeat_period_s))
        reconnects = self.nc.stats["reconnects"]
        while True:
            live = not (self._stopping or self.standing.superseded)
            if (live and self.nc.stats["reconnects"] != reconnects
                    and self.nc.is_connected):
                reconnects = self.nc.stats["reconnects"]
                self._spawn(self._after_reconnect())  # heartbeats go on meanwhile
            with contextlib.suppress(Exception):
                await self._send_heartbeat()
                if live and ticks % per_advert == 0:
                    await self.publish_advert()
            ticks += 1
            await asyncio.sleep(self.cfg.heartbeat_period_s)

    async def _after_reconnect(self) -> None:
        """A broker restart may have lost the memory-stored slot stream, our consumers and
        adverts: provision again, and re-claim the slots whose consumer is gone (in a
        cluster the replicated stream and consumers survive a reconnect: keep those)."""
        log.warning("reconnected: checking stream and consumers", node=self.cfg.node_id)
        for slot in self.slots:
            slot.renew_pull()  # a restarted or failed-over broker keeps no waiting pulls
        self._nodes_kv = await self._reprovisioner.again() or self._nodes_kv
        for slot in self.slots:
            if slot.claimed and not await slot.consumer_alive():
                log.warning("consumer lost: re-claiming slot", slot=slot.k)
                await slot.reclaim("reconnect")
        self.changed()
