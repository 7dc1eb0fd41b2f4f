"""Real-broker fixtures for the freshness tests: tansu (Kafka) on a free loopback port,
stopped by PID; `produce` writes records with confluent-kafka (librdkafka 2.16, the client
Python risk pipelines run, speaking tansu's protocol as it is); helpers that read everything
a JetStream subject holds.

A test module imports the fixtures it uses by name (`from kafka_fixtures import tansu`):
pytest finds fixtures in the module's namespace.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from freshness.config import BridgeConfig
from freshness.kafka_admin import ensure_topics
from freshness.tansu import EmbeddedTansu
from plane.contract.subjects import Names

REPO = Path(__file__).resolve().parent.parent
PLANE = str(Path(sys.executable).parent / "plane")
# Short Kafka sessions: a group join on tansu takes about half of it.
SESSION_TIMEOUT_MS = 2400


def bridge_config(kafka: EmbeddedTansu, topic: str, **kw: Any) -> BridgeConfig:
    """A bridge on `topic` of `kafka`, with the tests' short group session."""
    kw.setdefault("session_timeout_ms", SESSION_TIMEOUT_MS)
    kw.setdefault("heartbeat_interval_ms", SESSION_TIMEOUT_MS // 6)
    return BridgeConfig(kafka_bootstrap=kafka.bootstrap, topics=(topic,), **kw)


@pytest.fixture
async def tansu() -> AsyncIterator[EmbeddedTansu]:
    async with EmbeddedTansu() as kafka:
        yield kafka


@pytest.fixture
def kafka_topic(tansu: EmbeddedTansu) -> Callable[..., Awaitable[str]]:
    async def make(name: str = "transactions", partitions: int = 3) -> str:
        await ensure_topics(tansu.bootstrap, [name], partitions=partitions)
        return name

    return make


Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]


def _produce(bootstrap: str, topic: str, records: Sequence[Record], partition: int,
             timestamp_ms: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            errors.append(err)

    for key, value, headers in records:
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=headers or None,
                                 on_delivery=on_delivery, partition=partition,
                                 timestamp=timestamp_ms)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    left = producer.flush(60)
    assert left == 0 and not errors, f"produce failed: {left} undelivered, {errors[:3]}"


async def produce(
    bootstrap: str, topic: str, records: Sequence[Record | str], *, partition: int = -1,
    timestamp_ms: int = 0,
) -> None:
    """Produce records with confluent-kafka and wait until Kafka has them all; a str is a
    `key:value` line (as `kcat -K:` reads them), else (key, value, headers). Partition -1:
    by key (librdkafka's partitioner); timestamp 0: the time of producing."""
    recs = [_line(r) if isinstance(r, str) else r for r in records]
    await asyncio.to_thread(_produce, bootstrap, topic, recs, partition, timestamp_ms)


def _line(line: str) -> Record:
    key, sep, value = line.partition(":")
    return (key.encode(), value.encode(), []) if sep else (None, line.encode(), [])


def txn_line(i: int, card: str | None = None) -> str:
    card = card or f"card{i % 17}"
    return f'{card}:{{"card":"{card}","amount":{i}.5,"merchant":"m{i % 5}","features":[{i}]}}'


async def subject_messages(nc: Client, names: Names, subject: str) -> list[Msg]:
    """Every message the events stream holds on `subject` (an ephemeral pull consumer)."""
    js = nc.jetstream()
    info = await js.stream_info(names.events_stream, subjects_filter=subject)
    total = (info.state.subjects or {}).get(subject, 0)
    if total == 0:
        return []
    sub = await js.pull_subscribe(
        subject, stream=names.events_stream,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                              inactive_threshold=10.0),
    )
    out: list[Msg] = []
    try:
        while len(out) < total:
            out += await sub.fetch(min(1000, total - len(out)), timeout=5)
    finally:
        await sub.unsubscribe()
    return out


async def subject_count(nc: Client, names: Names, subject: str) -> int:
    try:
        info = await nc.jetstream().stream_info(names.events_stream, subjects_filter=subject)
    except NotFoundError:  # the bridge has not created the stream yet
        return 0
    return (info.state.subjects or {}).get(subject, 0)


async def wait_count(
    nc: Client, names: Names, subject: str, n: int, *, timeout_s: float = 30.0,
    settle_s: float = 0.5, poll_s: float = 0.05,
) -> int:
    """Wait until `subject` holds at least `n` messages, then `settle_s` more (so that an
    extra message, a duplicate, would show); returns the final count."""
    async with asyncio.timeout(timeout_s):
        # Polling the broker's state: there is no event to wait on.
        while await subject_count(nc, names, subject) < n:
            await asyncio.sleep(poll_s)
    await asyncio.sleep(settle_s)
    return await subject_count(nc, names, subject)


async def start_bridge_process(
    nats_url: str, bootstrap: str, topic: str, *extra: str
) -> asyncio.subprocess.Process:
    """`plane bridge` as a child process (so that a test can SIGKILL it)."""
    return await asyncio.create_subprocess_exec(
        PLANE, "bridge", "--kafka", bootstrap, "--topic", topic, "--nats", nats_url,
        "--log-level", "warning", "--session-timeout-ms", str(SESSION_TIMEOUT_MS), *extra,
        cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
