"""The bridge's side of a caught-up watermark (`freshness.watermark`): whether its consumer
has reached the end of every partition it holds, asked of Kafka on the consumer's thread.

Apart from the watermark's messages and the updater's bookkeeping because it needs the Kafka
client (confluent-kafka, the `bridge` extra): the feature updater, the guard and `plane
features` read watermarks without it (the base install has no Kafka client).
"""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from freshness.watermark import Probe, TopicPart

# Each ListOffsets of the probe waits at most this (the consumer's thread waits with it;
# there is nothing to fetch meanwhile, or the probe would not run).
PROBE_TIMEOUT_S = 0.5
# After a probe Kafka did not answer (a broker down, a topic gone), the next waits this long:
# a dead broker would otherwise hold the consumer's thread in probes, and asking for the
# ends of a topic gone again and again had librdkafka take it up again before the
# assignment watch saw it held by nobody.
PROBE_BACKOFF_S = 5.0
# Where a partition resumes when nothing of it was consumed since its assignment: its
# beginning (no committed offset: `auto.offset.reset=earliest`).
FROM_START = OFFSET_BEGINNING


def probe(consumer: Consumer, resume: Mapping[TopicPart, int | None],
          counts: Mapping[str, int], now_ms: int) -> Probe | None:
    """On the consumer's thread. `resume`: every partition held, with where it resumes
    when nothing of it was consumed yet (a committed offset, `FROM_START`, or None: not
    known yet). `counts`: each topic's partitions. `now_ms`: the wall clock, read by the
    caller before this call. A Probe when the position of each has reached its end as Kafka
    says it now, else None. Raises `KafkaException` when Kafka does not answer in time."""
    if not resume or any(counts.get(t, 0) <= 0 for t, _p in resume):
        return None
    tps = [TopicPartition(t, p) for t, p in resume]
    positions = {(tp.topic, tp.partition): tp.offset for tp in consumer.position(tps)}
    held: dict[str, list[int]] = {}
    for tp in tps:
        key = (tp.topic, tp.partition)
        low, high = consumer.get_watermark_offsets(tp, timeout=PROBE_TIMEOUT_S, cached=False)
        _low, cached_high = consumer.get_watermark_offsets(tp, cached=True)
        at = positions.get(key, -1)
        if at < 0:  # nothing consumed since the assignment: where it resumes
            fallback = resume[key]
            if fallback is None:
                return None
            at = max(low, 0) if fallback == FROM_START else fallback
        if high < 0 or at < max(high, cached_high):
            return None
        held.setdefault(tp.topic, []).append(tp.partition)
    return Probe(at_ms=now_ms, held={t: sorted(ps) for t, ps in held.items()},
                 counts={t: counts[t] for t in held})
