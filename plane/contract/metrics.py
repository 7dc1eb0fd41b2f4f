"""Prometheus metrics: a `plane_` prefix, base units, low-cardinality labels, and an explicit
registry (no process-wide default), so a router and a node in one process share one registry
and tests get their own; a process that runs parts of the plane in children of its own
(`plane up`'s router) serves theirs merged into one exposition (`MergedMetrics`)."""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from plane.contract.errors import cannot_listen
from plane.contract.metrics_http import Bound
from plane.contract.metrics_http import stop as stop_http

log = structlog.get_logger("plane.metrics")

CHILD_SCRAPE_TIMEOUT_S = 2.0

# Buckets from 100 µs to 10 s: the plane's answers live in the first half.
TOKEN_BUCKETS_S = (  # a decode step: tens of µs on a GPU, a few hundred on a CPU
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05,
)
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)


M = TypeVar("M", Counter, Gauge, Histogram)


class Children(Generic[M]):
    """A labelled metric's children, looked up once per label values: `labels()` takes a
    lock and checks the values on every call, a few µs a request on the router's path. The
    plane never removes a child, so one found stays valid."""

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class TenantUse(Protocol):
    """What one tenant used of one model, as a router's meter keeps it."""

    @property
    def statuses(self) -> Mapping[int, int]: ...
    @property
    def slot_us(self) -> int: ...
    @property
    def sm_ms(self) -> float: ...


Book = Mapping[tuple[str, str], TenantUse]  # (tenant, model) -> its use


class TenantUsage(Collector):
    """`plane_tenant_requests_total{tenant,model,status}`, `plane_tenant_slot_seconds_total` and
    `plane_tenant_sm_seconds_total{tenant,model}`, read off the routers' meters
    (`plane.router.metering`) when scraped: the meter is the one record, these a view of it.
    Counted as Prometheus counters as well, they cost a placement three increments on the
    router's loop (~3 µs of its CPU, docs/perf); summed here, the loop pays nothing."""

    def __init__(self) -> None:
        self._books: list[Book] = []

    def add(self, book: Book) -> None:
        self._books.append(book)

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        requests, slot_s, sm_s = self._families()
        counts: dict[tuple[str, str, str], int] = {}
        used: dict[tuple[str, str], tuple[int, float]] = {}
        for book in list(self._books):
            # On the scrape's thread while the loop adds: list() copies a dict in one step.
            for (tenant, model), use in list(book.items()):
                for status, n in list(use.statuses.items()):
                    key = (tenant, model, str(status))
                    counts[key] = counts.get(key, 0) + n
                us, sm_ms = used.get((tenant, model), (0, 0.0))
                used[(tenant, model)] = (us + use.slot_us, sm_ms + use.sm_ms)
        for labels, n in sorted(counts.items()):
            requests.add_metric(list(labels), n)
        for (tenant, model), (us, sm_ms) in sorted(used.items()):
            slot_s.add_metric([tenant, model], us / 1e6)
            sm_s.add_metric([tenant, model], sm_ms / 1000)
        return iter((requests, slot_s, sm_s))

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (
            CounterMetricFamily("plane_tenant_requests", "Requests per tenant by final status",
                                labels=["tenant", "model", "status"]),
            CounterMetricFamily("plane_tenant_slot_seconds", "Slot time used per tenant (the "
                                "node's service time, Plane-Service-Us)",
                                labels=["tenant", "model"]),
            CounterMetricFamily("plane_tenant_sm_seconds", "SM-seconds used per tenant (slot "
                                "time x SMs of the slot's partition; 1 off a GPU)",
                                labels=["tenant", "model"]),
        )


class PlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.router_requests = Counter(
            "plane_router_requests",
            "Answers routers gave themselves, by status: refusals, and answers for silent "
            "nodes (a placed request is answered by its node: plane_node_requests_total)",
            ["model", "status"], registry=r)
        self.router_decision_seconds = Histogram(
            "plane_router_decision_seconds", "Router time from receipt to placement/refusal",
            ["model", "outcome"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.router_answered_seconds = Histogram(
            "plane_router_answered_seconds",
            "Requests placed and answered 200 (not streams): from the router's receipt to the "
            "slot's done-event, which the node sends with the answer. What a caller waits, "
            "less its trip to the router and the answer's back; its wait in the router, the "
            "broker and the slot's pull included (plane_slot_service_seconds: the slot alone)",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.refusals = Counter(
            "plane_refusals", "Refusals by reason", ["model", "reason"], registry=r)
        self.behind = Counter(
            "plane_router_behind",
            "Requests refused unread: they waited in the router's inbox past "
            "max_inbox_wait_ms while it was behind", ["model"], registry=r)
        self.shed = Counter(
            "plane_router_shed",
            "Requests refused at once because the router had max_routing requests in hand",
            ["model"], registry=r)
        self.broker_refusals = Counter(
            "plane_broker_slot_refusals", "Slot publishes refused by the broker (depth one)",
            ["model"], registry=r)
        self.stream_silences = Counter(
            "plane_slot_stream_silences", "Slot publishes no stream answered (no leader: a "
            "cluster electing one); the stream's slots pass for a while", ["stream"],
            registry=r)
        self.slots_known = Gauge(
            "plane_slots", "Slots known to the router", ["model", "state"], registry=r)
        self.promises_open = Gauge(
            "plane_promises_open", "Promises (tickets) a router holds open: slot time booked "
            "for refused callers to come back to", ["model"], registry=r)
        self.promise_depth = Gauge(
            "plane_promise_depth", "Promises a slot may hold now for callers told a time: 8, "
            "or 3 while the chain of promises does not drain (overload that lasts); past "
            "it a 429 says overloaded", ["model"], registry=r)
        self.tickets_issued = Counter(
            "plane_tickets_issued", "Tickets handed out with 429s", ["model"], registry=r)
        self.tickets_honoured = Counter(
            "plane_tickets_honoured",
            "Tickets handed out with 429s that were redeemed onto a slot (a newcomer that "
            "waited for its start is not one: plane_tickets_parked)", ["model"], registry=r)
        self.forwarded = Counter(
            "plane_router_forwarded",
            "Requests forwarded to another router: a ticket holder's to the router that made "
            "its promise (why=ticket), a refusal that needs a promise to the router that makes "
            "them (why=promise); outcome: taken (the owner answers the caller), relayed (an "
            "owner of an earlier version answered us), owner-gone, no-answer",
            ["model", "why", "outcome"], registry=r)
        self.parked = Counter(
            "plane_tickets_parked",
            "Ticket holders (and newcomers whose callers do not come back) that waited for a "
            "slot to free",
            ["model"], registry=r)
        self.ticket_lateness = Histogram(
            "plane_ticket_lateness_seconds",
            "How long after its promised time a ticket holder came back (negative: early)",
            ["model"], buckets=(-0.005, -0.001, 0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                0.25, 1.0), registry=r)
        # Metering, per tenant (bounded: plane.router.tenancy) and model, by the router that
        # placed or refused each request.
        self.tenant_usage = TenantUsage()
        r.register(self.tenant_usage)
        self.watchdog_answers = Counter(
            "plane_router_watchdog_answers", "Answers the router gave for silent nodes",
            ["model", "status"], registry=r)
        # A node's, by its id (`node`): the members of a node group (`--processes`) and the
        # nodes of one model in one process (tests, `PlaneStack(nodes_per_model=2)`) number
        # their slots from 0 alike, and one scrape may hold several (`plane up`).
        slot = ["model", "node", "slot"]
        self.node_requests = Counter(
            "plane_node_requests", "Requests finished by nodes", ["model", "status"], registry=r)
        self.service_seconds = Histogram(
            "plane_slot_service_seconds", "Time a request spent on its slot",
            ["model", "node"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.slot_busy = Gauge(
            "plane_slot_busy", "1 while a slot runs a request", slot, registry=r)
        self.slot_healthy = Gauge(
            "plane_slot_healthy", "1 while a slot is claimed and healthy", slot, registry=r)
        self.probe_misses = Counter(
            "plane_probe_misses", "Health probes missed", slot, registry=r)
        self.withdrawals = Counter(
            "plane_slot_withdrawals", "Slots withdrawn", ["model", "node", "cause"],
            registry=r)
        self.pull_silences = Counter(
            "plane_slot_pull_silences", "Slot pulls asked again because the consumer fell "
            "silent (no delivery, no heartbeat: its leader died with its server)",
            slot, registry=r)
        self.slot_busy_seconds = Counter(
            "plane_slot_busy_seconds", "Time slots spent running requests", slot, registry=r)
        # Streams (docs/design.md "Streams"), as the node sees them: from fetching the slot
        # message to its first token's message; the time per token after it, per stream.
        self.stream_first_token_seconds = Histogram(
            "plane_stream_first_token_seconds", "Slot fetch to the first token sent, per stream",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.stream_token_seconds = Histogram(
            "plane_stream_token_seconds", "Time per token after the first, per stream",
            ["model"], buckets=TOKEN_BUCKETS_S, registry=r)
        self.stream_tokens = Counter(
            "plane_stream_tokens", "Tokens sent on streams", ["model"], registry=r)
        self.streams_ended = Counter(
            "plane_streams", "Streams ended, by how (stop, length, cancelled, deadline, error)",
            ["model", "finish"], registry=r)
        self.slot_sm_seconds = Counter(
            "plane_slot_sm_seconds",
            "Busy time x SMs of the slot's partition (SM-seconds; x1000 for SM-ms); only "
            "slots with SMs (CUDA) export it", slot, registry=r)
        # GPU telemetry (gpu_node/telemetry.py): samples only while NVML answers; without
        # NVML the names are declared and carry no sample, never a made-up zero.
        gpu = ["node", "device"]
        self.gpu_utilization = Gauge(
            "plane_gpu_utilization_ratio",
            "Share of NVML's sample period in which a kernel ran (nvidia-smi utilization.gpu)",
            gpu, registry=r)
        self.gpu_sm_clock = Gauge(
            "plane_gpu_sm_clock_hertz", "SM clock", gpu, registry=r)
        self.gpu_memory_used = Gauge(
            "plane_gpu_memory_used_bytes", "Device memory in use (all processes)", gpu,
            registry=r)
        self.gpu_power = Gauge(
            "plane_gpu_power_watts", "Board power draw", gpu, registry=r)
        self.gpu_temperature = Gauge(
            "plane_gpu_temperature_celsius", "GPU core temperature", gpu, registry=r)
        self.gpu_throttle = Gauge(
            "plane_gpu_throttle", "1 while NVML reports this clock-throttle reason",
            [*gpu, "reason"], registry=r)
        self.gpu_ecc_uncorrected = Gauge(
            "plane_gpu_ecc_uncorrected_errors",
            "Uncorrected ECC errors since the driver loaded (volatile count)", gpu, registry=r)
        self.gpu_xid_errors = Counter(
            "plane_gpu_xid_errors", "XID critical errors NVML reported while the node ran",
            gpu, registry=r)


@dataclass(frozen=True)
class ChildMetrics:
    """A child process's /metrics, merged into its parent's (`MergedMetrics`), and the labels
    added to each of its samples: two processes of one role (`plane up --router-per-model`)
    make the same series, told apart by these (each router's id), as Prometheus tells two
    scraped processes apart by their `instance`."""

    url: str
    labels: Mapping[str, str] = field(default_factory=dict)
    role: str = "router"  # what the process is (`plane_child_scrape_up`'s `child` label)


class MergedMetrics(Collector):
    """One exposition of this process's registry and of the /metrics of processes it runs
    (`plane up`'s routers, `plane.router_child`), read at each scrape. Concatenated texts would
    not do: every process registers every `plane_` family, so a family would be declared
    twice (Prometheus refuses a second TYPE line); here each family is declared once with
    the samples of all. Their samples never collide: a family's children are labelled by the
    process that makes them (a router's by model and reason, a node's by node and slot), and
    processes of one role by `ChildMetrics.labels`. A child that does not answer is left out
    of that scrape and said in the log, and `plane_child_scrape_up` says which (0): without
    it a stalled router's series only vanished, and a scrape read as a quiet plane (its
    refusal alerts went blank when the router was in trouble; found from outside)."""

    def __init__(self, own: CollectorRegistry, children: Sequence[ChildMetrics]) -> None:
        self._own = own
        self._children = tuple(children)

    def collect(self) -> Iterator[Metric]:
        # Ours through the text format too: parsed, a counter's `_created` is a family of its
        # own, as it is in the children's texts (collected, it is a sample of the counter's).
        families: dict[str, Metric] = {}
        for family in text_string_to_metric_families(generate_latest(self._own).decode()):
            _merge(families, family)
        up = GaugeMetricFamily(
            "plane_child_scrape_up",
            "1 when this scrape read the child process's /metrics (plane up's routers), 0 "
            "when it did not answer in time (stalled or gone): its series are missing")
        for child in self._children:
            try:
                with urllib.request.urlopen(child.url, timeout=CHILD_SCRAPE_TIMEOUT_S) as r:
                    text = r.read().decode()
            except OSError as exc:
                log.warning("a child process's metrics left out of this scrape", url=child.url,
                            error=str(exc))
                up.add_sample(up.name, {"child": child.role, **child.labels}, 0)
                continue
            up.add_sample(up.name, {"child": child.role, **child.labels}, 1)
            for family in text_string_to_metric_families(text):
                if child.labels:
                    family.samples = [s._replace(labels={**s.labels, **child.labels})
                                      for s in family.samples]
                _merge(families, family)
        if self._children:
            families[up.name] = up
        return iter(families.values())


def _merge(families: dict[str, Metric], family: Metric) -> None:
    if (have := families.get(family.name)) is None:
        have = families[family.name] = Metric(family.name, family.documentation, family.type,
                                              family.unit)
    have.samples.extend(family.samples)


@contextlib.contextmanager
def serve_metrics(
    metrics: PlaneMetrics, port: int | None, host: str = "127.0.0.1",
    children: Sequence[ChildMetrics] = (),
) -> Iterator[Bound | None]:
    """Serve /metrics on `host`:`port` (0 = any free port; loopback unless a deployment asks
    for more, e.g. `--metrics-host 0.0.0.0` in a container) in prometheus_client's own thread
    for the duration of the block; yields where it listens (None when disabled). With
    `children`, the /metrics of those child processes are served merged with ours
    (`MergedMetrics`)."""
    if port is None:
        yield None
        return
    registry = metrics.registry
    if children:
        registry = CollectorRegistry()
        registry.register(MergedMetrics(metrics.registry, children))
    server: WSGIServer
    thread: threading.Thread
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise cannot_listen("metrics", host, port, exc, option="--metrics-port",
                            host_option="--metrics-host") from None
    bound = Bound.of(server)
    try:
        yield bound
    finally:
        stop_http(server, thread, bound)
