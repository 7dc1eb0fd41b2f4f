"""The Kafka-to-JetStream bridge (`plane bridge`).

Each Kafka record becomes one message on `<prefix>.events.<topic>` (stream `PLANE_EVENTS`,
file storage) with the bridge's stamps as headers: `Plane-Event-Time` (the record's
timestamp), `Plane-Ingest-Time` (when the bridge took it), `Plane-Kafka-Key`,
`Plane-Kafka-Partition`, `Plane-Kafka-Offset`, and `Nats-Msg-Id` (see `records.msg_id`) so
that JetStream drops a record published twice. A record that is not a valid transaction (not
JSON, a missing field, a wrong type) goes to `<prefix>.dead.<topic>` with `Plane-Dead-Reason`
instead, in the same stream, and the bridge goes on.

Exactly once, end to end: the bridge works in rounds. A round takes up to `max_batch` records
from Kafka, publishes them all (up to `max_in_flight` acknowledgements outstanding), waits
until JetStream has acknowledged every one (retrying failures with the same Nats-Msg-Id), and
only then commits the round's Kafka offsets. A crash at any point re-fetches at most the
uncommitted rounds, and JetStream drops those it already has. Records of one partition are
published in Kafka order on one connection, so a stream keeps Kafka's per-partition order
(except that a record retried after an outage may land after its successors).

Either broker may restart: aiokafka reconnects to Kafka by itself (a failed commit is only
logged: its records come again and are dropped as duplicates); a NATS outage holds the
round, with backoff, until the broker acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import msgspec
import nats.errors
import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError

from freshness.config import BridgeConfig, stream_token
from freshness.metrics import BridgeMetrics
from freshness.provision import ensure_events_stream, events_stream_config
from freshness.records import Stamps, msg_id, transaction_decoder
from plane.lifecycle import Lifecycle, finish_or_cancel
from plane.subjects import Header

log = structlog.get_logger("freshness.bridge")

_MAX_REASON = 240


def dead_reason(value: bytes | None) -> str | None:
    """Why a record cannot be bridged as a transaction, or None when it can."""
    if value is None:
        return "empty: a record with no value (tombstone)"
    try:
        transaction_decoder.decode(value)
    except msgspec.ValidationError as exc:
        return f"invalid: {exc}"[:_MAX_REASON]
    except msgspec.DecodeError as exc:
        return f"not JSON: {exc}"[:_MAX_REASON]
    return None


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record, ready to publish."""

    subject: str
    payload: bytes
    headers: dict[str, str]
    topic: str
    dead: bool
    lag_ms: int


@dataclass
class BridgeStats:
    rounds: int = 0
    events: int = 0
    dead: int = 0
    duplicates: int = 0
    retries: int = 0
    commits: int = 0
    commit_failures: int = 0


