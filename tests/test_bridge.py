"""The Kafka bridge against real brokers: tansu (Kafka) and nats-server, records produced with
confluent-kafka."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

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
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.errors import ConnectionClosed
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
        (b"", "empty: a record whose value is empty"),
        # Two of these summed to inf in a card's features, which JSON writes as null.
        (b'{"card":"c1","amount":1.7e308}', "invalid: Expected `float` <= 1000000000000000.0"),
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


# -- found from outside ---------------------------------------------------------------------
@pytest.fixture
async def small_payload_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A nats-server whose max_payload is 64 KiB (its default is 1 MiB): records near it are
    cheap to make."""
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 65536\n")
    async with EmbeddedNats(NatsServerSpec(extra_args=["-c", str(conf)])) as srv:
        yield srv


async def test_records_too_large_by_their_key_or_their_utf8_headers_are_dead_letters(
    small_payload_server: EmbeddedNats, tansu: EmbeddedTansu, kafka_topic
) -> None:
    """A key larger than max_payload went into the dead letter too: the server closed the
    connection at its publish, and the bridge retried it for ever on a closed connection;
    a header of 25,000 "é" was counted as 25,000 bytes (it is 50,000), with the same end.
    Now both are dead letters that fit, and the records after them flow."""
    topic = await kafka_topic("transactions", partitions=1)
    nc = await connect(ConnectOptions(url=small_payload_server.url))
    try:
        async with KafkaBridge(nc, bridge_config(tansu, topic)) as bridge:
            body = b'{"card":"c1","amount":1.5}'
            await produce(tansu.bootstrap, topic, [
                (b"k" * 70_000, body, []),
                (b"c1", b'{"card":"c1","amount":2.5,"merchant":"' + b"m" * 20_000 + b'"}',
                 [("note", "é".encode() * 25_000)]),
                (b"c1", body, []),
            ])
            assert await wait_count(nc, NAMES, NAMES.events(topic), 1) == 1
            assert await wait_count(nc, NAMES, NAMES.dead_letter(topic), 2, settle_s=0.2) == 2
            assert nc.is_connected and bridge.stats.dead == 2 and bridge.stats.events == 1
        dead = await subject_messages(nc, NAMES, NAMES.dead_letter(topic))
        reasons = [m.headers[Header.DEAD_REASON] for m in dead]
        assert all(r.startswith("too large") for r in reasons), reasons
        assert "its key (70000 bytes) dropped too" in reasons[0]
        assert Header.KAFKA_KEY not in dead[0].headers and dead[1].headers[Header.KAFKA_KEY]
    finally:
        await nc.close()


async def test_a_bridge_whose_connection_closes_for_good_stops_saying_so(
    nats_server: EmbeddedNats, tansu: EmbeddedTansu, kafka_topic
) -> None:
    """Its NATS connection closed for good (nats-py gave up on it), the bridge retried its
    publishes for ever, alive and silent; now it stops with `ConnectionClosed` (the command
    exits with it, for its supervisor to restart it)."""
    topic = await kafka_topic("transactions", partitions=1)
    nc = await connect(ConnectOptions(url=nats_server.url))
    cfg = bridge_config(tansu, topic, publish_timeout_s=0.2, retry_backoff_s=0.05)
    with pytest.raises(ConnectionClosed, match="closed for good"):
        async with KafkaBridge(nc, cfg) as bridge:
            await produce(tansu.bootstrap, topic, [txn_line(0)])
            await wait_count(nc, NAMES, NAMES.events(topic), 1, settle_s=0)
            await nc.close()
            await produce(tansu.bootstrap, topic, [txn_line(1)])
            async with asyncio.timeout(20):
                await bridge.wait()  # what the command waits on: it ends, saying why


async def test_a_broker_back_with_an_empty_store_is_caught_up_at_once(
    nats_server: EmbeddedNats, tansu: EmbeddedTansu, kafka_topic
) -> None:
    """nats-server back without its store (a new volume): each publish got a no-responders
    status, which the bridge counted as "no ack yet" and waited out its publish timeout for,
    round after round: a few records a second (found from outside). Refused publishes are
    retried at once now."""
    topic = await kafka_topic("transactions", partitions=1)
    nc = await connect(ConnectOptions(url=nats_server.url))
    try:
        cfg = bridge_config(tansu, topic, publish_timeout_s=1.0, retry_backoff_s=0.05,
                            max_batch=10)
        async with KafkaBridge(nc, cfg):
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(20)])
            await wait_count(nc, NAMES, NAMES.events(topic), 20, settle_s=0)
            await nats_server.stop()
            assert nats_server.spec.store_dir is not None
            shutil.rmtree(nats_server.spec.store_dir)
            await nats_server.start()
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(20, 220)])
            t0 = time.monotonic()
            # 20 rounds of 10: 20 s and more when each waited out its publish timeout.
            assert await wait_count(nc, NAMES, NAMES.events(topic), 200, settle_s=0.5) == 200
            assert time.monotonic() - t0 < 10
    finally:
        await nc.close()


async def test_an_event_time_ahead_of_the_bridges_clock_is_stamped_with_the_ingest_time(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    """A producer's clock 10 minutes ahead: its records counted as fresh, and the newest of
    their card's, for those 10 minutes (found from outside)."""
    topic = await kafka_topic("transactions", partitions=1)
    ahead_ms = int(time.time() * 1000) + 600_000
    async with KafkaBridge(nc, bridge_config(tansu, topic)) as bridge:
        await produce(tansu.bootstrap, topic, [txn_line(0)], timestamp_ms=ahead_ms)
        assert await wait_count(nc, NAMES, NAMES.events(topic), 1) == 1
    [m] = await subject_messages(nc, NAMES, NAMES.events(topic))
    stamps = Stamps.from_headers(m.headers)
    assert stamps.event_time_ms == stamps.ingest_time_ms
    assert m.headers[Header.NATS_MSG_ID].endswith(f":{ahead_ms}")  # deduplication as before
    assert bridge.metrics.registry.get_sample_value(
        "plane_bridge_event_time_ahead_total", {"topic": topic}) == 1
