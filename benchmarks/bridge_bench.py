"""Kafka-to-JetStream bridge: throughput (records/s) and the latency it adds (p50/p99).

    .venv/bin/python benchmarks/bridge_bench.py [--records 50000] [--rate 1000] [--seconds 10]

Starts its own nats-server and tansu on loopback ports and stops them after. Records are
produced with confluent-kafka.

Start to first record: from `KafkaBridge.start()` (stream ensured, consumer subscribed) to the
first record acknowledged by JetStream, with the records already in Kafka, at the default
session timeout (10 s) and at the tests' (2.4 s): a new member's group join on tansu takes
about half the session timeout, and that is most of it.

Throughput: `--records` transactions are produced to a 3-partition topic first, then the bridge
starts and the clock runs until JetStream holds all of them (exactly once; the count is
checked), so the figure is the bridge's drain rate with every record acknowledged by JetStream
(offsets are committed behind that, every 0.2 s).

Latency: records at a steady `--rate` for `--seconds`, each timestamped by the producer; a
NATS subscriber on the events subject notes when each arrives. Reported per record:
  bridge     arrival at the subscriber - Plane-Ingest-Time (taking the record from the Kafka
             client, stamping, publishing, JetStream storing and delivering)
  end to end arrival - Kafka timestamp (adds produce and fetch through the Kafka broker)
The first second is dropped as warm-up. Stamps are whole milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path

import msgspec
import nats
from confluent_kafka import Producer
from nats.aio.client import Client
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from freshness.bridge import KafkaBridge
from freshness.config import BridgeConfig
from freshness.kafka_admin import ensure_topics
from freshness.records import Stamps, Transaction
from freshness.tansu import EmbeddedTansu
from plane.contract.embedded import EmbeddedNats
from plane.contract.quantiles import quantile
from plane.contract.subjects import Names

NAMES = Names()
ENC = msgspec.json.Encoder()


def _config(bootstrap: str, topic: str, session_timeout_ms: int = 2400) -> BridgeConfig:
    return BridgeConfig(kafka_bootstrap=bootstrap, topics=(topic,), group_id=f"bench-{topic}",
                        session_timeout_ms=session_timeout_ms,
                        heartbeat_interval_ms=session_timeout_ms // 6)


def _produce(bootstrap: str, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(n):
        body = ENC.encode(Transaction(card=f"card{i % 1000}", amount=i * 0.01,
                                      features=[0.5] * 8))
        while True:
            try:
                producer.produce(topic, body, key=f"card{i % 1000}".encode())
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    assert producer.flush(60) == 0


async def _count(nc: Client, subject: str) -> int:
    info = await nc.jetstream().stream_info(NAMES.events_stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def throughput(nc: Client, bootstrap: str, n: int) -> tuple[float, float]:
    topic = "bench_tp"
    await ensure_topics(bootstrap, [topic], partitions=3)
    await asyncio.to_thread(_produce, bootstrap, topic, n)
    subject = NAMES.events(topic)
    async with KafkaBridge(nc, _config(bootstrap, topic)) as bridge:
        await bridge.wait_assigned()
        t0 = time.perf_counter()
        while (got := await _count(nc, subject)) < n:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
    assert got == n, f"expected {n} records exactly once, JetStream holds {got}"
    return n / elapsed, elapsed


async def latency(nc: Client, bootstrap: str, rate: float, seconds: float) -> dict[str, float]:
    topic = "bench_lat"
    await ensure_topics(bootstrap, [topic], partitions=3)
    bridge_ms: list[float] = []
    e2e_ms: list[float] = []
    warm_until = time.time() * 1000 + 1000

    async def on_msg(msg: Msg) -> None:
        now = time.time_ns() / 1e6
        s = Stamps.from_headers(msg.headers)
        if s.event_time_ms < warm_until:
            return
        bridge_ms.append(now - s.ingest_time_ms)
        e2e_ms.append(now - s.event_time_ms)

    sub = await nc.subscribe(NAMES.events(topic), cb=on_msg)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    try:
        async with KafkaBridge(nc, _config(bootstrap, topic)) as bridge:
            await bridge.wait_assigned()
            warm_until = time.time() * 1000 + 1000
            start = time.monotonic()
            i = 0
            while time.monotonic() - start < seconds:
                due = start + i / rate
                if due > time.monotonic():
                    await asyncio.sleep(due - time.monotonic())
                body = ENC.encode(Transaction(card=f"card{i % 100}", amount=1.0))
                producer.produce(topic, body, key=f"card{i % 100}".encode(),
                                 timestamp=time.time_ns() // 1_000_000)
                producer.poll(0)
                i += 1
            await asyncio.to_thread(producer.flush, 10)
            await asyncio.sleep(1.0)
    finally:
        await sub.unsubscribe()
    return {
        "records": float(len(bridge_ms)),
        "bridge_p50": quantile(bridge_ms, 0.5), "bridge_p99": quantile(bridge_ms, 0.99),
        "e2e_p50": quantile(e2e_ms, 0.5), "e2e_p99": quantile(e2e_ms, 0.99),
    }


async def first_record(nc: Client, bootstrap: str, session_timeout_ms: int) -> float:
    topic = f"bench_first_{session_timeout_ms}"
    await ensure_topics(bootstrap, [topic], partitions=3)
    await asyncio.to_thread(_produce, bootstrap, topic, 10)
    async with KafkaBridge(nc, _config(bootstrap, topic, session_timeout_ms)) as bridge:
        async with asyncio.timeout(60):
            while bridge.stats.first_record_s is None:
                await asyncio.sleep(0.005)
        return bridge.stats.first_record_s


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    async with EmbeddedNats() as server, EmbeddedTansu() as kafka:
        nc = await nats.connect(server.url)
        try:
            first = {ms: await first_record(nc, kafka.bootstrap, ms) for ms in (10_000, 2400)}
            rps, elapsed = await throughput(nc, kafka.bootstrap, args.records)
            lat = await latency(nc, kafka.bootstrap, args.rate, args.seconds)
        finally:
            await nc.close()
    print(f"machine: {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, nats-server + tansu on loopback")
    print("start to first record in JetStream: "
          + ", ".join(f"{s:.2f} s (session timeout {ms / 1000:g} s)" for ms, s in first.items()))
    print(f"throughput: {args.records} records in {elapsed:.2f} s = {rps:,.0f} records/s "
          "(each acknowledged by JetStream before its offset is committed; exactly once)")
    print(f"latency at {args.rate:g} records/s over {args.seconds:g} s "
          f"({lat['records']:.0f} records after warm-up):")
    print(f"  bridge (ingest -> NATS delivery):      p50 {lat['bridge_p50']:.1f} ms, "
          f"p99 {lat['bridge_p99']:.1f} ms")
    print(f"  end to end (Kafka timestamp -> NATS):  p50 {lat['e2e_p50']:.1f} ms, "
          f"p99 {lat['e2e_p99']:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
