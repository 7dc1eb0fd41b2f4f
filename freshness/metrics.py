"""Prometheus metrics of the freshness path: `plane_` prefix, base units, low-cardinality
labels, and an explicit registry (the caller's, or a private one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Upstream lag and waits: 1 ms to 10 s.
LAG_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class BridgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records = Counter(
            "plane_bridge_records", "Kafka records bridged, by outcome (event, dead)",
            ["topic", "outcome"], registry=r)
        self.duplicates = Counter(
            "plane_bridge_duplicates", "Publishes JetStream dropped as duplicates (re-fetched "
            "after a restart or rebalance)", ["topic"], registry=r)
        self.retries = Counter(
            "plane_bridge_publish_retries", "JetStream publishes retried", registry=r)
        self.lag_seconds = Histogram(
            "plane_bridge_lag_seconds", "Ingest time minus the Kafka record's event time",
            ["topic"], buckets=LAG_BUCKETS_S, registry=r)
        self.event_time_ahead = Counter(
            "plane_bridge_event_time_ahead", "Records whose Kafka timestamp was ahead of the "
            "bridge's clock (a producer's clock ahead): stamped with the ingest time instead",
            ["topic"], registry=r)
        self.commits = Counter(
            "plane_bridge_commits", "Kafka offset commits, by result (ok, failed)",
            ["result"], registry=r)
        # One series per partition this bridge is assigned (removed when it is revoked):
        # partitions are few and fixed, as in every Kafka lag exporter.
        self.consumer_lag = Gauge(
            "plane_bridge_consumer_lag_records", "Records in a Kafka partition the bridge has "
            "not committed yet: the partition's end (as of the last fetch) minus the bridge's "
            "committed offset; for a topic this bridge holds no partition of, the group's "
            "lag", ["topic", "partition"], registry=r)
        # Per topic: the partitions it has, and those of them this bridge holds. Summed over
        # the bridges of a group, the held must equal the topic's: less is a partition no
        # bridge bridges (the alert PlaneBridgePartitionsUnheld).
        self.topic_partitions = Gauge(
            "plane_bridge_topic_partitions", "Partitions of a bridged Kafka topic, as the "
            "broker's metadata says (0: the topic does not exist)", ["topic"], registry=r)
        self.assigned_partitions = Gauge(
            "plane_bridge_assigned_partitions", "Partitions of a bridged Kafka topic that "
            "the group assigned to this bridge", ["topic"], registry=r)
        self.caught_up = Counter(
            "plane_bridge_caught_up", "Caught-up watermarks published: every partition of "
            "the topic this bridge holds was at its end in Kafka, and every record fetched "
            "acknowledged by JetStream (while the topic is quiet, one per caught-up "
            "interval; none while it is behind, or Kafka does not answer)", ["topic"],
            registry=r)
        self.first_record_seconds = Gauge(
            "plane_bridge_first_record_seconds", "Time from the bridge's start to its first "
            "record acknowledged by JetStream (0 until then)", registry=r)


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lag_seconds = Histogram(
            "plane_freshness_lag_seconds", "Upstream lag (ingest - event) of values at use",
            buckets=LAG_BUCKETS_S, registry=r)
        self.age_seconds = Histogram(
            "plane_freshness_age_seconds", "Age of the guard's view at use",
            buckets=LAG_BUCKETS_S, registry=r)
        self.outcomes = Counter(
            "plane_freshness_outcomes", "Guarded lookups, by outcome (fresh, waited, degraded)",
            ["outcome"], registry=r)
        self.wait_seconds = Histogram(
            "plane_freshness_wait_seconds", "Time spent waiting for a fresher value",
            buckets=LAG_BUCKETS_S, registry=r)
