"""Typed configuration of the freshness package, validated on construction.

The CLI builds these from flags (environment variables are read there, once); the risk demo
and the tests build them directly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from freshness.kafka_config import KafkaSecurity, StartFrom
from plane.contract.errors import ConfigError
from plane.contract.subjects import InvalidToken, Names, check_token

DEFAULT_FRESHNESS_MS = 100


def stream_token(topic: str) -> str:
    """The NATS subject token for a Kafka topic: `.` becomes `_` (Kafka allows
    `[A-Za-z0-9._-]`, a subject token may not contain a dot)."""
    token = topic.replace(".", "_")
    try:
        return check_token("Kafka topic", token)
    except InvalidToken as exc:
        raise ConfigError(
            f"Kafka topic {topic!r} cannot be bridged: use 1 to 64 characters from "
            "A-Z a-z 0-9 . _ -"
        ) from exc


@dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """`plane bridge`: Kafka topics into JetStream (`<prefix>.events.<topic>`)."""

    kafka_bootstrap: str
    topics: tuple[str, ...]
    names: Names = field(default_factory=Names)
    group_id: str = "plane-bridge"
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    start: StartFrom = StartFrom.COMMITTED
    # Dead letters also go to this Kafka topic (value, key and headers as they came, plus
    # `plane-dead-reason` and the source's topic, partition and offset), acknowledged by
    # Kafka before the round's offsets are committed. None: NATS only.
    dead_letter_topic: str | None = None
    # Kafka group membership. A member that dies (SIGKILL) holds its partitions until its
    # session times out; a joining member also waits up to about half of it (tansu).
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    # Publishes awaiting a JetStream ack at once (the throughput knob).
    max_in_flight: int = 1024
    # Records taken from Kafka per round; offsets are committed once per round, after every
    # record of the round has been acknowledged by JetStream.
    max_batch: int = 1000
    # Settled offsets are committed at most this often (and when nothing more comes within
    # it): a crash re-fetches at most this much more, which JetStream drops as duplicates.
    commit_interval_ms: int = 200
    # How often librdkafka asks Kafka for the subscribed topics' metadata: how soon a topic
    # created (again, after a broker that lost its log came back) or given more partitions is
    # noticed and the group rebalances onto it. librdkafka's default, 5 minutes, left a
    # bridge with no partition for 12+ minutes after such a restart (found from outside).
    metadata_refresh_ms: int = 2_000
    # How often the bridge checks its assignment against the topics' partitions (the
    # `plane_bridge_*_partitions` gauges; the warning and the re-subscribe below).
    watch_interval_ms: int = 2_000
    # Holding none of a topic's partitions while it has some, for this long, is logged as a
    # warning (and, with a backlog nobody in the group moves, the bridge subscribes again).
    # None: the session timeout plus two metadata refreshes (a group join takes up to about
    # half the session timeout on tansu).
    unassigned_grace_ms: int | None = None
    poll_timeout_ms: int = 100
    # While nothing comes, this often the bridge asks Kafka whether it has reached the end
    # of every partition it holds and, when it has, says so (`freshness.watermark`): the
    # guard then reads a quiet, caught-up topic as fresh. Keep it well under freshness_ms.
    caught_up_interval_ms: int = 50
    # How long a Kafka fetch waits on the broker for data (latency of a quiet topic).
    fetch_wait_max_ms: int = 10
    publish_timeout_s: float = 2.0
    retry_backoff_s: float = 0.1
    retry_backoff_max_s: float = 2.0
    # JetStream drops a second message with the same Nats-Msg-Id within this window: it must
    # outlast the longest bridge outage after which records are fetched again.
    duplicate_window_s: float = 600.0
    max_age_s: float = 24 * 3600.0
    replicas: int = 1  # of the events stream (3 in a cluster)
    # On stop: how long to wait for in-flight publishes before leaving them uncommitted.
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.topics:
            raise ConfigError("give at least one --topic to bridge")
        for topic in self.topics:
            stream_token(topic)
        if not self.kafka_bootstrap or ":" not in self.kafka_bootstrap:
            raise ConfigError("--kafka must be HOST:PORT (comma separated for several)")
        if not 1 <= self.max_in_flight <= 100_000:
            raise ConfigError("max in-flight publishes must be 1..100000")
        if not 1 <= self.max_batch <= 100_000:
            raise ConfigError("max batch must be 1..100000")
        if not 0 <= self.commit_interval_ms <= 60_000:
            raise ConfigError("the commit interval must be 0..60000 ms")
        if not 3 * self.heartbeat_interval_ms <= self.session_timeout_ms:
            raise ConfigError("the Kafka session timeout must be at least 3 heartbeats")
        if self.dead_letter_topic is not None:
            if self.dead_letter_topic in self.topics:
                raise ConfigError("the dead-letter topic cannot be one of the bridged topics")
            stream_token(self.dead_letter_topic)
        if not 100 <= self.metadata_refresh_ms <= 3_600_000:
            raise ConfigError("the Kafka metadata refresh must be 100..3600000 ms")
        if not 10 <= self.caught_up_interval_ms <= 60_000:
            raise ConfigError("the caught-up interval must be 10..60000 ms")
        if not 100 <= self.watch_interval_ms <= 3_600_000:
            raise ConfigError("the assignment check interval must be 100..3600000 ms")
        if self.unassigned_grace_ms is not None and self.unassigned_grace_ms < 0:
            raise ConfigError("the unassigned grace must be >= 0 ms")
        if self.duplicate_window_s > self.max_age_s:
            raise ConfigError("the duplicate window cannot be longer than the stream's max age")

    @property
    def unassigned_grace_s(self) -> float:
        if self.unassigned_grace_ms is not None:
            return self.unassigned_grace_ms / 1000
        return (self.session_timeout_ms + 2 * self.metadata_refresh_ms) / 1000


class OnStale(enum.StrEnum):
    """What the guard does with stale data: wait (bounded by the request's deadline) for a
    fresher value and degrade if none comes, or degrade at once."""

    WAIT = "wait"
    DEGRADE = "degrade"


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The freshness guard of per-card features (`freshness.guard.CardFeatureGuard`)."""

    # Threshold for both upstream lag (ingest - event) and age at use; the live value in
    # PLANE_CONFIG key `freshness_ms` overrides it while set.
    threshold_ms: float = DEFAULT_FRESHNESS_MS
    on_stale: OnStale = OnStale.WAIT
    # Time kept back from the deadline for the scoring itself: the guard never waits into it.
    reserve_ms: float = 5.0
    # A wait shorter than this is not worth starting: degrade instead.
    min_wait_ms: float = 1.0
    # Check the age at use (now - the newest ingest stamp the guard has seen). Turn off for
    # streams that go quiet for longer than the threshold in normal operation.
    check_age: bool = True
    watch_live_threshold: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.threshold_ms <= 3_600_000:
            raise ConfigError("freshness threshold must be in (0, 3600000] ms")
        if self.reserve_ms < 0 or self.min_wait_ms < 0:
            raise ConfigError("reserve_ms and min_wait_ms must be >= 0")


@dataclass(frozen=True, kw_only=True)
class UpdaterConfig:
    """The feature updater: `events(topic)` from JetStream into per-card features in KV."""

    topic: str
    names: Names = field(default_factory=Names)
    batch: int = 256
    fetch_timeout_s: float = 0.05
    ack_wait_s: float = 10.0
    replicas: int = 1  # of the features bucket and the events stream, where it creates them
    # At start, refuse to run beside another updater of the topic (its pulls waiting on the
    # durable consumer): two would lose each other's updates (see `FeatureUpdater`).
    refuse_a_second: bool = True

    def __post_init__(self) -> None:
        stream_token(self.topic)
        if not 1 <= self.batch <= 10_000:
            raise ConfigError("updater batch must be 1..10000")

    @property
    def stream(self) -> str:
        return stream_token(self.topic)
