"""The Kafka-to-JetStream bridge (`plane bridge`).

Each Kafka record becomes one message on `<prefix>.events.<topic>` (stream `PLANE_EVENTS`,
file storage) with the bridge's stamps as headers: `Plane-Event-Time` (the record's
timestamp), `Plane-Ingest-Time` (when the bridge took it), `Plane-Kafka-Key`,
`Plane-Kafka-Partition`, `Plane-Kafka-Offset`, `Nats-Msg-Id` (see `records.msg_id`) so that
JetStream drops a record published twice, and the record's own Kafka headers as
`Plane-Kafka-Header-<name>` (see `records.carry_kafka_headers`). A record that is not a valid
transaction (not JSON, a missing field, a wrong type, too large for NATS) goes to
`<prefix>.dead.<topic>` with `Plane-Dead-Reason` instead, in the same stream, and to a Kafka
dead-letter topic as well when one is configured; the bridge goes on.

Exactly once, end to end: the bridge works in rounds, pipelined. A round is what one fetch
from Kafka returned (up to `max_batch` records); it is published at once (at most
`max_in_flight` acknowledgements outstanding over all rounds) and the next round is fetched
and published while JetStream acknowledges it. Rounds are settled in order: once JetStream has
acknowledged every record of a round (failures retried with the same Nats-Msg-Id) and Kafka
every dead letter, its offsets may be committed; settled offsets are committed at most every
`commit_interval_ms`. A crash at any point re-fetches at most the rounds not yet committed,
and JetStream drops those it already has. Records of one partition are
published in Kafka order on one connection, so a stream keeps Kafka's per-partition order
(except that a record retried after an outage may land after its successors).

While nothing comes and every partition it holds is at its end in Kafka (and every record
fetched is acknowledged by JetStream), the bridge says so every `caught_up_interval_ms` on
`<prefix>.caughtup.<stream>`: the caught-up watermark that lets the freshness guard read a
quiet topic as fresh (`freshness.watermark`).

Either broker may restart: librdkafka reconnects to Kafka by itself (a failed commit is only
logged: its records come again and are dropped as duplicates); a NATS outage holds the
settling of rounds, with backoff, until the broker acknowledges, and the window of
outstanding acknowledgements holds the fetching.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import nats.errors
import structlog
from confluent_kafka import KafkaException, Message
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError

from freshness.config import BridgeConfig, stream_token
from freshness.kafka_client import (
    DeadLetter,
    DeadLetterSink,
    KafkaSource,
    TopicPart,
    record_headers,
)
from freshness.kafka_watch import TopicCheck
from freshness.metrics import BridgeMetrics
from freshness.provision import ensure_events_stream, events_stream_config
from freshness.publisher import Ack, AckWindow, Batch, Outgoing
from freshness.records import Stamps, carry_kafka_headers, msg_id, transaction_decoder
from freshness.watermark import CaughtUp, Probe
from plane.contract.errors import ConnectionClosed
from plane.contract.lifecycle import Lifecycle, finish_or_cancel
from plane.contract.provision import at_start
from plane.contract.replies import now_ms
from plane.contract.subjects import Header

log = structlog.get_logger("freshness.bridge")

_MAX_REASON = 240
# Room kept under the server's max_payload for the protocol line and our own stamps.
_HEADROOM_BYTES = 512
# Kafka headers of a dead letter sent to the Kafka dead-letter topic.
KAFKA_DEAD_REASON = "plane-dead-reason"
KAFKA_DEAD_SOURCE = "plane-dead-source"  # topic:partition:offset of the original record


def dead_reason(value: bytes | None) -> str | None:
    """Why a record cannot be bridged as a transaction, or None when it can."""
    if value is None:
        return "empty: a record with no value (tombstone)"
    if not value:
        return "empty: a record whose value is empty"
    try:
        transaction_decoder.decode(value)
    except msgspec.ValidationError as exc:
        return f"invalid: {exc}"[:_MAX_REASON]
    except msgspec.DecodeError as exc:
        return f"not JSON: {exc}"[:_MAX_REASON]
    return None


def _header_bytes(headers: dict[str, str]) -> int:
    """The header block's size on the wire: UTF-8 bytes, not characters (a Kafka header of
    25,000 "é" counted half its size, the publish went over max_payload, and the server
    closed the connection)."""
    return sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


@dataclass(frozen=True, slots=True)
class Prepared:
    """One record, ready to publish, with what settling its round needs."""

    out: Outgoing
    topic: str
    dead: bool
    lag_ms: int
    dead_letter: DeadLetter | None = None


@dataclass(eq=False)
class Round:
    records: list[Prepared]
    batch: Batch
    offsets: dict[TopicPart, int]
    # Records published again by this bridge (no ack the first time): a duplicate ack for
    # one is its own first publish that landed, an event, not a record Kafka sent again.
    retried: set[int] = field(default_factory=set)


@dataclass
class BridgeStats:
    rounds: int = 0
    events: int = 0
    dead: int = 0
    dead_to_kafka: int = 0
    duplicates: int = 0
    retries: int = 0
    commits: int = 0  # acknowledged by Kafka
    commit_failures: int = 0
    caught_up: int = 0  # caught-up watermarks published
    # Seconds from `start()` to the first record acknowledged by JetStream (None: none yet).
    first_record_s: float | None = None


class KafkaBridge(Lifecycle):
    """`async with KafkaBridge(nc, BridgeConfig(...)) as bridge:` bridges until the block
    ends; `stop()` (idempotent) settles the rounds in flight, commits them, then leaves."""

    def __init__(
        self, nc: Client, config: BridgeConfig, *, metrics: BridgeMetrics | None = None
    ) -> None:
        self.cfg = config
        self.names = config.names
        self.metrics = metrics or BridgeMetrics()
        self.stats = BridgeStats()
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._stream_cfg = events_stream_config(
            config.names,
            duplicate_window_s=config.duplicate_window_s,
            max_age_s=config.max_age_s,
            replicas=config.replicas,
        )
        self._tokens = {t: stream_token(t) for t in config.topics}
        self._window = AckWindow(nc, config.max_in_flight)
        self._source: KafkaSource | None = None
        self._sink: DeadLetterSink | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._settled: dict[TopicPart, int] = {}  # next offsets, committed or to commit
        self._due: dict[TopicPart, int] = {}  # settled since the last commit
        self._lag_labels: set[TopicPart] = set()
        # Lag series of partitions this bridge does not hold: the group's, reported while it
        # holds none of their topic (`freshness.kafka_watch`).
        self._group_lag_labels: set[TopicPart] = set()
        self._started_at = 0.0
        self._unsettled = 0  # rounds fetched and not settled yet
        # Per topic, the stream sequence of the last event this bridge published (acked).
        self._event_seq: dict[str, int] = {}
        self._caught_up_json = msgspec.json.Encoder()
        self.assigned = asyncio.Event()  # set once Kafka has assigned partitions to us

    # -- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._started_at = time.monotonic()
        await at_start(lambda: ensure_events_stream(self._js, self._stream_cfg), who="bridge")
        await self._window.start()
        self._source = KafkaSource(self.cfg, on_revoked=self._forget_partitions,
                                   on_committed=self._committed)
        await self._source.open()
        if self.cfg.dead_letter_topic is not None:
            self._sink = DeadLetterSink(self.cfg, self.cfg.dead_letter_topic)
        if self.cfg.security.password_in_clear:
            log.warning("SASL PLAIN without TLS: the Kafka password crosses the network in "
                        "clear (use SASL_SSL)")
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name="kafka-bridge")
        log.info("bridge started", topics=list(self.cfg.topics), kafka=self.cfg.kafka_bootstrap,
                 security=self.cfg.security.effective_protocol.value,
                 start=self.cfg.start.value, dead_letter_topic=self.cfg.dead_letter_topic)

    async def stop(self) -> None:
        """Stage 1: fetch no more. Stage 2: settle and commit the rounds in flight (bounded
        by `drain_timeout_s`; past it, their records stay uncommitted and come again).
        Stage 3: commit synchronously, leave the consumer group, close."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        try:
            if not await finish_or_cancel(task, self.cfg.drain_timeout_s):
                log.warning("bridge rounds did not settle in time: left uncommitted")
            await self._final_commit()
        finally:
            await self._close()
        log.info("bridge stopped", **vars(self.stats))

    async def wait_assigned(self, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            await self.assigned.wait()

    async def wait(self) -> None:
        """Until the bridge stops; raises what ended it, if it failed."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _final_commit(self) -> None:
        if self._source is None or not self._settled:
            return
        try:
            await self._source.commit(dict(self._settled), wait=True)
        except KafkaException as exc:
            log.warning("final Kafka commit failed: records will be re-fetched and "
                        "deduplicated", error=str(exc))

    async def _close(self) -> None:
        source, self._source = self._source, None
        sink, self._sink = self._sink, None
        if source is not None:
            await source.close()
        if sink is not None:
            await sink.close()
        await self._window.stop()

    # -- the pipeline ----------------------------------------------------------------------
    async def _run(self) -> None:
        rounds: asyncio.Queue[Round | None] = asyncio.Queue()
        settled_all = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._fetch_loop(rounds), name="bridge-fetch")
                tg.create_task(self._settle_loop(rounds, settled_all), name="bridge-settle")
                tg.create_task(self._commit_loop(settled_all), name="bridge-commit")
        except* ConnectionClosed as group:  # the command's one-line error, not a group
            raise group.exceptions[0] from None

    async def _fetch_loop(self, rounds: asyncio.Queue[Round | None]) -> None:
        source = self._source
        assert source is not None
        timeout_s = self.cfg.poll_timeout_ms / 1000
        try:
            while not self._stopping.is_set():
                fetched = await source.fetch(self.cfg.max_batch, timeout_s)
                if fetched.assigned:
                    self.assigned.set()
                self._set_lag(fetched.lag)
                self._set_checks(fetched.checks)
                if fetched.caught_up is not None and not self._unsettled:
                    await self._say_caught_up(fetched.caught_up)
                if not fetched.records:
                    continue
                ingest_ms = now_ms()
                prepared = [self._prepare(m, ingest_ms) for m in fetched.records]
                batch = await self._window.publish([p.out for p in prepared])
                offsets: dict[TopicPart, int] = {}
                for m in fetched.records:
                    offsets[(m.topic() or "", m.partition() or 0)] = (m.offset() or 0) + 1
                self._unsettled += 1
                await rounds.put(Round(records=prepared, batch=batch, offsets=offsets))
        finally:
            rounds.put_nowait(None)

    async def _settle_loop(
        self, rounds: asyncio.Queue[Round | None], settled_all: asyncio.Event
    ) -> None:
        """Settle rounds in order, until the fetching stops or a round cannot be settled
        (stopping): nothing after it may be committed."""
        try:
            while (r := await rounds.get()) is not None and await self._settle(r):
                self._due.update(r.offsets)
                self._unsettled -= 1
        finally:
            settled_all.set()

    async def _commit_loop(self, settled_all: asyncio.Event) -> None:
        """Commit what is settled every `commit_interval_ms`, not per round: at a trickle a
        round is one record, and a commit per record cost the brokers more CPU than the
        records did. Runs apart from the settling, so that a round stuck in an outage does
        not hold back the commit of those settled before it."""
        interval_s = self.cfg.commit_interval_ms / 1000
        while not settled_all.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await settled_all.wait()
            if self._due:
                due, self._due = self._due, {}
                await self._commit(due)

    async def _settle(self, r: Round) -> bool:
        """Every record of `r` acknowledged, every dead letter in Kafka: True. False only
        when stopping first."""
        if not await r.batch.wait(self.cfg.publish_timeout_s):
            self._window.forget(r.batch)
        for i, ack in enumerate(r.batch.acks):
            if ack is None:
                r.batch.acks[i] = await self._publish_until_acked(r.records[i].out)
                r.retried.add(i)
        letters = [p.dead_letter for p in r.records if p.dead_letter is not None]
        if letters and self._sink is not None:
            if not await self._sink.send(letters, self._stopping.is_set):
                return False  # stopping with dead letters Kafka lacks: left uncommitted
            self.stats.dead_to_kafka += len(letters)
        self._count(r)
        self._settled.update(r.offsets)
        return True

    async def _say_caught_up(self, probe: Probe) -> None:
        """Every partition held is at its end and every record fetched is in JetStream:
        one `CaughtUp` per topic, to its feature updater (core NATS: a lost one is only
        a watermark that comes `caught_up_interval_ms` later)."""
        for topic, partitions in probe.held.items():
            mark = CaughtUp(topic=topic, partitions=partitions,
                            partition_count=probe.counts[topic], caught_up_ms=probe.at_ms,
                            event_seq=self._event_seq.get(topic, 0))
            with contextlib.suppress(nats.errors.Error):  # reconnecting: the next one
                await self._nc.publish(self.names.caught_up(self._tokens[topic]),
                                       self._caught_up_json.encode(mark))
                self.stats.caught_up += 1
                self.metrics.caught_up.labels(topic).inc()

    async def _commit(self, offsets: dict[TopicPart, int]) -> None:
        assert self._source is not None
        # Asynchronous: its outcome comes to `_committed`.
        await self._source.commit(offsets)

    def _committed(self, error: str | None) -> None:
        if error is None:
            self.stats.commits += 1
            self.metrics.commits.labels("ok").inc()
            return
        # Rebalance or Kafka restart: the records come again and JetStream drops them.
        self.stats.commit_failures += 1
        self.metrics.commits.labels("failed").inc()
        log.warning("Kafka commit failed: records will be re-fetched and deduplicated",
                    error=error)

    def _count(self, r: Round) -> None:
        """Stats and metrics of a settled round: counted per round and topic, then added
        (a labelled metric looked up per record cost more than the record's publish)."""
        events: Counter[str] = Counter()
        dead: Counter[str] = Counter()
        duplicates: Counter[str] = Counter()
        lag = {t: self.metrics.lag_seconds.labels(t) for t in self.cfg.topics}
        for i, (p, ack) in enumerate(zip(r.records, r.batch.acks, strict=True)):
            if ack is not None and ack.duplicate and i not in r.retried:
                duplicates[p.topic] += 1
            elif p.dead:
                dead[p.topic] += 1
            else:
                events[p.topic] += 1
                lag[p.topic].observe(max(p.lag_ms, 0) / 1000)
            if not p.dead and ack is not None:
                self._event_seq[p.topic] = max(self._event_seq.get(p.topic, 0), ack.seq)
        for topic, n in duplicates.items():
            self.metrics.duplicates.labels(topic).inc(n)
        for topic, n in events.items():
            self.metrics.records.labels(topic, "event").inc(n)
        for topic, n in dead.items():
            self.metrics.records.labels(topic, "dead").inc(n)
        self.stats.duplicates += duplicates.total()
        self.stats.events += events.total()
        self.stats.dead += dead.total()
        self.stats.rounds += 1
        if self.stats.first_record_s is None:
            self.stats.first_record_s = time.monotonic() - self._started_at
            self.metrics.first_record_seconds.set(self.stats.first_record_s)
            log.info("first record bridged", seconds_since_start=self.stats.first_record_s)

    def _set_lag(self, lag: dict[TopicPart, int]) -> None:
        for (topic, partition), records in lag.items():
            self.metrics.consumer_lag.labels(topic, str(partition)).set(records)
            self._lag_labels.add((topic, partition))

    def _set_checks(self, checks: list[TopicCheck]) -> None:
        for c in checks:
            self.metrics.topic_partitions.labels(c.topic).set(c.partitions)
            self.metrics.assigned_partitions.labels(c.topic).set(len(c.assigned))
            for partition, records in c.group_lag.items():
                self.metrics.consumer_lag.labels(c.topic, str(partition)).set(records)
                self._group_lag_labels.add((c.topic, partition))
            gone = {(t, p) for t, p in self._group_lag_labels
                    if t == c.topic and p not in c.group_lag}
            for key in gone:
                self._group_lag_labels.discard(key)
                if key not in self._lag_labels:  # not one of ours now: its lag is not ours
                    with contextlib.suppress(KeyError):
                        self.metrics.consumer_lag.remove(key[0], str(key[1]))

    def _forget_partitions(self, parts: list[TopicPart]) -> None:
        """Partitions revoked: their lag is another bridge's to report now, and their
        offsets its to commit."""
        for topic, partition in parts:
            self._settled.pop((topic, partition), None)
            self._due.pop((topic, partition), None)
            if (topic, partition) in self._lag_labels:
                self._lag_labels.discard((topic, partition))
                with contextlib.suppress(KeyError):
                    self.metrics.consumer_lag.remove(topic, str(partition))

    def _prepare(self, m: Message, ingest_ms: int) -> Prepared:
        topic = m.topic() or ""
        partition = m.partition() or 0
        offset = m.offset() or 0
        _ts_type, ts = m.timestamp()
        value = m.value()
        if ts > ingest_ms:
            # A producer's clock ahead of ours: the record would be fresh for as long as it
            # is ahead, and the newest of its card's (its "last" amount) until real time
            # caught up (10 minutes ahead: both, found from outside). Its own timestamp
            # stays in Nats-Msg-Id (deduplication is by the record as Kafka holds it).
            self.metrics.event_time_ahead.labels(topic).inc()
        stamps = Stamps(event_time_ms=ts if 0 <= ts <= ingest_ms else ingest_ms,
                        ingest_time_ms=ingest_ms, partition=partition, offset=offset,
                        key=m.key())
        headers = stamps.headers(msg_id(topic, partition, offset, ts))
        kafka_headers = record_headers(m)
        carry_kafka_headers(headers, kafka_headers)
        reason = dead_reason(value)
        payload = value or b""
        limit = self._nc.max_payload - _HEADROOM_BYTES
        if reason is None and len(payload) + _header_bytes(headers) > limit:
            reason = (f"too large: {len(payload) + _header_bytes(headers)} bytes with "
                      f"headers, over the NATS server's max_payload ({self._nc.max_payload})")
        if reason is None:
            return Prepared(out=Outgoing(self.names.events(self._tokens[topic]), payload,
                                         headers),
                            topic=topic, dead=False, lag_ms=stamps.lag_ms)
        reason = reason.replace("\r", " ").replace("\n", " ")
        log.info("dead letter", topic=topic, partition=partition, offset=offset, reason=reason)
        if len(payload) + _header_bytes(headers) > limit:  # keep the stamps, drop the rest
            headers = stamps.headers(msg_id(topic, partition, offset, ts))
            payload = b""
            if _header_bytes(headers) + len(reason) + 64 > limit:
                # A key too large to carry either (the dead letter went over max_payload
                # with it, and the server closed the connection): its size is said instead.
                headers.pop(Header.KAFKA_KEY, None)
                reason = f"{reason}; its key ({len(m.key() or b'')} bytes) dropped too"
        headers[Header.DEAD_REASON] = reason
        letter = None
        if self._sink is not None:
            letter = DeadLetter(key=m.key(), value=value, headers=[
                *kafka_headers,
                (KAFKA_DEAD_REASON, reason.encode()),
                (KAFKA_DEAD_SOURCE, f"{topic}:{partition}:{offset}".encode()),
            ])
        return Prepared(out=Outgoing(self.names.dead_letter(self._tokens[topic]), payload,
                                     headers),
                        topic=topic, dead=True, lag_ms=stamps.lag_ms, dead_letter=letter)

    # -- the slow path: one record until it is acknowledged ----------------------------------
    async def _publish_until_acked(self, o: Outgoing) -> Ack:
        """Publish `o` until JetStream acknowledges it, backing off; raises `ConnectionClosed`
        once the NATS connection is closed for good (nats-py gave up on it): retried for
        ever there, the bridge stood still, alive and silent (found from outside)."""
        backoff_s = self.cfg.retry_backoff_s
        while True:
            if self._nc.is_closed:
                raise ConnectionClosed(
                    f"the bridge's NATS connection is closed for good "
                    f"({self._nc.last_error!r}): restart the bridge (its records are "
                    "uncommitted in Kafka and come again)")
            self.stats.retries += 1
            self.metrics.retries.inc()
            try:
                ack = await self._js.publish(
                    o.subject, o.payload, timeout=self.cfg.publish_timeout_s,
                    headers=dict(o.headers),
                )
                return Ack(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))
            except NoStreamResponseError:
                # A broker that came back without our stream (new store): create it again.
                with contextlib.suppress(nats.errors.Error):
                    await ensure_events_stream(self._js, self._stream_cfg)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("JetStream publish failed: retrying", subject=o.subject,
                            error=repr(exc), retry_in_s=backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.cfg.retry_backoff_max_s)
