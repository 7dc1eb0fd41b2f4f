"""The gateway's Prometheus metrics, in an explicit registry served on its own /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from plane.contract.metrics import LATENCY_BUCKETS_S


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "plane_gateway_requests", "HTTP inference requests answered, by status",
            ["model", "status"], registry=self.registry)
        self.seconds = Histogram(
            "plane_gateway_request_seconds", "HTTP inference requests, receipt to answer",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        # Each series' child, looked up once: `labels()` checks and joins its label values
        # on every call (the labels are bounded: known models and HTTP statuses).
        self._counted: dict[tuple[str, int], Counter] = {}
        self._timed: dict[str, Histogram] = {}

    def observe(self, model: str, status: int, seconds: float) -> None:
        counted = self._counted.get((model, status))
        if counted is None:
            counted = self._counted[model, status] = self.requests.labels(
                model=model, status=str(status))
        timed = self._timed.get(model)
        if timed is None:
            timed = self._timed[model] = self.seconds.labels(model=model)
        counted.inc()
        timed.observe(seconds)
