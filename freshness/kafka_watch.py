"""The bridge's watch on its Kafka assignment, run on the consumer's thread (every call here
is a call on the consumer: see `freshness.kafka_client`).

A broker that lost its log (tansu keeps it in memory) comes back without the topic; the
group rebalances at once and hands this bridge nothing, and when the topic is created again
librdkafka only notices at its next metadata refresh. With librdkafka's default refresh (5
minutes) a bridge was seen holding no partition for 12+ minutes, bridging nothing, with no
warning and no lag series (its lag is per partition it holds). The refresh is now seconds
(`BridgeConfig.metadata_refresh_ms`); this watch makes the state visible and, should it last
anyway, ends it:

- every `watch_interval_ms`: how many partitions each topic has and how many this bridge
  holds (`plane_bridge_topic_partitions`, `plane_bridge_assigned_partitions`: summed over
  every bridge of a group, the assigned must equal the topic's);
- a topic of which it holds none while it has some: the group's lag on each of its
  partitions (the partition's end minus the group's committed offset, or minus its start
  where the group has none), reported as `plane_bridge_consumer_lag_records`, so that a stuck
  backlog shows there; a warning past `unassigned_grace_s`, again every `WARN_EVERY_S`;
- past the grace, with a backlog whose committed offsets did not move since the last check
  (no member of the group is bridging it), the bridge subscribes again, which makes the group
  rebalance; then again only after twice as long (up to `RESUBSCRIBE_MAX_S`), so that a
  group whose owner is merely stalled (its NATS down) is not rebalanced every few seconds.

Holding none of a topic's partitions is normal for a bridge beside others in its group with
more bridges than partitions: the warning says so, and such a bridge reports the group's
lag of partitions another member holds (the same value as that member's: aggregate the
series with `max`, not `sum`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import structlog
from confluent_kafka import Consumer, KafkaException, TopicPartition

log = structlog.get_logger("freshness.kafka")

TopicPart = tuple[str, int]

# Each metadata, committed-offset or list-offsets request of the watch waits at most this:
# the consumer's thread, and with it the fetching, waits meanwhile.
REQUEST_TIMEOUT_S = 1.0
WARN_EVERY_S = 60.0
RESUBSCRIBE_MAX_S = 300.0


@dataclass(frozen=True, slots=True)
class TopicCheck:
    """One topic, as the watch found it."""

    topic: str
    partitions: int  # the topic has (0: it does not exist, as far as the broker says)
    assigned: frozenset[int]  # the partitions of it this bridge holds
    # Only while this bridge holds none of it though it has partitions: the group's lag per
    # partition (what nobody may be bridging).
    group_lag: dict[int, int] = field(default_factory=dict)


@dataclass
class _Unheld:
    """A topic of which this bridge holds no partition, though it has some."""

    since: float
    warned_at: float | None = None
    committed: dict[int, int] | None = None  # the group's, at the last check
    resubscribe_after_s: float = 0.0
    resubscribed_at: float | None = None


@dataclass
class AssignmentWatch:
    topics: tuple[str, ...]
    group_id: str
    grace_s: float
    _unheld: dict[str, _Unheld] = field(default_factory=dict)

    def check(self, consumer: Consumer, assigned: Collection[TopicPart],
              now: float | None = None) -> tuple[list[TopicCheck], bool]:
        """The topics as found, and whether to subscribe again. A topic whose metadata the
        broker did not give in time (down, restarting) is left out."""
        now = time.monotonic() if now is None else now
        checks: list[TopicCheck] = []
        resubscribe = False
        for topic in self.topics:
            count = partition_count(consumer, topic)
            if count is None:
                continue
            held = frozenset(p for t, p in assigned if t == topic)
            if held or not count:
                self._held_again(topic, now)
                checks.append(TopicCheck(topic, count, held))
                continue
            lag, committed = _group_lag(consumer, topic, count)
            checks.append(TopicCheck(topic, count, held, lag))
            resubscribe |= self._unheld_for(topic, now, lag, committed)
        return checks, resubscribe

    def _unheld_for(self, topic: str, now: float, lag: dict[int, int],
                    committed: dict[int, int]) -> bool:
        state = self._unheld.setdefault(topic, _Unheld(since=now,
                                                       resubscribe_after_s=self.grace_s))
        moved = state.committed is not None and committed != state.committed
        state.committed = committed
        for_s = now - state.since
        if for_s < self.grace_s:
            return False
        backlog = sum(lag.values())
        if state.warned_at is None or now - state.warned_at >= WARN_EVERY_S:
            state.warned_at = now
            log.warning(
                "this bridge holds no partition of a topic that has some: unless another "
                "bridge of its group holds them, nothing of it is bridged (check the group "
                "with your Kafka tools; restarting the bridge makes it join again)",
                topic=topic, group=self.group_id, for_s=round(for_s, 1),
                group_lag_records=backlog)
        since = state.resubscribed_at if state.resubscribed_at is not None else state.since
        if backlog and not moved and now - since >= state.resubscribe_after_s:
            state.resubscribed_at = now
            state.resubscribe_after_s = min(state.resubscribe_after_s * 2, RESUBSCRIBE_MAX_S)
            log.warning("subscribing again: a backlog no member of the group moves",
                        topic=topic, group=self.group_id, group_lag_records=backlog,
                        next_try_after_s=state.resubscribe_after_s)
            return True
        return False

    def _held_again(self, topic: str, now: float) -> None:
        state = self._unheld.pop(topic, None)
        if state is not None and state.warned_at is not None:
            log.info("this bridge holds partitions of the topic again", topic=topic,
                     after_s=round(now - state.since, 1))


def partition_count(consumer: Consumer, topic: str) -> int | None:
    try:
        meta = consumer.list_topics(topic, timeout=REQUEST_TIMEOUT_S)
    except KafkaException:
        return None
    found = meta.topics.get(topic)
    if found is None or found.error is not None:
        return 0
    return len(found.partitions)


def _group_lag(consumer: Consumer, topic: str, count: int
               ) -> tuple[dict[int, int], dict[int, int]]:
    """The group's lag per partition and its committed offsets (absent: none committed).
    tansu 0.6 answers the end (ListOffsets latest) with the base offset of the partition's
    last batch plus one: its lag here can be short of the records waiting, never above."""
    tps = [TopicPartition(topic, p) for p in range(count)]
    try:
        committed = {tp.partition: tp.offset
                     for tp in consumer.committed(tps, timeout=REQUEST_TIMEOUT_S)
                     if tp.offset >= 0}
    except KafkaException:
        return {}, {}
    lag: dict[int, int] = {}
    for tp in tps:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=REQUEST_TIMEOUT_S,
                                                       cached=False)
        except KafkaException:
            continue
        if high >= 0:
            start = committed.get(tp.partition, max(low, 0))
            lag[tp.partition] = max(high - start, 0)
    return lag, committed


def past_end(committed: int | None, high: int, high_at_assign: int) -> bool:
    """The group's committed offset is past the partition's end: the broker lost the log
    the offset was committed against (tansu with memory storage keeps offsets no longer, a
    topic deleted and created again under a broker that kept them). Fetching there waits
    for the new log to reach it and skips everything before, silently (tansu answers such
    a fetch with no records and no error, and Kafka's own out-of-range reset would skip to
    the end under `auto.offset.reset=latest`). `high` counts only once it is not the value
    cached at the assignment: a value from before (this process held the partition earlier,
    and another member has bridged further since) would be taken for a loss."""
    if committed is None or committed < 0 or high < 0:
        return False
    return high != high_at_assign and committed > high
