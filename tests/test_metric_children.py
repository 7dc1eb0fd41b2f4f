"""A metric's children looked up once (plane/contract/metrics.py `Children`): the same child
for the same label values, counted into the registry as `labels()` would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from plane.contract.metrics import Children, PlaneMetrics


def test_children_are_looked_up_once_and_count_into_the_registry() -> None:
    registry = CollectorRegistry()
    metrics = PlaneMetrics(registry)
    answered = Children(metrics.router_requests)
    assert answered("risk", "200") is answered("risk", "200")
    assert answered("risk", "200") is metrics.router_requests.labels("risk", "200")
    answered("risk", "200").inc()
    answered("risk", "200").inc()
    answered("risk", "429").inc()
    metrics.router_requests.labels("risk", "200").inc()  # the plain way, the same series
    value = registry.get_sample_value
    assert value("plane_router_requests_total", {"model": "risk", "status": "200"}) == 3
    assert value("plane_router_requests_total", {"model": "risk", "status": "429"}) == 1
