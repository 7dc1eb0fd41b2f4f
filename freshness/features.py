"""The feature updater: bridged transactions (`<prefix>.events.<topic>`) into per-card
features in the KV bucket `PLANE_FEATURES` (key: the card id; value: `CardFeatures` JSON,
stamped with the event and ingest times of the newest event applied).

Updates commute (count, sums, maxima; "last" by event time), so a record that reaches the
stream out of order (a bridge retry) still gives the same features. A redelivered event (an
updater that died between its KV write and its ack) is skipped by its stream sequence.

It works in rounds: fetch up to `batch` events, apply them in memory, write each touched card
once, then ack the round. A write that fails leaves the round unacked: JetStream delivers it
again after `ack_wait_s`.

It also relays its topic's caught-up watermark (`freshness.watermark`): the bridges' word,
on `<prefix>.caughtup.<stream>`, that they have taken everything Kafka held of their
partitions as of a time, taken once this updater has applied every event before it, and
written to the bucket (key `_caughtup.<stream>`) when the topic's oldest partition stamp
moves. The guard reads a quiet topic as fresh by it.

One updater per topic (`plane features`, or the one `plane risk-demo` runs): each keeps the
cards it wrote in memory and writes a card's whole value, and skips what its stream sequence
says it applied, so two sharing the durable consumer would each write a card without the
other's events. A second one refuses to start (`UpdaterRunning`); a restarted one resumes
where the durable consumer's acks left it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from freshness.config import UpdaterConfig
from freshness.provision import ensure_events_stream, ensure_features_bucket, events_stream_config
from freshness.records import CardFeatures, Stamps, Transaction, json_encoder, transaction_decoder
from freshness.watermark import TopicMarks, TopicWatermark, caught_up_decoder
from plane.contract.errors import ConfigError
from plane.contract.lifecycle import Lifecycle, finish_or_cancel
from plane.contract.messages import FEATURES
from plane.contract.provision import at_start

log = structlog.get_logger("freshness.features")

AMOUNT_SCALE = 1000.0
# How many times a starting updater looks for another one's pulls waiting on the durable
# consumer, `fetch_timeout_s` apart (a running one leaves a pull there for all but the time
# it takes to apply a round).
_LOOKS_FOR_A_SECOND = 6


class UpdaterRunning(ConfigError):
    """Another feature updater of this topic is running (its pulls wait on the durable
    consumer): run one per topic."""


def feature_vector(count: int, amount_sum: float, amount_max: float, last: float,
                   own: list[float]) -> list[float]:
    """The 32 numbers the guard hands to the model: history summaries, then the last
    transaction's own features, zero-padded."""
    head = [
        math.log1p(count) / 10,
        amount_sum / max(count, 1) / AMOUNT_SCALE,
        amount_max / AMOUNT_SCALE,
        last / AMOUNT_SCALE,
    ]
    out = head + list(own[: FEATURES - len(head)])
    return out + [0.0] * (FEATURES - len(out))


def apply_event(prev: CardFeatures | None, txn: Transaction, stamps: Stamps,
                seq: int) -> CardFeatures | None:
    """The card's features after one more event, or None when `seq` was applied already."""
    if prev is not None and seq <= prev.seq:
        return None
    count = (prev.count if prev else 0) + 1
    amount_sum = (prev.amount_sum if prev else 0.0) + txn.amount
    amount_max = max(prev.amount_max if prev else txn.amount, txn.amount)
    # "Last" is by event time; the stamps are those of the newest arrival (ingest time), so
    # that a late record makes the value show its lag.
    stamped: Stamps | None
    if prev is None:
        last, own, stamped = txn.amount, txn.features, stamps
    else:
        newest_event = stamps.event_time_ms >= prev.last_event_time_ms
        last = txn.amount if newest_event else prev.last_amount
        own = txn.features if newest_event else prev.values[4:]
        stamped = stamps if stamps.ingest_time_ms >= prev.ingest_time_ms else None
    # The times of the newest ingest: this record's, or (an older one came late) the
    # previous value's.
    event_ms, ingest_ms = ((stamped.event_time_ms, stamped.ingest_time_ms) if stamped
                           else (prev.event_time_ms, prev.ingest_time_ms) if prev is not None
                           else (stamps.event_time_ms, stamps.ingest_time_ms))
    return CardFeatures(
        card=txn.card,
        values=feature_vector(count, amount_sum, amount_max, last, own),
        event_time_ms=event_ms,
        ingest_time_ms=ingest_ms,
        last_event_time_ms=max(stamps.event_time_ms, prev.last_event_time_ms if prev else 0),
        count=count, amount_sum=amount_sum, amount_max=amount_max, last_amount=last, seq=seq,
    )


