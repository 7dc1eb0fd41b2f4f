"""Caught-up watermarks: how the freshness guard tells a pipeline that is idle and caught up
from one that is stalled.

The guard's age is "how far behind the pipeline is". Records carry it while they flow (their
ingest stamps), but a quiet topic sends none, and the newest ingest stamp then only ages: a
caught-up pipeline with nothing to say read as stale after `freshness_ms` of silence, and
every card request degraded (found from outside). So each stage says, while it is caught up,
up to when it is:

1. The bridge, every `caught_up_interval_ms`, when its last poll brought nothing,
   `freshness.kafka_probe.probe` asks Kafka for the end (high watermark) of every partition
   it holds, on the consumer's thread, and compares the consumer's position with it (and
   with the end librdkafka has cached). When every one is reached, and every record fetched
   so far is acknowledged by JetStream, it publishes a `CaughtUp` on
   `<prefix>.caughtup.<stream>` (core NATS): "at `caught_up_ms` I had taken every record
   Kafka held of these partitions, and the last event of the topic I published is stream
   sequence `event_seq`". `caught_up_ms` is taken before the ends are asked for, so it is
   never later than the truth. A broker that does not answer (dead, restarting), a partition
   behind its end, or rounds JetStream has not acknowledged: no watermark. A bridge holding
   nothing says nothing.
2. The feature updater takes a `CaughtUp` only once it has applied the stream up to
   `event_seq`, has nothing pending in its consumer, and has no failed round waiting for
   redelivery (`TopicMarks`). It keeps one stamp per partition (several bridges of a group
   each speak for the partitions they hold, never for another's) and the topic's partition
   count; the topic's watermark is the oldest stamp over all its partitions, none while a
   partition has none (unheld, or held by a bridge that is behind). It writes that to the
   features bucket, key `_caughtup.<stream>` (`TopicWatermark`), when it moves.
3. The guard takes age = now - max(newest ingest stamp of any card, oldest topic watermark
   in the bucket). A stalled stage stops its stamps and the age grows again from the last
   one: a dead bridge, a broker gone, a bridge behind its partitions' end, a dead updater.

The oldest watermark over topics, not the newest: the guard does not know a card's topic.
A topic no longer bridged keeps its key, whose stamp then only ages: the guard falls back to
the ingest stamps alone (the behaviour before watermarks); delete the key
(`nats kv del PLANE_FEATURES _caughtup.<stream>`) when a topic is retired. The lag check is
per card and unchanged. Events published to the stream by anything but a bridge (a test, a
replay tool) bring no watermark: the ingest stamps alone count for them.

Cost, per bridge: one ListOffsets request per held partition, one core message, every
`caught_up_interval_ms` (50 ms) while the topic is quiet; nothing while records flow (their
own stamps do the work). Per topic: one KV write per watermark that moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

TopicPart = tuple[str, int]

class CaughtUp(msgspec.Struct, frozen=True, kw_only=True):
    """A bridge's watermark: JSON on `<prefix>.caughtup.<stream>`."""

    topic: str
    partitions: list[int]  # the topic's partitions this bridge holds: every one caught up
    partition_count: int  # the topic's, as the broker's metadata last said
    caught_up_ms: int  # epoch ms: every record Kafka held of them then is in JetStream
    event_seq: int = 0  # stream sequence of the topic's last event this bridge published


class TopicWatermark(msgspec.Struct, frozen=True, kw_only=True):
    """Value of key `_caughtup.<stream>` in the features bucket: every record the topic's
    bridges took from Kafka up to `caught_up_ms` is in the cards' values."""

    topic: str
    caught_up_ms: int


caught_up_decoder = msgspec.json.Decoder(CaughtUp)
watermark_decoder = msgspec.json.Decoder(TopicWatermark)


@dataclass(frozen=True, slots=True)
class Probe:
    """The bridge caught up on every partition it holds, as of `at_ms`."""

    at_ms: int
    held: dict[str, list[int]]  # per topic, its partitions this bridge holds
    counts: dict[str, int]  # per topic, its partitions (the broker's metadata)


class TopicMarks:
    """The feature updater's view of its topic's bridges' watermarks (pure: no clock, no
    I/O). `take` each `CaughtUp` as it comes; `settle` whenever the updater's progress
    moved; `watermark` is the topic's, or None."""

    def __init__(self) -> None:
        self._stamps: dict[int, int] = {}  # partition: caught-up epoch ms
        self._count = 0
        # Watermarks not usable yet (the updater has not applied their events), the newest
        # per bridge (per set of partitions held): a newer one says more than an older.
        self._waiting: dict[tuple[int, ...], CaughtUp] = {}

    def take(self, mark: CaughtUp) -> None:
        key = tuple(mark.partitions)
        old = self._waiting.get(key)
        if old is None or mark.caught_up_ms >= old.caught_up_ms:
            self._waiting[key] = mark

    def settle(self, *, applied_seq: int, caught_up: bool) -> None:
        """`applied_seq`: the updater has applied (written and acked) every event of the
        topic up to this stream sequence; `caught_up`: its consumer has nothing pending and
        no failed round waits for redelivery."""
        if not caught_up:
            return
        for key, mark in list(self._waiting.items()):
            if mark.event_seq > applied_seq:
                continue
            del self._waiting[key]
            self._count = mark.partition_count
            for p in mark.partitions:
                self._stamps[p] = max(self._stamps.get(p, 0), mark.caught_up_ms)

    def watermark(self) -> int | None:
        """The oldest stamp over the topic's partitions; None while one has none."""
        if self._count <= 0:
            return None
        stamps = [self._stamps.get(p) for p in range(self._count)]
        if any(s is None for s in stamps):
            return None
        return min(s for s in stamps if s is not None)
