"""The bridge's Kafka side on confluent-kafka (librdkafka): `KafkaSource` consumes in a group
and commits, `DeadLetterSink` produces dead letters to a Kafka topic.

librdkafka's calls block, and its consumer must not be used from two threads at once: every
call on the consumer runs in one thread of its own (`kafka-consumer`), which also keeps them
in order (a commit always after the fetch of its records); the dead-letter producer has its
own (`kafka-dead-letters`). These two executors are the only place the bridge blocks. What
librdkafka does meanwhile (fetching ahead, heartbeats, reconnects) runs in its own threads,
off the interpreter's lock, so the event loop is left to the NATS side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import structlog
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from freshness.config import BridgeConfig
from freshness.kafka_config import KafkaSecurity, StartFrom
from freshness.kafka_probe import FROM_START, PROBE_BACKOFF_S, probe
from freshness.kafka_watch import AssignmentWatch, TopicCheck, past_end
from freshness.watermark import Probe
from plane.contract.errors import ConfigError
from plane.contract.natsconn import ERROR_LOG_EVERY_S, Throttle
from plane.contract.replies import now_ms

log = structlog.get_logger("freshness.kafka")
T = TypeVar("T")

# librdkafka's own log lines (connection failures, ...) go through stdlib logging at warning
# and above; its errors also reach `_on_error` below.
_LIBRDKAFKA_LOG_LEVEL = 4
# Consumer lag is computed at most this often (a Python loop over the partitions, on the
# consumer's thread: done on every fetch it held the interpreter lock for nothing).
LAG_EVERY_S = 0.5
# Leaving the group (`leave_group`): how long one poll waits for the revoke to come.
LEAVE_POLL_S = 0.01

TopicPart = tuple[str, int]


class RepeatsHeldBack(logging.Filter):
    """One line per librdkafka facility (`FAIL`, `CONNECT`, ...) per `ERROR_LOG_EVERY_S`,
    saying how many like it were held back: with a broker down it logged each failed
    connect (and its error callback each again), ~38 lines a second for as long as the
    outage lasted (found from outside)."""

    def __init__(self, every_s: float = ERROR_LOG_EVERY_S) -> None:
        super().__init__()
        self.throttle = Throttle(every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        facility = str(record.args[0]) if isinstance(record.args, tuple) and record.args else (
            str(record.msg)[:40])
        held = self.throttle.allow(f"{record.levelno}:{facility}")
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg} ({held} like it not logged)"
        return True


def _librdkafka_logger() -> logging.Logger:
    """The stdlib logger librdkafka's lines go to, its repeats held back (one filter)."""
    logger = logging.getLogger("freshness.librdkafka")
    if not any(isinstance(f, RepeatsHeldBack) for f in logger.filters):
        logger.addFilter(RepeatsHeldBack())
    return logger