class FeatureUpdater(Lifecycle):
    """`async with FeatureUpdater(nc, UpdaterConfig(topic=...)):` keeps features current."""

    def __init__(self, nc: Client, config: UpdaterConfig) -> None:
        self.cfg = config
        self.names = config.names
        self._nc = nc
        self._js = nc.jetstream()
        self._kv: KeyValue | None = None
        self._cache: dict[str, CardFeatures] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.applied = 0
        self.skipped = 0
        self.rounds = 0
        # The caught-up watermark (`freshness.watermark`): what the updater has applied,
        # whether its consumer had anything pending at its last fetch, the sequences of
        # failed rounds not redelivered yet, and the watermark last written.
        self._marks = TopicMarks()
        self._marks_sub: Subscription | None = None
        self._applied_seq = 0
        self._pending = 1  # not known to be caught up until a first fetch says so
        self._failed: set[int] = set()
        self._lock = asyncio.Lock()
        self.watermark_ms = 0

    async def start(self) -> None:
        if self._task is not None:
            return
        replicas = self.cfg.replicas
        await at_start(lambda: ensure_events_stream(
            self._js, events_stream_config(self.names, replicas=replicas), update=False),
            who="feature updater")
        self._kv = await at_start(
            lambda: ensure_features_bucket(self._js, self.names, replicas=replicas),
            who="feature updater")
        stream = self.cfg.stream
        durable = self.names.features_consumer(stream)
        if self.cfg.refuse_a_second:
            await self._refuse_a_second(durable)
        self._sub = await self._js.pull_subscribe(
            self.names.events(stream),
            durable=durable,
            stream=self.names.events_stream,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.cfg.ack_wait_s, max_ack_pending=-1,
            ),
        )
        self._marks_sub = await self._nc.subscribe(self.names.caught_up(stream),
                                                   cb=self._on_caught_up)
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name="feature-updater")

    async def _refuse_a_second(self, durable: str) -> None:
        for _ in range(_LOOKS_FOR_A_SECOND):
            try:
                info = await self._js.consumer_info(self.names.events_stream, durable)
            except NotFoundError:
                return  # never run before: nobody else either
            if info.num_waiting:
                raise UpdaterRunning(
                    f"another feature updater is running for topic {self.cfg.topic!r} (its "
                    f"pulls wait on the durable consumer {durable} of "
                    f"{self.names.events_stream}): run one per topic, since two would each "
                    "write a card's features without the other's events. If it was stopped "
                    "just now, start this one again in a second")
            await asyncio.sleep(self.cfg.fetch_timeout_s)

    async def stop(self) -> None:
        """Finish the round in flight (its writes and acks), then leave."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        await finish_or_cancel(task, self.cfg.ack_wait_s)
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()
        marks, self._marks_sub = self._marks_sub, None
        if marks is not None:
            with contextlib.suppress(nats.errors.Error):
                await marks.unsubscribe()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                # Bounded twice: nats-py's own timeout, and ours in case a pull is lost.
                async with asyncio.timeout(self.cfg.fetch_timeout_s + 1.0):
                    msgs = await self._sub.fetch(self.cfg.batch,
                                                 timeout=self.cfg.fetch_timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                self._pending = 0  # nothing came: nothing was pending
                await self._relay_watermark()
                continue
            except nats.errors.Error as exc:
                log.warning("feature fetch failed: retrying", error=repr(exc))
                await asyncio.sleep(0.2)
                continue
            try:
                await self._round(msgs)
            except nats.errors.Error as exc:
                # Unacked: redelivered after ack_wait. Forget the cache (it may be ahead),
                # and say nothing caught up until these have come again.
                self._cache.clear()
                self._failed.update(m.metadata.sequence.stream for m in msgs)
                log.warning("feature round failed: will be redelivered", error=repr(exc))
                await asyncio.sleep(0.2)

    async def _round(self, msgs: list[Msg]) -> None:
        assert self._kv is not None
        touched: dict[str, CardFeatures] = {}
        for msg in msgs:
            try:
                txn = transaction_decoder.decode(msg.data)
                stamps = Stamps.from_headers(msg.headers)
            except (msgspec.DecodeError, ValueError) as exc:
                log.warning("event ignored", subject=msg.subject, error=str(exc))
                continue
            prev = touched.get(txn.card) or await self._current(txn.card)
            new = apply_event(prev, txn, stamps, msg.metadata.sequence.stream)
            if new is None:
                self.skipped += 1
                continue
            touched[txn.card] = new
            self.applied += 1
        kv = self._kv
        await asyncio.gather(*(kv.put(card, json_encoder.encode(v)) for card, v in touched.items()))
        self._cache.update(touched)
        for msg in msgs:
            await msg.ack()
        seqs = [m.metadata.sequence.stream for m in msgs]
        if seqs:
            self._failed.difference_update(seqs)
            self._applied_seq = max(self._applied_seq, *seqs)
            self._pending = msgs[-1].metadata.num_pending
        self.rounds += 1
        await self._relay_watermark()
        log.debug("feature round", events=len(msgs), cards=len(touched))

    async def _on_caught_up(self, msg: Msg) -> None:
        try:
            mark = caught_up_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("caught-up watermark ignored", subject=msg.subject, error=str(exc))
            return
        if mark.topic != self.cfg.topic:
            return  # another topic with the same stream token
        self._marks.take(mark)
        await self._relay_watermark()

    async def _relay_watermark(self) -> None:
        """The topic's watermark into the bucket, when it moved (`freshness.watermark`)."""
        async with self._lock:
            self._marks.settle(applied_seq=self._applied_seq,
                               caught_up=self._pending == 0 and not self._failed)
            mark = self._marks.watermark()
            if mark is None or mark <= self.watermark_ms or self._kv is None:
                return
            value = TopicWatermark(topic=self.cfg.topic, caught_up_ms=mark)
            try:
                await self._kv.put(self.names.caught_up_key(self.cfg.stream),
                                   json_encoder.encode(value))
            except nats.errors.Error as exc:  # the next one
                log.debug("caught-up watermark not written", error=repr(exc))
                return
            self.watermark_ms = mark

    async def _current(self, card: str) -> CardFeatures | None:
        cached = self._cache.get(card)
        if cached is not None:
            return cached
        assert self._kv is not None
        try:
            entry = await self._kv.get(card)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return msgspec.json.decode(entry.value, type=CardFeatures)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Unreadable (written by a version that let a sum overflow, or by hand): the
            # card starts over rather than stop every update after it.
            log.warning("card features unreadable: the card starts over", card=card,
                        error=str(exc))
            return None