class KafkaBridge(Lifecycle):
    """`async with KafkaBridge(nc, BridgeConfig(...)) as bridge:` bridges until the block
    ends; `stop()` (idempotent) finishes the round in flight, commits it, then leaves."""

    def __init__(
        self, nc: Client, config: BridgeConfig, *, metrics: BridgeMetrics | None = None
    ) -> None:
        self.cfg = config
        self.names = config.names
        self.metrics = metrics or BridgeMetrics()
        self.stats = BridgeStats()
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream(publish_async_max_pending=config.max_in_flight)
        self._stream_cfg = events_stream_config(
            config.names,
            duplicate_window_s=config.duplicate_window_s,
            max_age_s=config.max_age_s,
            replicas=config.replicas,
        )
        self._tokens = {t: stream_token(t) for t in config.topics}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.assigned = asyncio.Event()  # set once Kafka has assigned partitions to us

    # -- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        await ensure_events_stream(self._js, self._stream_cfg)
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name="kafka-bridge")
        log.info("bridge started", topics=list(self.cfg.topics), kafka=self.cfg.kafka_bootstrap)

    async def stop(self) -> None:
        """Stage 1: take no new round. Stage 2: let the round in flight finish and commit
        (bounded by `drain_timeout_s`; past it, its records stay uncommitted and come again).
        Stage 3: leave the consumer group."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        try:
            if not await finish_or_cancel(task, self.cfg.drain_timeout_s):
                log.warning("bridge round did not finish in time: left uncommitted")
        finally:
            await self._close_consumer()
        log.info("bridge stopped", **vars(self.stats))

    async def wait_assigned(self, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            await self.assigned.wait()

    # -- the loop --------------------------------------------------------------------------
    async def wait(self) -> None:
        """Until the bridge stops; raises what ended it, if it failed."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        consumer = await self._open_consumer()
        while consumer is not None and not self._stopping.is_set():
            batch = await consumer.getmany(
                timeout_ms=self.cfg.poll_timeout_ms, max_records=self.cfg.max_batch
            )
            if consumer.assignment():
                self.assigned.set()
            if not batch:
                continue
            await self._round(consumer, batch)

    async def _open_consumer(self) -> AIOKafkaConsumer | None:
        backoff_s = self.cfg.retry_backoff_s
        while not self._stopping.is_set():
            consumer = AIOKafkaConsumer(
                *self.cfg.topics,
                bootstrap_servers=self.cfg.kafka_bootstrap,
                group_id=self.cfg.group_id,
                client_id="plane-bridge",
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=20,
                session_timeout_ms=self.cfg.session_timeout_ms,
                heartbeat_interval_ms=self.cfg.heartbeat_interval_ms,
            )
            try:
                await consumer.start()
            except KafkaError as exc:
                await consumer.stop()
                log.warning("Kafka not reachable: retrying", error=repr(exc),
                            kafka=self.cfg.kafka_bootstrap, retry_in_s=backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.cfg.retry_backoff_max_s)
                continue
            self._consumer = consumer
            return consumer
        return None

    async def _close_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(KafkaError):
                await consumer.stop()

    async def _round(
        self, consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[ConsumerRecord]]
    ) -> None:
        ingest_ms = time.time_ns() // 1_000_000
        outgoing = [self._prepare(rec, ingest_ms) for recs in batch.values() for rec in recs]
        acks = await self._publish_all(outgoing)
        for o, ack in zip(outgoing, acks, strict=True):
            if ack.duplicate:
                self.stats.duplicates += 1
                self.metrics.duplicates.labels(o.topic).inc()
                continue
            if o.dead:
                self.stats.dead += 1
            else:
                self.stats.events += 1
                self.metrics.lag_seconds.labels(o.topic).observe(max(o.lag_ms, 0) / 1000)
            self.metrics.records.labels(o.topic, "dead" if o.dead else "event").inc()
        self.stats.rounds += 1
        offsets = {tp: recs[-1].offset + 1 for tp, recs in batch.items()}
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:
            # Rebalance or Kafka restart: the records come again and JetStream drops them.
            self.stats.commit_failures += 1
            self.metrics.commits.labels("failed").inc()
            log.warning("Kafka commit failed: records will be re-fetched and deduplicated",
                        error=repr(exc))
            return
        self.stats.commits += 1
        self.metrics.commits.labels("ok").inc()

    def _prepare(self, rec: ConsumerRecord, ingest_ms: int) -> Outgoing:
        token = self._tokens[rec.topic]
        stamps = Stamps(
            event_time_ms=rec.timestamp,
            ingest_time_ms=ingest_ms,
            partition=rec.partition,
            offset=rec.offset,
            key=rec.key,
        )
        headers = stamps.headers(msg_id(rec.topic, rec.partition, rec.offset, rec.timestamp))
        reason = dead_reason(rec.value)
        if reason is None:
            subject = self.names.events(token)
        else:
            subject = self.names.dead_letter(token)
            headers[Header.DEAD_REASON] = reason.replace("\r", " ").replace("\n", " ")
            log.info("dead letter", topic=rec.topic, partition=rec.partition,
                     offset=rec.offset, reason=reason)
        return Outgoing(subject=subject, payload=rec.value or b"", headers=headers,
                        topic=rec.topic, dead=reason is not None, lag_ms=stamps.lag_ms)

    # -- publishing ------------------------------------------------------------------------
    async def _publish_all(self, outgoing: list[Outgoing]) -> list[PubAck]:
        """Publish in order with bounded acknowledgements outstanding; every record ends
        acknowledged (retried with its Nats-Msg-Id until it is)."""
        futures: list[asyncio.Future[PubAck] | None] = []
        for o in outgoing:
            try:
                fut = await self._js.publish_async(
                    o.subject, o.payload, headers=o.headers,
                    wait_stall=self.cfg.publish_timeout_s,
                )
            except nats.errors.Error:
                fut = None  # stalled or disconnected: retried below
            futures.append(fut)
        live = [f for f in futures if f is not None]
        if live:
            await asyncio.wait(live, timeout=self.cfg.publish_timeout_s)
        acks: list[PubAck] = []
        for o, fut in zip(outgoing, futures, strict=True):
            ack: PubAck | None = None
            if fut is not None:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    ack = fut.result()
                else:
                    fut.cancel()
            acks.append(ack if ack is not None else await self._publish_until_acked(o))
        return acks

    async def _publish_until_acked(self, o: Outgoing) -> PubAck:
        backoff_s = self.cfg.retry_backoff_s
        while True:
            self.stats.retries += 1
            self.metrics.retries.inc()
            try:
                return await self._js.publish(
                    o.subject, o.payload, timeout=self.cfg.publish_timeout_s,
                    headers=dict(o.headers),
                )
            except NoStreamResponseError:
                # A broker that came back without our stream (new store): create it again.
                with contextlib.suppress(nats.errors.Error):
                    await ensure_events_stream(self._js, self._stream_cfg)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("JetStream publish failed: retrying", subject=o.subject,
                            error=repr(exc), retry_in_s=backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.cfg.retry_backoff_max_s)