def client_config(bootstrap: str, security: KafkaSecurity, **extra: Any) -> dict[str, Any]:
    """librdkafka settings common to the consumer, the producer and the admin client."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": _librdkafka_logger(),
        "log_level": _LIBRDKAFKA_LOG_LEVEL,
        **security.librdkafka(),
    }
    conf.update(extra)
    return conf


def consumer_config(cfg: BridgeConfig) -> dict[str, Any]:
    return client_config(
        cfg.kafka_bootstrap, cfg.security,
        **{
            "group.id": cfg.group_id,
            "client.id": "plane-bridge",
            "enable.auto.commit": False,
            # Offsets are committed explicitly, per round, after JetStream acked it.
            "enable.auto.offset.store": False,
            # Where a partition without a committed offset (or with one out of range)
            # starts: always its beginning. `--start latest` puts its first assignment at
            # the end explicitly (`_on_assign`); a later one, after a broker that lost its
            # log came back with the group forgotten, must not skip what the new log got
            # before the partition came back (JetStream drops what it already has).
            "auto.offset.reset": "earliest",
            "topic.metadata.refresh.interval.ms": cfg.metadata_refresh_ms,
            "session.timeout.ms": cfg.session_timeout_ms,
            "heartbeat.interval.ms": cfg.heartbeat_interval_ms,
            "fetch.wait.max.ms": cfg.fetch_wait_max_ms,
            "enable.partition.eof": False,
        },
    )


def new_client(kind: Callable[[dict[str, Any]], T], conf: dict[str, Any]) -> T:
    """A librdkafka client; a setting it refuses is a `ConfigError` naming it."""
    try:
        return kind(conf)
    except KafkaException as exc:
        raise ConfigError(f"Kafka client settings refused: {exc.args[0].str()}") from exc


@dataclass(frozen=True, slots=True)
class Fetched:
    records: list[Message]
    # Consumer lag per assigned partition (every LAG_EVERY_S; empty in between): the
    # partition's end (high watermark, as of the last fetch response) minus the bridge's
    # committed offset (or, before its first commit there, its position).
    lag: dict[TopicPart, int]
    assigned: bool
    # Every `watch_interval_ms` (empty in between): each topic's partitions, and the
    # group's lag of those of a topic this bridge holds none of (`freshness.kafka_watch`).
    checks: list[TopicCheck] = field(default_factory=list)
    # Every `caught_up_interval_ms` while nothing comes: every partition held has reached
    # its end as Kafka says it (`freshness.kafka_probe.probe`); None otherwise.
    caught_up: Probe | None = None


@dataclass
class _PartitionState:
    # The offset the lag counts from: the group's committed offset (asked once after the
    # assignment, where the partition resumes from it), then the first record's fetched,
    # then each commit of ours.
    committed: int | None = None
    fetched: bool = False  # a record of it fetched since its assignment
    from_committed: bool = True  # resumes from the group's committed offset
    asked: bool = False  # the group's committed offset asked for
    high_at_assign: int = -1  # the end librdkafka had cached when it was assigned


@dataclass
class KafkaSource:
    """`source = KafkaSource(cfg); await source.open()`, then `fetch`/`commit`; `close()`
    leaves the group (idempotent)."""

    cfg: BridgeConfig
    # Called on the event loop: partitions revoked; a commit's outcome (error or None) once
    # the broker has answered it.
    on_revoked: Callable[[list[TopicPart]], None] | None = None
    on_committed: Callable[[str | None], None] | None = None
    _consumer: Consumer | None = None
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kafka-consumer"))
    _seen: set[TopicPart] = field(default_factory=set)  # assigned before, in this process
    _parts: dict[TopicPart, _PartitionState] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _lag_at: float = 0.0
    _unfetched: int = 0  # assigned partitions with no record fetched since their assignment
    _errors: Throttle = field(default_factory=lambda: Throttle(ERROR_LOG_EVERY_S))
    _watch: AssignmentWatch | None = None
    _watch_at: float = 0.0
    _probe_at: float = 0.0
    _counts: dict[str, int] = field(default_factory=dict)  # partitions per topic (metadata)

    async def open(self) -> None:
        if self._consumer is not None:
            return
        self._loop = asyncio.get_running_loop()
        conf = consumer_config(self.cfg)
        conf["error_cb"] = self._on_error
        conf["on_commit"] = self._on_commit
        consumer = new_client(Consumer, conf)
        self._watch = AssignmentWatch(self.cfg.topics, self.cfg.group_id,
                                      self.cfg.unassigned_grace_s)
        # The first check one interval after the start (the watch's grace covers the join).
        self._watch_at = time.monotonic()
        await self._call(self._subscribe, consumer)
        self._consumer = consumer

    async def fetch(self, max_records: int, timeout_s: float) -> Fetched:
        return await self._call(self._fetch, max_records, timeout_s)

    async def commit(self, offsets: dict[TopicPart, int], *, wait: bool = False) -> None:
        """Commit next-offsets; its outcome comes to `on_committed` (and a synchronous
        commit that fails also raises `KafkaException`)."""
        await self._call(self._commit, offsets, wait)

    async def close(self) -> None:
        """Leave the group and close, bounded by `drain_timeout_s` + the session timeout:
        librdkafka's `close()` has no timeout of its own, and one that never returns must not
        hold the bridge's shutdown (or its process's exit) with it."""
        consumer, self._consumer = self._consumer, None
        bound_s = self.cfg.drain_timeout_s + self.cfg.session_timeout_ms / 1000
        idle = True
        if consumer is not None:
            # A barrier: the calls queued before it (a last fetch) have returned; the
            # consumer must not be closed while another thread is inside it.
            try:
                async with asyncio.timeout(bound_s):
                    await self._call(lambda: None)
            except TimeoutError:
                idle = False
        self._executor.shutdown(wait=False)
        if consumer is None:
            return
        if not idle:
            log.warning("Kafka consumer still busy at close: left open (the group takes its "
                        "partitions back when the session times out)", waited_s=bound_s)
        elif not await in_daemon_thread(partial(leave_group, consumer, bound_s), bound_s,
                                        "kafka-consumer-close"):
            log.warning("Kafka consumer did not close in time: the group takes its partitions "
                        "back when the session times out", waited_s=bound_s,
                        kafka=self.cfg.kafka_bootstrap)

    # -- on the consumer's thread ---------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kw))

    def _subscribe(self, consumer: Consumer) -> None:
        consumer.subscribe(list(self.cfg.topics), on_assign=self._on_assign,
                           on_revoke=self._on_revoke, on_lost=self._on_revoke)

    def _fetch(self, max_records: int, timeout_s: float) -> Fetched:
        consumer = self._consumer
        assert consumer is not None
        # `consume(n, t)` waits the whole of t unless n records come: poll for the first
        # (returns as soon as one is there), then take what else is queued without waiting.
        first = consumer.poll(timeout_s)
        records: list[Message] = []
        if first is not None:
            records.append(first)
            if max_records > 1:
                records += consumer.consume(max_records - 1, 0)
        good = [m for m in records if m.error() is None]
        if self._unfetched:
            self._note_start_offsets(good)
        for m in records:
            if (err := m.error()) is not None:
                log.warning("Kafka consumer error", error=err.str(), topic=m.topic(),
                            partition=m.partition())
        lag: dict[TopicPart, int] = {}
        now = time.monotonic()
        if now - self._lag_at >= LAG_EVERY_S:
            self._lag_at = now
            if self._unfetched:
                self._check_starts(consumer)
            lag = self._lag(consumer)
        checks: list[TopicCheck] = []
        if self._watch is not None and now - self._watch_at >= self.cfg.watch_interval_ms / 1000:
            self._watch_at = now
            checks, resubscribe = self._watch.check(consumer, self._parts.keys(), now)
            self._counts.update((c.topic, c.partitions) for c in checks)
            if resubscribe:
                # Leaving the group and joining it again: the group rebalances, and its
                # leader assigns from metadata as it is now.
                consumer.unsubscribe()
                self._subscribe(consumer)
        caught_up = None
        if (first is None and self._parts
                and now - self._probe_at >= self.cfg.caught_up_interval_ms / 1000):
            self._probe_at = now
            caught_up = self._probe(consumer)
        return Fetched(records=good, lag=lag, assigned=bool(self._parts), checks=checks,
                       caught_up=caught_up)

    def _probe(self, consumer: Consumer) -> Probe | None:
        """Caught up on every partition held? (`freshness.watermark`). The topics'
        partition counts are the watch's (none before its first check): a metadata
        request of a topic of its own here would have librdkafka take up a topic created
        again before the watch sees it held by nobody."""
        resume: dict[TopicPart, int | None] = {}
        for key, s in self._parts.items():
            if not s.from_committed or s.fetched:
                resume[key] = None  # only its position tells (a record consumed, or not)
            elif s.committed is not None:
                resume[key] = s.committed
            else:
                resume[key] = FROM_START if s.asked else None
        try:
            return probe(consumer, resume, self._counts, now_ms())
        except KafkaException as exc:  # not known to be caught up: ask again later
            self._probe_at = time.monotonic() + PROBE_BACKOFF_S
            log.debug("Kafka did not answer the caught-up probe", error=str(exc))
            return None

    def _note_start_offsets(self, records: list[Message]) -> None:
        """A partition's first record fetched since its assignment is where it really
        starts (the group's committed offset, where `--start` put it, or where an
        out-of-range reset did): until we commit, the committed offset the lag counts from."""
        for m in records:
            state = self._parts.get((m.topic() or "", m.partition() or 0))
            if state is not None and not state.fetched:
                state.fetched = True
                state.committed = m.offset()
                self._unfetched -= 1
                if not self._unfetched:
                    return

    def _check_starts(self, consumer: Consumer) -> None:
        """Partitions assigned and not fetched from yet, resuming from the group's committed
        offset: ask for it (the lag counts from it at once, not only from the first record),
        and start from the beginning one whose committed offset is past its end
        (`kafka_watch.past_end`), saying so."""
        waiting = {key: s for key, s in self._parts.items()
                   if s.from_committed and not s.fetched}
        ask = [TopicPartition(t, p) for (t, p), s in waiting.items() if not s.asked]
        if ask:
            try:
                for tp in consumer.committed(ask, timeout=1.0):
                    state = waiting[(tp.topic, tp.partition)]
                    state.asked = True
                    state.committed = tp.offset if tp.offset >= 0 else None
            except KafkaException as exc:  # Kafka away: asked again in LAG_EVERY_S
                log.debug("Kafka committed offsets not known yet", error=str(exc))
        for (topic, p), state in waiting.items():
            try:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
            except KafkaException:
                continue
            if not past_end(state.committed, high, state.high_at_assign):
                continue
            log.warning(
                "the group's committed offset is past the partition's end: the broker lost "
                "the log it was committed against (a restart with memory storage, the topic "
                "created again). Bridging the partition from its beginning: what JetStream "
                "has already (within its duplicate window) is dropped as duplicates",
                topic=topic, partition=p, committed=state.committed, end=high,
                group=self.cfg.group_id)
            try:
                consumer.seek(TopicPartition(topic, p, OFFSET_BEGINNING))
            except KafkaException as exc:
                log.warning("Kafka seek to the partition's beginning failed: will try again",
                            topic=topic, partition=p, error=str(exc))
                continue
            state.committed = max(low, 0)
            state.from_committed = False

    def _lag(self, consumer: Consumer) -> dict[TopicPart, int]:
        lag: dict[TopicPart, int] = {}
        unknown = [TopicPartition(t, p) for (t, p), s in self._parts.items()
                   if s.committed is None]
        positions = {(tp.topic, tp.partition): tp.offset
                     for tp in (consumer.position(unknown) if unknown else [])}
        for (topic, p), state in self._parts.items():
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
            at = state.committed if state.committed is not None else positions.get((topic, p))
            if high >= 0 and at is not None and at >= 0:
                lag[(topic, p)] = max(high - at, 0)
        return lag

    def _commit(self, offsets: dict[TopicPart, int], wait: bool) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        # Only partitions still ours: a commit for one revoked meanwhile could move back the
        # offset its new owner committed (its records would come again, as duplicates).
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items() if (t, p) in self._parts]
        if not tps:
            return
        if wait:
            consumer.commit(offsets=tps, asynchronous=False)
        else:
            consumer.commit(offsets=tps, asynchronous=True)
        for tp in tps:
            self._parts[(tp.topic, tp.partition)].committed = tp.offset

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        start = self.cfg.start
        for tp in partitions:
            key = (tp.topic, tp.partition)
            old = self._parts.get(key)
            if old is None or old.fetched:
                self._unfetched += 1
            try:
                _low, high = consumer.get_watermark_offsets(tp, cached=True)
            except KafkaException:  # nothing cached: any end fetched later is new
                high = -1
            state = self._parts[key] = _PartitionState(high_at_assign=high)
            if start is not StartFrom.COMMITTED and key not in self._seen:
                tp.offset = OFFSET_BEGINNING if start is StartFrom.EARLIEST else OFFSET_END
                state.from_committed = False
            self._seen.add(key)
        consumer.assign(partitions)
        log.info("Kafka partitions assigned", start=start.value,
                 partitions=[f"{tp.topic}[{tp.partition}]" for tp in partitions])

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = [(tp.topic, tp.partition) for tp in partitions]
        for key in gone:
            state = self._parts.pop(key, None)
            if state is not None and not state.fetched:
                self._unfetched -= 1
        if self.on_revoked is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_revoked, gone)
        log.info("Kafka partitions revoked", partitions=[f"{t}[{p}]" for t, p in gone])

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        failed = [f"{tp.topic}[{tp.partition}]: {tp.error.str()}" for tp in partitions
                  if tp.error is not None]
        error = err.str() if err is not None else ("; ".join(failed) if failed else None)
        if self.on_committed is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_committed, error)

    def _on_error(self, err: KafkaError) -> None:
        held = self._errors.allow(err.name())
        if held is not None or err.fatal():
            log.warning("Kafka client error", error=err.str(), code=err.name(),
                        fatal=err.fatal(), kafka=self.cfg.kafka_bootstrap,
                        repeats_not_logged=held or 0)


def leave_group(consumer: Consumer, within_s: float) -> None:
    """Give the partitions back while the group still runs, then close.

    librdkafka's `close()` revokes what is still assigned and has the rebalance callback
    unassign it; confluent-kafka makes that unassign (`rd_kafka_assign`, and
    `rd_kafka_rebalance_protocol` before it) holding the GIL, and inside a close either can
    wait forever for a group that is already shutting down (librdkafka issues 4041 and 4884):
    the whole process stops, not just this thread (seen as a test run frozen in
    `consumer.close()`). Unsubscribed first, the revoke comes through `poll` and its unassign is
    answered by a live group; `close()` then has nothing to revoke. Records a poll returns
    meanwhile are dropped: never committed, the partitions' next owner reads them."""
    until = time.monotonic() + within_s / 2
    try:
        consumer.unsubscribe()
        while consumer.assignment() and time.monotonic() < until:
            consumer.poll(LEAVE_POLL_S)
    except (KafkaException, RuntimeError) as exc:  # close() still runs (and says why)
        log.warning("Kafka group not left before close", error=str(exc))
    consumer.close()


