"""`plane risk-demo`: a risk pipeline, end to end, on embedded defaults.

    producer --Kafka topic--> bridge --plane.events.<topic>--> feature updater --> PLANE_FEATURES
                                                     \\                                  |
                                                      scorer --plane.infer.risk--> node (guard)
                                                        |
                             plane.scored.<topic> (NATS) + <topic>.scored (Kafka)

Everything it starts (nats-server, tansu, router, nodes, bridge, updater, scorer) it stops,
in reverse order, by PID for the processes. Traffic runs for `duration_s`, then the scorer
gets a bounded time to catch up; then a burst of `calibrated` requests, one of whose refusals
is redeemed with its ticket (`redeem_one_ticket`). The report (`demo_report`) says what
happened, and "OK" only when every answer met its contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import msgspec
import nats.errors
import structlog
from confluent_kafka import KafkaError, Producer
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from freshness.bridge import KafkaBridge
from freshness.config import BridgeConfig, GuardConfig, OnStale, UpdaterConfig, stream_token
from freshness.demo_report import DemoReport, DemoSetting
from freshness.features import FeatureUpdater
from freshness.guard import FRESHNESS_KEY, CardFeatureGuard, pad, risk_enricher
from freshness.kafka_admin import ensure_topics
from freshness.kafka_client import client_config, new_client
from freshness.kafka_config import KafkaSecurity
from freshness.provision import ensure_config_bucket
from freshness.records import Stamps, Transaction, transaction_decoder
from freshness.tansu import EmbeddedTansu
from plane.client import Client as PlaneClient
from plane.client import ClientConfig
from plane.client.ticket_demo import redeem_one_ticket
from plane.contract.config import MAX_DEADLINE_MS, ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import ConfigError
from plane.contract.messages import FEATURES, RiskRequest
from plane.contract.natsconn import connect
from plane.contract.replies import now_ms
from plane.contract.settings import RANGES
from plane.contract.subjects import Header, Names

log = structlog.get_logger("freshness.demo")

CATCH_UP_S = 5.0
# Concurrent scoring calls: about the node's slots times a few, so that a burst of
# bridged records does not turn into a burst of 429s.
SCORER_CONCURRENCY = 8


@dataclass(frozen=True, kw_only=True)
class DemoPlan:
    duration_s: float = 8.0
    rate_per_s: float = 100.0
    cards: int = 50
    lag_ms: float = 0.0
    lag_fraction: float = 0.0
    freshness_ms: int = 100
    on_stale: OnStale = OnStale.WAIT
    deadline_ms: int = 50
    kafka: str | None = None
    topic: str = "transactions"
    seed: int = 7
    names: Names = field(default_factory=Names)

    def __post_init__(self) -> None:
        stream_token(self.topic)
        if not 0 < self.duration_s <= 3600:
            raise ConfigError("--duration must be in (0, 3600] s")
        if not 0 < self.rate_per_s <= 20_000:
            raise ConfigError("--rate must be in (0, 20000] per second")
        if not 0 <= self.lag_fraction <= 1:
            raise ConfigError("--lag-fraction must be between 0 and 1")
        if self.cards < 1:
            raise ConfigError("--cards must be at least 1")
        # Checked here, before anything starts: a deadline of 0 was refused by the SDK once
        # the whole pipeline ran, in the scorer's task group (an ExceptionGroup traceback).
        if not 1 <= self.deadline_ms <= MAX_DEADLINE_MS:
            raise ConfigError(f"--deadline-ms must be 1..{MAX_DEADLINE_MS}")
        low, high = RANGES["freshness_ms"]
        if not low <= self.freshness_ms <= high:
            raise ConfigError(f"--freshness-ms must be {low}..{high}")

    @property
    def scored_topic(self) -> str:
        return f"{self.topic}.scored"

    def setting(self) -> DemoSetting:
        return DemoSetting(duration_s=self.duration_s, rate_per_s=self.rate_per_s,
                           cards=self.cards, lag_ms=self.lag_ms, lag_fraction=self.lag_fraction,
                           freshness_ms=self.freshness_ms, on_stale=self.on_stale.value,
                           deadline_ms=self.deadline_ms, topic=self.topic, names=self.names)


class Scored(msgspec.Struct, frozen=True, kw_only=True):
    """A scored transaction, as published to NATS and Kafka."""

    card: str
    amount: float
    status: int
    score: float | None
    freshness: str | None
    event_time_ms: int
    scored_time_ms: int
    partition: int
    offset: int


class _Reply(msgspec.Struct):
    score: float | None = None


_reply_decoder = msgspec.json.Decoder(_Reply)
_encoder = msgspec.json.Encoder()


class _KafkaOut:
    """A confluent-kafka producer for the demo: `send` queues (never blocks the loop),
    `flush` waits in a worker thread until Kafka has everything."""

    def __init__(self, bootstrap: str) -> None:
        self._producer = new_client(Producer, client_config(
            bootstrap, KafkaSecurity(), **{"linger.ms": 2, "client.id": "plane-risk-demo"}))
        self.failed = 0

    def _on_delivery(self, err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            self.failed += 1
            log.warning("Kafka produce failed", error=err.str())

    def send(self, topic: str, value: bytes, key: bytes, timestamp_ms: int = 0) -> None:
        while True:
            try:
                self._producer.produce(topic, value, key=key, timestamp=timestamp_ms,
                                       on_delivery=self._on_delivery)
                break
            except BufferError:  # queue full: serve delivery reports to make room
                self._producer.poll(0)
        self._producer.poll(0)

    async def flush(self, timeout_s: float = 10.0) -> None:
        await asyncio.to_thread(self._producer.flush, timeout_s)


async def _produce(plan: DemoPlan, bootstrap: str, report: DemoReport) -> None:
    """Card transactions at `rate_per_s` for `duration_s`; a fraction carry an event time
    `lag_ms` in the past (upstream lag)."""
    rng = random.Random(plan.seed)
    producer = _KafkaOut(bootstrap)
    try:
        start = time.monotonic()
        interval_s = 1.0 / plan.rate_per_s
        i = 0
        while (elapsed := time.monotonic() - start) < plan.duration_s:
            due = start + i * interval_s
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            card = f"card{rng.randrange(plan.cards)}"
            txn = Transaction(card=card, amount=round(rng.lognormvariate(3.5, 1.0), 2),
                              merchant=f"m{rng.randrange(20)}",
                              features=[round(rng.gauss(0, 1), 4) for _ in range(8)])
            lag = plan.lag_ms if rng.random() < plan.lag_fraction else 0.0
            ts = now_ms() - int(lag)
            producer.send(plan.topic, _encoder.encode(txn), key=card.encode(), timestamp_ms=ts)
            report.produced += 1
            i += 1
        del elapsed
    finally:
        await producer.flush()
    report.produced -= producer.failed


class _Scorer:
    """Scores every bridged transaction through the plane, publishes the results."""

    def __init__(self, nc: Client, plan: DemoPlan, producer: _KafkaOut,
                 report: DemoReport) -> None:
        self.nc, self.plan, self.producer, self.report = nc, plan, producer, report
        self.token = stream_token(plan.topic)
        self.client = PlaneClient(nc, ClientConfig(names=plan.names, seed=plan.seed))
        self._sem = asyncio.Semaphore(SCORER_CONCURRENCY)

    async def run(self, stop: asyncio.Event) -> None:
        names = self.plan.names
        sub = await self.nc.jetstream().pull_subscribe(
            names.events(self.token), durable=names.scorer_consumer(self.token),
            stream=names.events_stream,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL,
                                  ack_policy=AckPolicy.EXPLICIT, max_ack_pending=-1),
        )
        try:
            async with asyncio.TaskGroup() as tg:
                while not stop.is_set():
                    try:
                        async with asyncio.timeout(1.0):
                            msgs = await sub.fetch(SCORER_CONCURRENCY, timeout=0.05)
                    except (nats.errors.TimeoutError, TimeoutError):
                        continue
                    for msg in msgs:
                        await self._sem.acquire()
                        tg.create_task(self._score(msg))
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _score(self, msg: Msg) -> None:
        try:
            txn = transaction_decoder.decode(msg.data)
            stamps = Stamps.from_headers(msg.headers)
            body = _encoder.encode(RiskRequest(features=pad(txn.features)[:FEATURES],
                                               card=txn.card))
            t0 = time.perf_counter()
            # The SDK: retries a 429 at its Retry-After while the deadline allows.
            result = await self.client.call("risk", body, deadline_ms=self.plan.deadline_ms)
            self.report.answer(result.status, (time.perf_counter() - t0) * 1000)
            h = result.headers
            status = result.status
            score = _reply_decoder.decode(result.body).score if status == 200 else None
            scored_ms = now_ms()
            scored = Scored(card=txn.card, amount=txn.amount, status=status, score=score,
                            freshness=h.get(Header.FRESHNESS), event_time_ms=stamps.event_time_ms,
                            scored_time_ms=scored_ms, partition=stamps.partition,
                            offset=stamps.offset)
            data = _encoder.encode(scored)
            await self.nc.publish(self.plan.names.scored(self.token), data)
            self.producer.send(self.plan.scored_topic, data, key=txn.card.encode())
            self.report.to_kafka += 1
            self.report.scored += 1
            if scored.freshness:
                self.report.freshness[scored.freshness] += 1
            self.report.end_to_end_ms.append(float(scored_ms - stamps.event_time_ms))
            await msg.ack()
        finally:
            self._sem.release()


async def run_risk_demo(plan: DemoPlan, opts: ConnectOptions | None) -> DemoReport:
    # Imported here: the plane's router and node are only needed when the demo runs.
    from plane.stack import PlaneStack, StackConfig

    report = DemoReport(setting=plan.setting())
    names = plan.names
    async with contextlib.AsyncExitStack() as stack:
        if opts is None:
            server = await stack.enter_async_context(EmbeddedNats())
            opts = ConnectOptions(url=server.url, name="plane-risk-demo")
        report.nats = opts.url or ""
        if plan.kafka is None:
            tansu = await stack.enter_async_context(EmbeddedTansu())
            bootstrap = tansu.bootstrap
        else:
            bootstrap = plan.kafka
        report.kafka = bootstrap
        await ensure_topics(bootstrap, [plan.topic, plan.scored_topic], partitions=3)

        nc = await connect(opts)
        stack.push_async_callback(nc.drain)
        config_kv = await ensure_config_bucket(nc.jetstream(), names)
        await config_kv.put(FRESHNESS_KEY, str(plan.freshness_ms).encode())

        guard = await stack.enter_async_context(CardFeatureGuard(
            nc, names, GuardConfig(threshold_ms=plan.freshness_ms, on_stale=plan.on_stale)))
        # `calibrated` for the ticket part: a refusal that turns into an answer.
        await stack.enter_async_context(PlaneStack(
            StackConfig(connect=opts, names=names, models=("risk", "calibrated")),
            enrich=risk_enricher(guard)))
        bridge = await stack.enter_async_context(KafkaBridge(nc, BridgeConfig(
            kafka_bootstrap=bootstrap, topics=(plan.topic,), names=names,
            session_timeout_ms=2400, heartbeat_interval_ms=400)))
        updater = await stack.enter_async_context(
            FeatureUpdater(nc, UpdaterConfig(topic=plan.topic, names=names)))
        producer = _KafkaOut(bootstrap)
        stack.push_async_callback(producer.flush)
        await bridge.wait_assigned()

        stop_scoring = asyncio.Event()
        scorer = _Scorer(nc, plan, producer, report)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(scorer.run(stop_scoring))
            await _produce(plan, bootstrap, report)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CATCH_UP_S):
                    while report.scored < report.produced:  # noqa: ASYNC110 - counters
                        await asyncio.sleep(0.05)
            stop_scoring.set()
        report.ticket = await redeem_one_ticket(scorer.client)
        await producer.flush()
        report.to_kafka -= producer.failed
        report.bridged = bridge.stats.events
        report.dead = bridge.stats.dead
        report.first_record_s = bridge.stats.first_record_s
        report.features_applied = updater.applied
    return report
