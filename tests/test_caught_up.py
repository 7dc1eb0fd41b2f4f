"""Caught-up watermarks (`freshness.watermark`): a quiet pipeline that is caught up reads as
fresh after more than `freshness_ms` of silence; a stalled one (the bridge stopped, the Kafka
broker gone) still reads as stale. Real tansu, nats-server, bridge, updater and guards; the
watermarks' bookkeeping as a pure unit."""

from __future__ import annotations

import asyncio
import time

import msgspec
from kafka_fixtures import bridge_config, kafka_topic, produce, tansu
from nats.aio.client import Client

from freshness.bridge import KafkaBridge
from freshness.config import GuardConfig, OnStale, UpdaterConfig
from freshness.features import FeatureUpdater
from freshness.guard import CardFeatureGuard
from freshness.records import Transaction
from freshness.tansu import EmbeddedTansu
from freshness.watermark import CaughtUp, TopicMarks
from plane.contract.messages import Freshness
from plane.contract.subjects import Names

__all__ = ["kafka_topic", "tansu"]  # fixtures, imported for pytest

NAMES = Names()
# Above the pipeline's own latency on a loaded 2-core host (as in test_guard.py).
THRESHOLD_MS = 250.0
QUIET_S = 3 * THRESHOLD_MS / 1000  # silence well past the threshold


def _deadline(ms: float) -> float:
    return time.monotonic() + ms / 1000


async def _produce_now(bootstrap: str, topic: str, card: str) -> None:
    body = msgspec.json.encode(Transaction(card=card, amount=10.0))
    await produce(bootstrap, topic, [(card.encode(), body, [])],
                  timestamp_ms=time.time_ns() // 1_000_000)


async def _until(predicate, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def _guards(nc: Client) -> tuple[CardFeatureGuard, CardFeatureGuard]:
    """One guard that degrades at once, one that waits: both check the age."""
    return (CardFeatureGuard(nc, NAMES, GuardConfig(on_stale=OnStale.DEGRADE,
                                                    threshold_ms=THRESHOLD_MS)),
            CardFeatureGuard(nc, NAMES, GuardConfig(on_stale=OnStale.WAIT,
                                                    threshold_ms=THRESHOLD_MS)))


async def _fresh_after_silence(tansu: EmbeddedTansu, topic: str, degrading: CardFeatureGuard,
                               waiting: CardFeatureGuard) -> None:
    await _produce_now(tansu.bootstrap, topic, "c1")
    await _until(lambda: "c1" in degrading._last_good and "c1" in waiting._last_good)
    await asyncio.sleep(QUIET_S)  # nothing new: the newest ingest stamp is old now
    for guard in (degrading, waiting):
        r = await guard.lookup("c1", _deadline(50))
        assert r.freshness is Freshness.FRESH, r
        assert 0 <= r.age_ms <= THRESHOLD_MS
        assert time.time() * 1000 - guard._view_ingest_ms > THRESHOLD_MS  # no record helped


async def test_a_quiet_caught_up_pipeline_is_fresh_and_a_stopped_bridge_is_not(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("transactions", partitions=2)
    degrading, waiting = _guards(nc)
    async with (
        FeatureUpdater(nc, UpdaterConfig(topic=topic)) as updater,
        degrading, waiting,
    ):
        bridge = KafkaBridge(nc, bridge_config(tansu, topic))
        async with bridge:
            await bridge.wait_assigned()
            await _fresh_after_silence(tansu, topic, degrading, waiting)
            assert bridge.stats.caught_up > 0 and updater.watermark_ms > 0
            sent = bridge.metrics.registry.get_sample_value(
                "plane_bridge_caught_up_total", {"topic": topic})
            assert sent is not None and sent > 0
        # The bridge is gone: nothing says the pipeline is caught up any more.
        await asyncio.sleep(QUIET_S)
        r = await degrading.lookup("c1", _deadline(50))
        assert r.freshness is Freshness.DEGRADED and r.source == "last-good"
        assert r.age_ms > THRESHOLD_MS
        r = await waiting.lookup("c1", _deadline(80))
        assert r.freshness is Freshness.DEGRADED and r.waited_ms >= 50


async def test_a_caught_up_bridge_whose_kafka_broker_dies_stops_its_watermark(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("transactions", partitions=1)
    degrading, waiting = _guards(nc)
    async with (
        KafkaBridge(nc, bridge_config(tansu, topic, drain_timeout_s=1.0)) as bridge,
        FeatureUpdater(nc, UpdaterConfig(topic=topic)) as updater,
        degrading, waiting,
    ):
        await bridge.wait_assigned()
        await _fresh_after_silence(tansu, topic, degrading, waiting)
        await tansu.stop(kill=True)
        # The bridge's last word was at most one interval before the broker went.
        stopped_ms = time.time() * 1000
        await asyncio.sleep(QUIET_S)
        assert updater.watermark_ms <= stopped_ms
        r = await degrading.lookup("c1", _deadline(50))
        assert r.freshness is Freshness.DEGRADED and r.age_ms > THRESHOLD_MS
        r = await waiting.lookup("c1", _deadline(80))
        assert r.freshness is Freshness.DEGRADED and r.waited_ms >= 50


def _mark(partitions: list[int], at_ms: int, *, count: int = 3, seq: int = 0) -> CaughtUp:
    return CaughtUp(topic="t", partitions=partitions, partition_count=count, caught_up_ms=at_ms,
                    event_seq=seq)


def test_a_topic_watermark_is_its_oldest_partition_and_waits_for_the_updater() -> None:
    marks = TopicMarks()
    marks.take(_mark([0, 1], 1000))
    marks.settle(applied_seq=0, caught_up=True)
    assert marks.watermark() is None  # partition 2: no bridge has spoken for it
    marks.take(_mark([2], 900, seq=7))
    marks.settle(applied_seq=6, caught_up=True)  # its events not applied yet
    assert marks.watermark() is None
    marks.settle(applied_seq=7, caught_up=False)  # applied, but more pending
    assert marks.watermark() is None
    marks.settle(applied_seq=7, caught_up=True)
    assert marks.watermark() == 900  # the oldest: another bridge never speaks for it
    marks.take(_mark([0, 1], 2000))
    marks.settle(applied_seq=7, caught_up=True)
    assert marks.watermark() == 900  # partition 2's bridge has stopped: the topic waits
    marks.take(_mark([2], 1500, seq=7))
    marks.take(_mark([2], 1200, seq=7))  # an older word of the same bridge, late
    marks.settle(applied_seq=7, caught_up=True)
    assert marks.watermark() == 1500
    marks.take(_mark([0, 1, 2, 3], 2500, count=4))  # the topic grew a partition
    marks.settle(applied_seq=7, caught_up=True)
    assert marks.watermark() == 2500
