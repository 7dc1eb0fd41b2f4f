"""The Kafka bridge against real brokers: tansu (Kafka) and nats-server, records produced with
confluent-kafka."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
from collections import Counter

import pytest
from kafka_fixtures import (
    bridge_config,
    kafka_topic,
    produce,
    start_bridge_process,
    subject_messages,
    tansu,
    txn_line,
    wait_count,
)
from nats.aio.client import Client

from freshness.bridge import KafkaBridge, dead_reason
from freshness.config import BridgeConfig
from freshness.kafka_client import in_daemon_thread
from freshness.records import Stamps, decode_bytes, encode_bytes, msg_id
from freshness.tansu import EmbeddedTansu
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.natsconn import connect
from plane.contract.subjects import Header, Names

__all__ = ["kafka_topic", "tansu"]  # fixtures, imported for pytest

NAMES = Names()




def _total_lag(bridge: KafkaBridge, topic: str) -> float:
    return sum(bridge.metrics.registry.get_sample_value(
        "plane_bridge_consumer_lag_records", {"topic": topic, "partition": str(p)}) or 0.0
        for p in range(3))


def _identity(msgs: list) -> list[tuple[int, int]]:  # type: ignore[type-arg]
    return [(int(m.headers[Header.KAFKA_PARTITION]), int(m.headers[Header.KAFKA_OFFSET]))
            for m in msgs]


# -- pure pieces ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b'{"card":"c1","amount":1.5}', None),
        (b'{"card":"c1","amount":2,"features":[1,2],"extra":"ignored"}', None),
        (b"not json at all", "not JSON"),
        (b'{"amount":1.5}', "invalid: Object missing required field `card`"),
        (b'{"card":"c1","amount":"12"}', "invalid: Expected `float`, got `str`"),
        (b'{"card":"bad card!","amount":1}', "invalid"),
        (b'{"card":"c1","amount":1,"features":' + json.dumps([0.0] * 33).encode() + b"}",
         "invalid"),
        (None, "empty"),
    ],
)
def test_dead_reason(value: bytes | None, reason: str | None) -> None:
    got = dead_reason(value)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got
        assert "\n" not in got and len(got) <= 240


def test_stamps_round_trip_through_headers() -> None:
    for key in (b"card-7", b"\xff\x00binary", b"b64:looks-encoded", None):
        s = Stamps(event_time_ms=1000, ingest_time_ms=1300, partition=2, offset=41, key=key)
        h = s.headers(msg_id("tx", 2, 41, 1000))
        assert h[Header.NATS_MSG_ID] == "tx:2:41:1000"
        assert Stamps.from_headers(h) == s
        assert s.lag_ms == 300
    for raw in (b"\n", b" padded ", b"", "naïve".encode()):
        assert decode_bytes(encode_bytes(raw)) == raw
    with pytest.raises(ValueError, match="Plane-Event-Time"):
        Stamps.from_headers({Header.INGEST_TIME: "1"})


async def test_a_close_that_never_returns_is_left_behind() -> None:
    """librdkafka's `close()` has no timeout: the bridge waits for it a bounded time, on a
    daemon thread (one in an executor would hold the process at exit)."""
    release = threading.Event()
    assert await in_daemon_thread(lambda: None, 5.0, "quick") is True
    assert await in_daemon_thread(release.wait, 0.2, "stuck") is False
    stuck = [t for t in threading.enumerate() if t.name == "stuck"]
    assert stuck and stuck[0].daemon
    release.set()
    stuck[0].join(5)
    assert not stuck[0].is_alive()


def test_config_refuses_what_cannot_be_bridged() -> None:
    from plane.contract.errors import ConfigError

    with pytest.raises(ConfigError, match="--topic"):
        BridgeConfig(kafka_bootstrap="127.0.0.1:9092", topics=())
    with pytest.raises(ConfigError, match="cannot be bridged"):
        BridgeConfig(kafka_bootstrap="127.0.0.1:9092", topics=("a b",))
    assert BridgeConfig(kafka_bootstrap="h:1", topics=("risk.tx",)).topics == ("risk.tx",)


# -- real brokers -----------------------------------------------------------------------------
async def test_records_arrive_exactly_once(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("transactions", partitions=3)
    n = 600
    async with KafkaBridge(nc, bridge_config(tansu, topic, max_batch=100)) as bridge:
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(n)])
        assert await wait_count(nc, NAMES, NAMES.events(topic), n) == n
    msgs = await subject_messages(nc, NAMES, NAMES.events(topic))
    ids = _identity(msgs)
    assert len(ids) == len(set(ids)) == n
    bodies = sorted(json.loads(m.data)["amount"] for m in msgs)
    assert bodies == [i + 0.5 for i in range(n)]
    for m in msgs:
        s = Stamps.from_headers(m.headers)
        assert s.key == json.loads(m.data)["card"].encode()
        assert 0 <= s.lag_ms < 30_000
        assert m.headers[Header.NATS_MSG_ID].startswith(f"{topic}:{s.partition}:{s.offset}:")
    # Per partition, the stream keeps Kafka's order.
    by_partition: dict[int, list[int]] = {}
    for p, o in ids:
        by_partition.setdefault(p, []).append(o)
    for offsets in by_partition.values():
        assert offsets == sorted(offsets) == list(range(len(offsets)))
    assert bridge.stats.events == n and bridge.stats.dead == 0
    assert bridge.stats.commits >= 1


async def test_bad_records_go_to_dead_letter_while_good_ones_flow(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("payments", partitions=2)
    bad = [
        'x:this is not json',
        'x:{"amount": 3.0}',
        'x:{"card": "c1", "amount": "three"}',
        'x:{"card": 17, "amount": 3.0}',
        'x:[1, 2, 3]',
    ]
    lines: list[str] = []
    for i in range(200):
        lines.append(txn_line(i))
        if i % 10 == 0:
            lines.append(bad[(i // 10) % len(bad)])
    async with KafkaBridge(nc, bridge_config(tansu, topic)) as bridge:
        await produce(tansu.bootstrap, topic, lines)
        assert await wait_count(nc, NAMES, NAMES.events(topic), 200) == 200
        assert await wait_count(nc, NAMES, NAMES.dead_letter(topic), 20, settle_s=0.1) == 20
    dead = await subject_messages(nc, NAMES, NAMES.dead_letter(topic))
    reasons = Counter(m.headers[Header.DEAD_REASON].split(":")[0] for m in dead)
    assert reasons == {"not JSON": 4, "invalid": 16}
    assert {m.data.decode() for m in dead} == {b.split(":", 1)[1] for b in bad}
    for m in dead:  # a dead letter keeps the stamps, so it can be traced back to Kafka
        Stamps.from_headers(m.headers)
    assert bridge.stats.dead == 20 and bridge.stats.events == 200


async def test_sigkilled_bridge_restarted_delivers_each_record_once(
    nats_server: EmbeddedNats, nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("transactions", partitions=3)
    n = 20_000
    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(n // 2)])
    # Small rounds, so that the kill lands between a publish and its commit.
    proc = await start_bridge_process(nats_server.url, tansu.bootstrap, topic,
                                      "--max-batch", "20", "--max-in-flight", "8")
    try:
        await wait_count(nc, NAMES, NAMES.events(topic), 1000, settle_s=0, poll_s=0.005)
        os.kill(proc.pid, signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
        mid = len(await subject_messages(nc, NAMES, NAMES.events(topic)))
        assert 1000 <= mid < n // 2, f"the kill should land mid-stream, not after {mid}/{n}"
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(n // 2, n)])
        proc = await start_bridge_process(nats_server.url, tansu.bootstrap, topic)
        assert await wait_count(nc, NAMES, NAMES.events(topic), n, settle_s=1.0) == n
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        await proc.wait()
    ids = _identity(await subject_messages(nc, NAMES, NAMES.events(topic)))
    assert len(set(ids)) == len(ids) == n


async def test_bridge_survives_nats_restart(
    nats_server: EmbeddedNats, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("transactions", partitions=3)
    nc = await connect(ConnectOptions(url=nats_server.url))
    try:
        cfg = bridge_config(tansu, topic, publish_timeout_s=0.5, retry_backoff_s=0.05)
        async with KafkaBridge(nc, cfg) as bridge:
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(300)])
            await wait_count(nc, NAMES, NAMES.events(topic), 300, settle_s=0)
            await nats_server.stop()
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(300, 600)])
            await asyncio.sleep(1.0)  # the bridge fetches these and cannot publish them
            # Fetched but not committed: the consumer lag shows them.
            assert _total_lag(bridge, topic) == 300
            await nats_server.start()
            assert await wait_count(nc, NAMES, NAMES.events(topic), 600, settle_s=1.0) == 600
            assert bridge.stats.retries > 0
            assert _total_lag(bridge, topic) == 0
        ids = _identity(await subject_messages(nc, NAMES, NAMES.events(topic)))
        assert len(set(ids)) == len(ids) == 600
    finally:
        await nc.close()


async def test_bridge_survives_kafka_restart(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("transactions", partitions=3)
    async with KafkaBridge(nc, bridge_config(tansu, topic)) as bridge:
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(200)])
        await wait_count(nc, NAMES, NAMES.events(topic), 200, settle_s=0)
        # tansu keeps everything in memory: a restart forgets the topic, its records and
        # the group's offsets, and offsets start again at 0 (new Msg-Ids thanks to the
        # record timestamp in them). A commit still on its way when it restarts would be
        # retried by librdkafka against the new, empty broker and skip the first records
        # there: a hazard of a broker that loses its log, not of Kafka. Let it land first.
        async with asyncio.timeout(10):
            while bridge.stats.events < 200:
                await asyncio.sleep(0.01)
        await asyncio.sleep(bridge.cfg.commit_interval_ms / 1000 + 0.4)
        await tansu.restart(kill=True)
        await kafka_topic(topic, partitions=3)
        await asyncio.sleep(0.05)
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(200, 400)])
        assert await wait_count(nc, NAMES, NAMES.events(topic), 400, settle_s=1.0) == 400
    msgs = await subject_messages(nc, NAMES, NAMES.events(topic))
    amounts = sorted(json.loads(m.data)["amount"] for m in msgs)
    assert amounts == [i + 0.5 for i in range(400)]
    assert bridge.stats.events == 400


def test_freshness_names() -> None:
    n = Names("acme.plane")
    assert n.events("tx") == "acme.plane.events.tx"
    assert n.dead_letter("tx") == "acme.plane.dead.tx"
    assert n.dead_letter_all() == "acme.plane.dead.>"
    assert n.scored_all() == "acme.plane.scored.>"
    assert n.features_consumer("tx") == "features_tx"
    assert n.scorer_consumer("tx") == "scorer_tx"
    with pytest.raises(ValueError, match="invalid stream"):
        n.features_consumer("a.b")