async def in_daemon_thread(fn: Callable[[], object], timeout_s: float, name: str) -> bool:
    """Run `fn` on a daemon thread of its own and wait up to `timeout_s`: True when it
    returned (its errors from librdkafka are logged), False when it is still running (it is
    left there; a daemon thread does not hold the process at exit, an executor's would)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            fn()
        except (KafkaException, RuntimeError) as exc:
            log.warning("Kafka close failed", error=str(exc), call=name)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                loop.call_soon_threadsafe(finished)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        async with asyncio.timeout(timeout_s):
            await done
        return True
    except TimeoutError:
        return False


KafkaHeaders = list[tuple[str, str | bytes | None]]


def record_headers(m: Message) -> list[tuple[str, bytes | None]]:
    """A consumed record's headers as (name, value) pairs, in order."""
    raw = m.headers()
    if not raw:
        return []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    key: bytes | None
    value: bytes | None
    headers: KafkaHeaders


class DeadLetterSink:
    """Dead letters to a Kafka topic, each acknowledged by Kafka (`acks=all`) before `send`
    returns; failures are retried with backoff, so a round never commits past a dead letter
    Kafka does not have. At least once: a crash between this and the round's commit sends
    it again on the next run."""

    def __init__(self, cfg: BridgeConfig, topic: str) -> None:
        self.cfg = cfg
        self.topic = topic
        self._producer = new_client(Producer, client_config(
            cfg.kafka_bootstrap, cfg.security,
            **{"client.id": "plane-bridge-dead-letters", "acks": "all",
               "enable.idempotence": True, "linger.ms": 5,
               "message.timeout.ms": int(cfg.publish_timeout_s * 1000) + 5_000}))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kafka-dead-letters")

    async def send(self, letters: Sequence[DeadLetter], stopping: Callable[[], bool]) -> bool:
        """True once Kafka has every letter; False if `stopping()` turned true first."""
        loop = asyncio.get_running_loop()
        todo = list(letters)
        backoff_s = self.cfg.retry_backoff_s
        while todo:
            todo = await loop.run_in_executor(self._executor, self._send_once, todo)
            if not todo:
                return True
            if stopping():
                return False
            log.warning("Kafka dead letters not delivered: retrying", topic=self.topic,
                        count=len(todo), retry_in_s=backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.cfg.retry_backoff_max_s)
        return True

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._producer.flush, 5.0)
        self._executor.shutdown(wait=False)

    def _send_once(self, letters: list[DeadLetter]) -> list[DeadLetter]:
        failed: list[DeadLetter] = []
        done = 0

        def report(letter: DeadLetter) -> Callable[[KafkaError | None, Message], None]:
            def on_delivery(err: KafkaError | None, _msg: Message) -> None:
                nonlocal done
                done += 1
                if err is not None:
                    failed.append(letter)
                    log.warning("Kafka dead letter failed", error=err.str(), topic=self.topic)
            return on_delivery

        for letter in letters:
            while True:
                try:
                    self._producer.produce(self.topic, value=letter.value, key=letter.key,
                                           headers=letter.headers,
                                           on_delivery=report(letter))
                    break
                except BufferError:  # the producer's queue is full: let it drain
                    self._producer.poll(0.05)
        deadline = time.monotonic() + self.cfg.publish_timeout_s + 6.0
        while done < len(letters) and time.monotonic() < deadline:
            self._producer.flush(0.5)
        if done < len(letters):  # not even a failure report: treat all as undelivered
            return letters
        return failed
