"""One slot: a share of the device (an SM partition on CUDA) that owns one depth-one subject.

The slot claims its subject with a pull consumer (`max_ack_pending=1`) and one standing pull
request (gpu_node/pull.py). Device work it launches on the event loop and awaits there
(gpu_node/device_wait.py: no thread hop); compute on the CPU runs on its own thread
(gpu_node/slot_thread.py), or on the event loop while its calls are known shorter than the hop
to that thread and back (`Slot._call`, `NodeConfig.inline_work_us`: a CPU's only, by
default). Then it acks (which frees
the subject), publishes the done-event and answers the caller, in that order, so the slot is
free before the caller hears back. When a router may
already have acted on the request (past its deadline, disconnected, or whenever the node says
so: draining, replaced, heartbeats lapsed), the slot takes the message through the API instead
and answers only if the take succeeds (`plane.contract.ownership`). A message left on the
subject unfetched (an earlier life of the slot, a process it replaced) is never purged unseen:
it is taken and answered 503 the same way.

A `tinylm` request that asks to stream (`Plane-Stream: 1`) keeps its message unacked for the
whole stream: `start`, tokens as the generation thread makes them, then the final `end`,
answered by the same rule with the stream deadline in place of the deadline
(gpu_node/streaming.py, docs/design.md "Streams").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from gpu_node.current import Current
from gpu_node.device_wait import CALIBRATED, RISK, DeviceWork, LoopTimer, finished
from gpu_node.done_batch import DoneBatch
from gpu_node.faults import WatchedRunner
from gpu_node.generation import GenResult, SlotGenerator
from gpu_node.pull import StandingPull
from gpu_node.slot_generation import Generating
from gpu_node.slot_thread import SlotThread
from gpu_node.streaming import StreamMeters, StreamRun
from plane.contract import replies, streams
from plane.contract.budget import ServiceWindow
from plane.contract.canonical import CanonicalLog
from plane.contract.errors import BadRequest
from plane.contract.lifecycle import cancel_and_wait
from plane.contract.messages import (
    CUT_SHORT,
    CalibratedReply,
    CalibratedRequest,
    DoneEvent,
    Reason,
    RiskReply,
    Status,
    StreamFinish,
    TinyLMRequest,
    error_body,
    json_encoder,
    msgpack_encoder,
)
from plane.contract.metrics import Children, PlaneMetrics
from plane.contract.models import ModelSpec
from plane.contract.ownership import (
    NOT_ANSWERED,
    Take,
    ask_answered,
    attempt_id,
    placement_id,
    stream_sequence,
    take,
)
from plane.contract.provision import stream_of_subject
from plane.contract.publish import command
from plane.contract.recent import RecentIds
from plane.contract.subjects import Header, InvalidToken, Names, check_token
from plane.contract.tracing import Tracing, trace_headers

MustTake = Callable[[float], bool]  # fetched at (monotonic s) -> may a router have acted on it?

log = structlog.get_logger("plane.slot")
T = TypeVar("T")

# Consumers outlive a short network blip but not a dead node.
CONSUMER_INACTIVE_S = 30.0
# Longer than any request may run (calibrated is capped at 10 s): the node acks or terms
# every message itself; an unacked one is only ever an orphan, freed by its TTL. A stream
# may run longer (up to its stream deadline): it says "in progress" every EXTEND_ACK_S.
ACK_WAIT_S = 30.0
# Depth one leaves at most one message on a subject; in a cluster a few more have been seen
# (nats-server #6245): a sweep takes at most this many.
SWEEP_MAX = 4
# A slot whose consumer does not take its pulls is looked at this often: made again if the
# broker says it is gone (deleted, or lost with a restarted broker), else waited for (a
# cluster electing its leader).
UNREACHED_CHECK_S = 1.0
# A node that took a message after its deadline asks its router whether it answered it
# already (`_router_answered`): each try this long, for at most this long in all (its router
# may be failing over with the broker).
ASK_ROUTER_TIMEOUT_S = 0.25
ASK_ROUTER_WITHIN_S = 1.0
# Calls in a row within `inline_work_us` before a slot runs its calls on the event loop.
INLINE_AFTER = 32
# `NodeConfig.inline_work_us` on a CPU backend when none is set (a GPU's: 0).
INLINE_WORK_US_CPU = 50


Enrich = Callable[[Any, float], Awaitable[tuple[Any, dict[str, str]]]]
Answer = tuple[str, bytes, Mapping[str, str] | bytes]  # reply subject, body, headers


class Slot(Generating):
    def __init__(
        self, *, k: int, runner: WatchedRunner, nc: Client, js: JetStreamContext, names: Names,
        node: str, spec: ModelSpec, metrics: PlaneMetrics, pull_expiry_s: float,
        inline_work_us: int = 0, device_waits: bool = True, enrich: Enrich | None = None,
        answered: RecentIds | None = None,
        must_take: MustTake | None = None, presumed_gone: MustTake | None = None,
        sms: int = 0, tracing: Tracing | None = None,
        generator: SlotGenerator | None = None, stream_reply: str = "",
        changed: Callable[[], None] | None = None, dones: DoneBatch,
    ) -> None:
        self.k = k
        self.runner = runner
        self.nc, self.js, self.names, self.node, self.spec = nc, js, names, node, spec
        self.model = spec.name
        self.subject = names.slot(self.model, node, k)
        self.consumer = names.slot_consumer(self.model, node, k)
        self.done_subject = names.done(self.model, node, k)
        self.dones = dones  # the node's done-events of a loop turn, as one message
        self.stream = ""  # the slot stream that holds our subject: the broker says (claim)
        self.metrics = metrics
        self.pull_expiry_s = pull_expiry_s
        self.inline_work_us = inline_work_us
        self._short_calls = 0  # calls in a row that took at most inline_work_us (`_call`)
        self.device_waits = device_waits  # device work awaited on the loop (`_waits_on_loop`)
        self._timer = LoopTimer()  # those waits' timer (`gpu_node.device_wait`)
        self.enrich = enrich
        self.answered = answered if answered is not None else RecentIds()
        self.must_take = must_take or (lambda fetched_s: False)
        # Whether a router may have taken us for gone (acting before the deadline): not
        # merely because we drain (`must_take` is true then too).
        self.presumed_gone = presumed_gone or self.must_take
        self.tracing = tracing or Tracing.off()
        self.generator = generator  # tinylm: this slot's generation state
        self.stream_reply = stream_reply  # stream messages' reply subject (see streaming.py)
        self._changed = changed or (lambda: None)  # what routers must hear: adverts now
        # Label children only where streams run: no zero series for other models.
        self.stream_meters = StreamMeters(metrics, spec.name) if generator is not None else None
        self.thread = SlotThread(f"slot-{self.model}-{k}",
                                 idle=generator.keep_warm if generator is not None else None,
                                 on_start=runner.bind_thread)
        self.window = ServiceWindow(prior_us=200)  # request overhead beyond requested work
        self.probe_window = ServiceWindow(size=16, prior_us=200)
        self.healthy = True
        self.failures = 0  # requests that raised on this slot, ever
        self.withdrawn_for: str | None = None  # None while claimed
        self.current: Current | None = None
        self._task: asyncio.Task[None] | None = None
        self._pull: StandingPull | None = None  # while claimed
        self._unreached: asyncio.Task[None] | None = None  # `_reclaim_if_lost`, while running
        self._claimed = False
        self._label = (self.model, node, str(k))
        # Metric children resolved once: the per-request path does no label lookups.
        self._busy = metrics.slot_busy.labels(*self._label)
        self._service = metrics.service_seconds.labels(self.model, node)
        self._answered = Children(metrics.node_requests)  # by status
        # Busy time, and busy time x the partition's SMs (`sms`: 0 on a CPU, no SM-seconds).
        self._busy_s = metrics.slot_busy_seconds.labels(*self._label)
        self._sm_s = metrics.slot_sm_seconds.labels(*self._label) if sms > 0 else None
        self.sms = sms
        self.canonical = CanonicalLog("plane.node.requests")

    # -- claim / withdraw -------------------------------------------------------------------
    @property
    def claimed(self) -> bool:
        return self._claimed

    @property
    def reaches(self) -> bool:
        """Whether its consumer takes its pulls (`StandingPull.reaches`): advertised healthy
        only then, so routers place nothing where nothing fetches (a cluster electing the
        consumer's leader)."""
        return self._pull is None or self._pull.reaches

    def _pull_reaches(self, ok: bool) -> None:
        connected = self.nc.is_connected
        if ok:
            log.warning("slot consumer answers again", model=self.model, slot=self.k,
                        stream=self.stream)
        else:
            log.warning("slot consumer unreachable", model=self.model, slot=self.k,
                        stream=self.stream, why="the broker ended its pull" if connected
                        else "the NATS connection is down")
        self.metrics.slot_healthy.labels(*self._label).set(int(ok and self._claimed))
        self._changed()
        # Connection down: the broker cannot be asked whether the consumer is gone; once it
        # is back, the node checks every slot's consumer (`Node._after_reconnect`).
        if not ok and connected and (self._unreached is None or self._unreached.done()):
            self._unreached = asyncio.create_task(self._reclaim_if_lost(),
                                                  name=f"unreached-{self.model}-{self.k}")

    async def _reclaim_if_lost(self) -> None:
        """While the consumer does not take our pulls: if the broker says it is gone, claim
        the slot again (a fresh consumer); if it cannot say, or it exists (no leader yet),
        wait: the pull's renewals find it when it answers."""
        while self._claimed and not self.reaches:
            await asyncio.sleep(UNREACHED_CHECK_S)
            if not self._claimed or self.reaches or await self.consumer_alive():
                continue
            log.warning("consumer lost: re-claiming slot", slot=self.k)
            await self.withdraw("consumer-lost", wait_s=1.0)
            await self._claim_until_taken()
            return

    async def reclaim(self, cause: str) -> None:
        """Withdraw for `cause` (a reconnect that lost the consumer), then claim again until
        the broker takes the claim, as the slot's own task (`_claim_until_taken`): returns
        once that task has begun. A claim that failed once used to leave the slot withdrawn
        for good."""
        await self.withdraw(cause, wait_s=1.0)  # (cancels a comeback already under way)
        self._unreached = asyncio.create_task(self._claim_until_taken(),
                                              name=f"reclaim-{self.model}-{self.k}")

    async def _claim_until_taken(self) -> None:
        """Claim, asked again every `UNREACHED_CHECK_S` while the broker cannot take it (a
        cluster electing a leader, a restarted server loading: timeouts for seconds). Runs as
        `_unreached`: a withdrawal for another cause, or `close`, cancels it."""
        while not self._claimed:
            try:
                await self.claim()
            except Exception as exc:
                log.warning("slot not claimed: trying again", slot=self.k, error=repr(exc))
                await asyncio.sleep(UNREACHED_CHECK_S)
        self._changed()

    async def claim(self) -> None:
        """Take the subject: answer whatever an earlier life left on it (see `sweep`), bind a
        fresh consumer, and start fetching."""
        if self._claimed:
            return
        self.stream = await stream_of_subject(self.js, self.subject)
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(self.stream, self.consumer)
        await self.sweep("left by an earlier process of this slot")
        await self.js.add_consumer(self.stream, ConsumerConfig(
            durable_name=self.consumer, filter_subject=self.subject,
            ack_policy=AckPolicy.EXPLICIT, max_ack_pending=1, ack_wait=ACK_WAIT_S,
            inactive_threshold=CONSUMER_INACTIVE_S, mem_storage=True, max_waiting=4,
        ))
        pull = StandingPull(self.nc, self.stream, self.consumer, expires_s=self.pull_expiry_s,
                            on_reach=self._pull_reaches,
                            on_silent=self.metrics.pull_silences.labels(*self._label).inc)
        await pull.start()
        self._pull = pull
        self._claimed = True
        self.withdrawn_for = None
        self._task = asyncio.create_task(self._loop(pull), name=f"slot-{self.model}-{self.k}")
        self.metrics.slot_healthy.labels(*self._label).set(1)

    async def withdraw(self, cause: str, *, wait_s: float = 0.0) -> None:
        """Stop claiming. A request running now is finished (within `wait_s`) or answered 503;
        one the standing pull delivered and the slot did not start is answered 503 too."""
        if self._unreached is not None and self._unreached is not asyncio.current_task():
            await cancel_and_wait(self._unreached)  # another cause owns the slot's comeback
        if not self._claimed:
            self.withdrawn_for = self.withdrawn_for or cause
            return
        self._claimed = False
        self.withdrawn_for = cause
        self.metrics.slot_healthy.labels(*self._label).set(0)
        self.metrics.withdrawals.labels(self.model, self.node, cause).inc()
        task, self._task = self._task, None
        if task is not None:
            if self.current is not None and wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(task), wait_s)
            cur = self.current
            await cancel_and_wait(task)
            if cur is not None:
                await self.abandon(f"slot withdrawn ({cause})", cur)
        pull, self._pull = self._pull, None
        if pull is not None and await pull.stop():
            await self.sweep(f"slot withdrawn ({cause})")
        log.info("slot withdrawn", model=self.model, slot=self.k, cause=cause)

    async def sweep(self, why: str) -> None:
        """Answer the messages waiting on our subject unfetched: an earlier life's orphan, the
        request a process we replaced was running, or one placed while we stopped. Never a
        purge: each is taken (`plane.contract.ownership.take`) and answered 503 only if the take
        succeeds, so whoever removes it first (the router at the deadline, the process still
        running it) answers, and nobody is left without an answer."""
        for _ in range(SWEEP_MAX):
            try:
                raw = await self.js.get_last_msg(self.stream, self.subject)
            except NotFoundError:
                return
            except Exception as exc:  # cannot tell: the consumer will deliver it
                log.warning("sweep could not read the subject", slot=self.k, error=repr(exc))
                return
            h = raw.headers or {}
            seq = raw.seq or 0
            outcome = await take(self.js, self.stream, seq)
            if outcome is Take.UNKNOWN:
                return  # still there, or not: the consumer delivers it if it is
            if outcome is Take.GONE or Header.REPLY_TO not in h:
                continue
            rid = h.get(Header.REQUEST_ID, "")
            if await self._router_answered(h, rid):
                continue  # landed after its router answered it (a failover)
            self.answered.add(placement_id(self.stream, seq))
            body, headers = replies.error_reply(
                rid, Status.UNAVAILABLE, Reason.UNHEALTHY,
                f"slot {self.node}/{self.k} did not run it ({why}); retry elsewhere",
                node=self.node)
            self._publish_done(h, rid, int(Status.UNAVAILABLE), 0, 0,
                               answer=(h[Header.REPLY_TO], body, headers))
            self._answered(self.model, str(int(Status.UNAVAILABLE))).inc()
            log.warning("unfetched request answered", slot=self.k, request_id=rid, why=why)

    async def abandon(self, why: str, cur: Current | None = None) -> None:
        """Answer the request in progress 503 and free its subject (the runner may still be
        stuck; whatever it returns later is dropped)."""
        cur = cur or self.current
        if self.current is cur:
            self.current = None
        if cur is None or cur.answered:
            return
        if cur.stop is not None and cur.stop.reason is None:
            cur.stop.reason = StreamFinish.ERROR  # the generation thread stops at its next step
        if not await self._claim_answer(cur):
            return
        if cur.stream is not None:
            await self._end_stream(cur, None, f"slot {self.node}/{self.k} failed: {why}; retry "
                                   "elsewhere", int((time.monotonic() - cur.fetched_s) * 1e6))
            return
        await self._finish(cur, Status.UNAVAILABLE, 0, error_body(
            f"slot {self.node}/{self.k} failed: {why}; retry elsewhere", Reason.UNHEALTHY),
            replies.error_headers(cur.request_id, Status.UNAVAILABLE, Reason.UNHEALTHY,
                                  node=self.node))

    async def consumer_alive(self) -> bool:
        try:
            await self.js.consumer_info(self.stream, self.consumer)
            return True
        except NotFoundError:
            return False
        except Exception:
            return True  # cannot tell: keep it; a failing fetch will show

    async def close(self) -> None:
        if self._unreached is not None:
            await cancel_and_wait(self._unreached)
        self.thread.shutdown()
        self._timer.close()

    # -- data path --------------------------------------------------------------------------
    def renew_pull(self) -> None:
        """After a reconnect: the broker may have lost the standing pull; ask again now."""
        if self._pull is not None:
            self._pull.renew()

    async def _loop(self, pull: StandingPull) -> None:
        while self._claimed:
            await self._handle(await pull.next())

    async def _handle(self, msg: Msg) -> None:
        t0 = time.perf_counter_ns()
        h = msg.headers or {}
        try:
            cur = Current(
                msg=msg, request_id=h[Header.REQUEST_ID], reply=h[Header.REPLY_TO],
                deadline_at_ms=int(h[Header.DEADLINE_AT]), work_us=int(h.get(Header.WORK_US, 0)),
                fetched_s=time.monotonic(),
                fetched_ns=time.time_ns() if self.tracing.on else 0,
            )
            # A stream's own deadline (absent: a router that predates streams; the TTFT one).
            stream_at_ms = int(h.get(Header.STREAM_DEADLINE_AT, cur.deadline_at_ms))
        except (KeyError, ValueError):
            log.error("slot message without routing headers terminated", slot=self.k)
            await msg.term()
            return
        self.current = cur
        try:
            if replies.now_ms() > cur.deadline_at_ms:
                await self._answer_error(cur, Status.DEADLINE, Reason.DEADLINE,
                                         "the deadline passed before the slot could start", t0)
                return
            try:
                req = self.spec.decode(msg.data, h.get(Header.CONTENT_TYPE))
                if streams.asked(h):
                    if not self.spec.streams or self.generator is None:
                        raise BadRequest(f"model {self.model} does not stream; call it without "
                                         f"{Header.STREAM}")
                    cur.stream = StreamRun(reply=cur.reply, prompt_tokens=len(req.prompt_bytes),
                                           deadline_at_ms=stream_at_ms,
                                           account=h.get(Header.CALLER_ACCOUNT, ""),
                                           client=h.get(Header.CALLER_CLIENT, ""))
            except BadRequest as exc:
                await self._answer_error(cur, Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc), t0)
                return
            if cur.stream is not None:
                await self._stream(cur, req, t0)
                return
            extra: dict[str, str] = {}
            if self.enrich is not None:
                inputs_ns = time.perf_counter_ns()
                # The wait for inputs ends early enough for the rest to make the deadline:
                # the request's work and the slot's p99 overhead (on a loaded host the
                # guard's fixed reserve alone let the answer come after it, a 504).
                rest_s = (self.window.p99_us + cur.work_us) / 1e6
                req, extra = await self.enrich(req, time.monotonic() - rest_s + (
                    cur.deadline_at_ms - replies.now_ms()) / 1000)
                cur.inputs_us = (time.perf_counter_ns() - inputs_ns) // 1000
            try:
                result = await self._run(req, cur.work_us)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1  # the supervisor counts it as a missed probe
                if not cur.answered:
                    await self._answer_error(cur, Status.UNAVAILABLE, Reason.UNHEALTHY,
                                             f"slot failed: {exc}", t0)
                return
            if cur.answered:  # abandoned by the supervisor while it ran
                return
            service_us = (time.perf_counter_ns() - t0) // 1000
            self.window.add(service_us - cur.own_us)
            body = self._encode(result, h.get(Header.CONTENT_TYPE))
            if result is None or replies.now_ms() > cur.deadline_at_ms:
                await self._answer_error(cur, Status.DEADLINE, Reason.DEADLINE,
                                         "the slot finished after the deadline", t0)
                return
            headers = replies.ok_headers(cur.request_id, self.node, self.k, service_us)
            headers.update(extra)
            if not await self._claim_answer(cur):
                return
            await self._finish(cur, Status.OK, service_us, body, headers)
            self._service.observe(service_us / 1e6)
        finally:
            if self.current is cur:
                self.current = None

    async def _run(self, req: Any, work_us: int) -> Any:
        """The request's result (None: a generation stopped at the deadline)."""
        expected_s = (work_us + max(5000, 4 * self.window.p99_us)) / 1e6
        started_s = self._busy_from()
        try:
            if isinstance(req, TinyLMRequest):
                return await self._generate(req)
            if isinstance(req, CalibratedRequest):
                if self._waits_on_loop(CALIBRATED):
                    await self._device(self.runner.start_calibrated(req.duration_us,
                                                                    expected_s))
                else:
                    await self._call(work_us, self.runner.run_calibrated, req.duration_us,
                                     expected_s)
                return CalibratedReply(duration_us=req.duration_us)
            if self._waits_on_loop(RISK):
                await self._device(self.runner.start_risk(req.features, expected_s))
                return RiskReply(score=self.runner.risk_score())
            score = await self._call(work_us, self.runner.run_risk, req.features, expected_s)
            return RiskReply(score=score)
        finally:
            self._account(started_s)

    @property
    def idle(self) -> bool:
        """No request on this slot and no call running for it, here or on its thread."""
        return self.current is None and self.runner.call_started_s is None

    def _waits_on_loop(self, kind: str) -> bool:
        """A request of `kind` is launched here and awaited on the loop
        (`gpu_node.device_wait`): the node's way (`NodeConfig.device_waits`), and the
        runner's for that kind (device work, checked at warm-up on a GPU; never with a fault
        injected)."""
        return self.device_waits and self.runner.launches(kind)

    async def _device(self, work: DeviceWork) -> None:
        """Until launched `work` is done; the runner's call ends with it (or with a cancel:
        a withdrawal, the node stopping), so that the supervisor sees the slot idle again and
        probes it (a device that hung shows there)."""
        try:
            await finished(work, self._timer)
        finally:
            self.runner.end()

    def _may_run_here(self) -> bool:
        """Calls may run on the event loop (inline calls on, a CPU's default) and no fault
        is injected (a hang must not take the loop)."""
        return self.inline_work_us > 0 and not self.runner.faulty

    async def _call(self, work_us: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the slot's thread; or here, on the event loop, while this slot's
        calls are known short: its last `INLINE_AFTER` all took at most `inline_work_us`, the
        request asks for no more, and no fault is injected (a hang must not take the loop).
        The hop to the thread and back costs ~30 us each way (`benchmarks/slot_thread_hop.py`):
        as much as short work itself. A call that overruns sends the next ones back to the
        thread until the slot's calls are short again; the loop is held at most one such
        call (and the node's other slots with it)."""
        limit = self.inline_work_us
        if limit <= 0:  # off (a GPU's default): nothing to count
            return await self.thread.run(fn, *args)
        if self._short_calls >= INLINE_AFTER and work_us <= limit and self._may_run_here():
            result = fn(*args)
        else:
            result = await self.thread.run(fn, *args)
        if self.runner.last_call_us <= limit:
            self._short_calls += 1
        else:
            self._short_calls = 0
        return result

    def _busy_from(self) -> float:
        """The slot is busy from now (perf counter): pair with `_account`."""
        self._busy.set(1)
        return time.perf_counter()

    def _account(self, started_s: float) -> None:
        """The slot was busy since `started_s` (perf counter): gauges, counters, spans."""
        self._busy.set(0)
        busy_s = time.perf_counter() - started_s
        if self.current is not None:
            self.current.compute_us = int(busy_s * 1e6)
            if self.tracing.on:  # wall-clock stamps only for spans
                end_ns = time.time_ns()
                self.current.compute_ns = (end_ns - int(busy_s * 1e9), end_ns)
        self._busy_s.inc(busy_s)
        if self._sm_s is not None:
            self._sm_s.inc(busy_s * self.sms)

    def _encode(self, result: Any, content_type: str | None) -> bytes:
        if content_type == "application/msgpack":
            return msgpack_encoder.encode(result)
        return json_encoder.encode(result)

    async def _answer_error(self, cur: Current, status: Status, reason: Reason, text: str,
                            t0: int) -> None:
        if not await self._claim_answer(cur):
            return
        service_us = (time.perf_counter_ns() - t0) // 1000
        body, headers = replies.error_reply(cur.request_id, status, reason, text, node=self.node)
        await self._finish(cur, status, service_us, body, headers)

    async def _claim_answer(self, cur: Current) -> bool:
        """Become the one who answers `cur` (see plane.contract.ownership). Before the deadline,
        connected, and while no router can have acted on it yet (`must_take`), a plain ack
        does it (the router acts only after the deadline plus a grace, or when the node is
        gone); otherwise take the message through the API, which says who was first. False:
        someone else answered; stay silent (and tell routers the slot is free).

        Ours is on record (`answered`, by placement and by attempt) the moment it is ours,
        before the answer goes: a router that finds the message gone asks us whether we
        answered (a broker that lost its stream loses the message for both of us), and
        must hear "yes" even while our loop is stalled between the claim and the answer."""
        cur.answered = True
        h = cur.msg.headers or {}
        mine = (placement_id(self.stream, stream_sequence(cur.msg)),
                attempt_id(cur.request_id, h.get(Header.ATTEMPT, "1")))
        if (self.nc.is_connected and replies.now_ms() <= cur.answer_by_ms
                and not self.must_take(cur.fetched_s)):
            self.answered.add(mine[0])
            self.answered.add(mine[1])
            await cur.msg.ack()
            return True
        outcome = await take(self.js, self.stream, cur.msg.metadata.sequence.stream)
        if outcome is not Take.GONE:  # ours (or nobody could say): on record at once
            self.answered.add(mine[0])
            self.answered.add(mine[1])
        with contextlib.suppress(Exception):
            await cur.msg.ack()  # clears our consumer's pending message either way
        if outcome is Take.GONE:  # the router took it (or the broker lost it: it asks us)
            self._done(cur, NOT_ANSWERED, 0)
            return False
        # Its router can have answered it without the broker's word only past the deadline,
        # or before it if it took us for gone (plane.contract.ownership); otherwise it is
        # ours. A draining node asked on every take, and each of its answers waited out the
        # silence of a router stopped first (`plane up`'s drain): ~1 s late.
        if ((replies.now_ms() > cur.answer_by_ms or self.presumed_gone(cur.fetched_s))
                and await self._router_answered(h, cur.request_id)):
            self._done(cur, NOT_ANSWERED, 0)
            return False
        return True

    async def _router_answered(self, h: Mapping[str, str], request_id: str) -> bool | None:
        """Past its deadline, a message we took may be one its router answered without the
        broker's word (its publish's outcome unknown in a failover: it landed late). Record
        the attempt as ours, then ask that router (`plane.contract.ownership`); True: it
        answered, stay silent. A router silent or unreachable (gone) for
        `ASK_ROUTER_WITHIN_S` did not."""
        attempt = attempt_id(request_id, h.get(Header.ATTEMPT, "1"))
        self.answered.add(attempt)
        try:
            subject = self.names.router_answered(check_token("router id", h[Header.ROUTER]))
        except (KeyError, InvalidToken):
            return False
        return await ask_answered(self.nc, subject, attempt, timeout_s=ASK_ROUTER_TIMEOUT_S,
                                  within_s=ASK_ROUTER_WITHIN_S)

    async def _finish(self, cur: Current, status: Status, service_us: int, body: bytes,
                      headers: dict[str, str]) -> None:
        h = cur.msg.headers or {}
        # By placement and by attempt: a router asks by the one it knows (ownership).
        self.answered.add(placement_id(self.stream, stream_sequence(cur.msg)))
        self.answered.add(attempt_id(cur.request_id, h.get(Header.ATTEMPT, "1")))
        headers.update(trace_headers(h))  # the trace, back on the reply
        self._done(cur, int(status), service_us, (cur.reply, body, headers))
        if self.tracing.on:
            self._spans(cur, h, status)
        self._answered(self.model, str(int(status))).inc()
        error = status is not Status.OK
        if self.canonical.due(error=error):
            self.canonical.write("request answered", error=error, request_id=cur.request_id,
                                 model=self.model, node=self.node, slot=self.k,
                                 status=int(status), service_us=service_us,
                                 compute_us=cur.compute_us, work_us=cur.work_us,
                                 inputs_us=cur.inputs_us,
                                 deadline_left_ms=cur.deadline_at_ms - replies.now_ms())

    def _spans(self, cur: Current, h: dict[str, str], status: Status) -> None:
        """plane.slot_wait (the router's publish, from the deadline it stamped, to our
        fetch), plane.compute, plane.write_back, under the slot message's trace context."""
        attrs: dict[str, str | int] = {"request_id": cur.request_id, "model": self.model,
                                       "node": self.node, "slot": self.k}
        with contextlib.suppress(KeyError, ValueError):  # a slot message without stamps
            published_ns = (int(h[Header.DEADLINE_AT]) - int(h[Header.DEADLINE_MS])) * 1_000_000
            self.tracing.record("plane.slot_wait", h, published_ns, cur.fetched_ns, attrs)
        if cur.compute_ns[0]:
            self.tracing.record("plane.compute", h, *cur.compute_ns, attrs)
        self.tracing.record("plane.write_back", h, cur.compute_ns[1] or cur.fetched_ns,
                            time.time_ns(), {**attrs, "status": int(status)})

    def _done(self, cur: Current, status: int, service_us: int,
              answer: Answer | None = None) -> None:
        self._publish_done(cur.msg.headers or {}, cur.request_id, status, service_us,
                           cur.own_us, cur.gen, answer)

    def _publish_done(self, h: dict[str, str], request_id: str, status: int,
                      service_us: int, work_us: int, gen: GenResult | None = None,
                      answer: Answer | None = None) -> None:
        """The slot's done-event, and `answer` (reply subject, body, headers) after it, both
        at the end of this loop turn with the node's other slots' (`DoneBatch`); the slot is
        freed even if the answer cannot be made (it raises as nats-py's publish would).
        A generation's carries its tokens and phases (the router learns its per-token
        rates from them) and `work_us`, the device time it took."""
        ev = DoneEvent(request_id=request_id, node=self.node, model=self.model, k=self.k,
                       status=status, service_us=service_us, router=h.get(Header.ROUTER, ""),
                       work_us=work_us, sms=self.sms,
                       prompt_tokens=gen.prompt_tokens if gen else 0,
                       tokens=gen.tokens if gen else 0,
                       prefill_us=gen.prefill_us if gen else 0,
                       decode_us=gen.decode_us if gen else 0,
                       cut=gen is not None and gen.finish in CUT_SHORT)
        cmd = b""
        try:
            if answer is not None:
                cmd = command(self.nc, *answer)
        finally:  # the slot is free whether or not its answer could be made
            self.dones.send(ev, self.done_subject, cmd)

    # -- probes -----------------------------------------------------------------------------
    async def probe(self) -> bool:
        t0 = time.perf_counter_ns()
        expected_s = max(0.005, 4 * self.probe_window.p50_us / 1e6)  # p50: robust to a hang
        if self._may_run_here() and self.idle:
            # No call runs now, here or on the slot's thread (the check and the probe are one
            # step of the loop: no request starts in between): a probe's few µs of the
            # model's work run here, every time.
            # (An idle slot's calls are never "known short": after an idle spell they run
            # cold; and the hop to the thread and back cost an idle node more than its
            # probes' work.)
            ok = bool(self.runner.probe(expected_s))
        else:
            ok = bool(await self.thread.run(self.runner.probe, expected_s))
        self.probe_window.add((time.perf_counter_ns() - t0) // 1000)
        return ok
