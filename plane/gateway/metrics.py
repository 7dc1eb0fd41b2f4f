"""The gateway's Prometheus metrics, in an explicit registry served on its own /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from plane.contract.metrics import LATENCY_BUCKETS_S, Children


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "plane_gateway_requests", "HTTP inference requests answered, by status (499: "
            "the client left first; its generation was cancelled)",
            ["model", "status"], registry=self.registry)
        self.seconds = Histogram(
            "plane_gateway_request_seconds", "HTTP inference requests, receipt to answer",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._requests = Children(self.requests)  # bounded: known models, HTTP statuses
        self._seconds = Children(self.seconds)

    def observe(self, model: str, status: int, seconds: float) -> None:
        self._requests(model, str(status)).inc()
        self._seconds(model).observe(seconds)
