"""The bridge when Kafka loses its log: tansu (memory storage) restarted, the topic created
again late, a group offset committed against a log that is gone. Found from outside: after
such a restart the bridge held no partition for 12+ minutes, silently, its lag series gone.
Real tansu and nats-server; records produced with confluent-kafka."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from kafka_fixtures import (
    bridge_config,
    kafka_topic,
    produce,
    subject_messages,
    tansu,
    txn_line,
    wait_count,
)
from nats.aio.client import Client
from structlog.testing import capture_logs

from freshness.bridge import KafkaBridge
from freshness.kafka_config import StartFrom
from freshness.tansu import EmbeddedTansu
from plane.contract.subjects import Header, Names

__all__ = ["kafka_topic", "tansu"]  # fixtures, imported for pytest

NAMES = Names()
# Generous: the fix brings the partition back within seconds (a metadata refresh, then a
# group join of about half the 2.4 s session); before it, never.
BACK_WITHIN_S = 30.0


def _sample(bridge: KafkaBridge, name: str, **labels: str) -> float | None:
    return bridge.metrics.registry.get_sample_value(name, labels)


async def _restart_and_lose_the_topic(tansu: EmbeddedTansu, kafka_topic: Any, topic: str,
                                      gap_s: float) -> None:
    """tansu killed and started again on its port: topics, records and group offsets gone.
    The topic comes back only `gap_s` later (a producer's or an operator's doing), by which
    time the group has rebalanced onto nothing."""
    await tansu.restart(kill=True)
    await asyncio.sleep(gap_s)
    await kafka_topic(topic, partitions=1)


async def _bridged_settled(bridge: KafkaBridge, events: int) -> None:
    """Every record acknowledged and the commit landed, before the broker is killed (see
    tests/test_bridge.py, the restart test: a commit on its way would go to the new broker)."""
    async with asyncio.timeout(10):
        while bridge.stats.events < events:
            await asyncio.sleep(0.01)
    await asyncio.sleep(bridge.cfg.commit_interval_ms / 1000 + 0.4)


@pytest.mark.parametrize("start", [StartFrom.COMMITTED, StartFrom.LATEST])
async def test_the_bridge_takes_its_partition_back_when_the_topic_comes_back_late(
    nc: Client, tansu: EmbeddedTansu, kafka_topic: Any, start: StartFrom
) -> None:
    """Every record of the new log is bridged, from its offset 0: `--start latest` too (its
    later assignments used to start at the end where the group had no offset, and skipped
    what the new log got before the partition came back)."""
    topic = await kafka_topic("transactions", partitions=1)
    subject = NAMES.events(topic)
    async with KafkaBridge(nc, bridge_config(tansu, topic, start=start)) as bridge:
        await bridge.wait_assigned()
        await asyncio.sleep(0.5)  # `latest`: its position at the end before the records
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(12)])
        await wait_count(nc, NAMES, subject, 12, settle_s=0)
        await _bridged_settled(bridge, 12)
        await _restart_and_lose_the_topic(tansu, kafka_topic, topic, gap_s=4.0)
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(100, 105)])
        assert await wait_count(nc, NAMES, subject, 17, timeout_s=BACK_WITHIN_S) == 17
    new = [m for m in await subject_messages(nc, NAMES, subject)
           if json.loads(m.data)["amount"] >= 100]
    assert sorted(int(m.headers[Header.KAFKA_OFFSET]) for m in new) == [0, 1, 2, 3, 4]


async def test_a_bridge_left_without_partitions_warns_shows_the_backlog_and_joins_again(
    nc: Client, tansu: EmbeddedTansu, kafka_topic: Any
) -> None:
    """With librdkafka's own metadata refresh (5 minutes, as before the fix) the bridge
    would hold nothing for minutes: its watch warns, reports the topic's partitions against
    the held ones and the group's lag of the waiting records, then subscribes again."""
    topic = await kafka_topic("transactions", partitions=1)
    subject = NAMES.events(topic)
    cfg = bridge_config(tansu, topic, metadata_refresh_ms=300_000, watch_interval_ms=300,
                        unassigned_grace_ms=3_000)
    seen: dict[str, float] = {}
    with capture_logs() as logs:
        async with KafkaBridge(nc, cfg) as bridge:
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(12)])
            await wait_count(nc, NAMES, subject, 12, settle_s=0)
            await _bridged_settled(bridge, 12)
            await _restart_and_lose_the_topic(tansu, kafka_topic, topic, gap_s=4.0)
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(100, 105)])
            async with asyncio.timeout(BACK_WITHIN_S):
                while bridge.stats.events < 17:
                    parts = _sample(bridge, "plane_bridge_topic_partitions", topic=topic)
                    held = _sample(bridge, "plane_bridge_assigned_partitions", topic=topic)
                    lag = _sample(bridge, "plane_bridge_consumer_lag_records", topic=topic,
                                  partition="0")
                    if parts == 1 and held == 0 and lag:
                        seen["backlog"] = lag
                    await asyncio.sleep(0.05)
            assert _sample(bridge, "plane_bridge_assigned_partitions", topic=topic) == 1
    # tansu answers the end with its last batch's base offset + 1: at least one record.
    assert seen.get("backlog", 0) >= 1, "the waiting records never showed as lag"
    warned = [e for e in logs if e["log_level"] == "warning"
              and "holds no partition" in e["event"]]
    assert warned and warned[0]["topic"] == topic and warned[0]["group"] == cfg.group_id
    assert any("subscribing again" in e["event"] for e in logs)
    assert await wait_count(nc, NAMES, subject, 17, settle_s=0.5) == 17


def _commit(bootstrap: str, group: str, topic: str, offset: int) -> None:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        consumer.commit(offsets=[TopicPartition(topic, 0, offset)], asynchronous=False)
    finally:
        consumer.close()  # never subscribed: nothing to revoke (see `leave_group`)


async def test_a_group_offset_past_the_partitions_end_starts_it_from_the_beginning(
    nc: Client, tansu: EmbeddedTansu, kafka_topic: Any
) -> None:
    """A broker that lost the log but not the group's offset (committed at 100; the new log
    has 5 records). tansu answers a fetch past the end with nothing and no error: the bridge
    waited there, and once the log passed 100 it would have skipped records 0..99 without a
    word. Now it starts the partition over, and says why."""
    topic = await kafka_topic("transactions", partitions=1)
    await asyncio.to_thread(_commit, tansu.bootstrap, "lost-log", topic, 100)
    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(5)])
    with capture_logs() as logs:
        async with KafkaBridge(nc, bridge_config(tansu, topic, group_id="lost-log")):
            assert await wait_count(nc, NAMES, NAMES.events(topic), 5,
                                    timeout_s=BACK_WITHIN_S) == 5
    offsets = sorted(int(m.headers[Header.KAFKA_OFFSET])
                     for m in await subject_messages(nc, NAMES, NAMES.events(topic)))
    assert offsets == [0, 1, 2, 3, 4]
    (warning,) = [e for e in logs if "past the partition's end" in e["event"]]
    assert (warning["committed"], warning["end"], warning["partition"]) == (100, 5, 0)
