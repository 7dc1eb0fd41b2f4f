"""What `plane status` and `plane top` show: every router and node, found through NATS service
discovery (`$SRV.INFO.<service>`, by the plane's service names: what the `router` role may
ask) and asked on their `status` endpoints, plus what Prometheus endpoints
given with `--metrics` add (refusals, tickets, accepted latency, GPU utilisation).

The facts and where each comes from:

| fact | from |
| --- | --- |
| slots, healthy, busy (router's view) | router status |
| promises open, requests in flight, tickets redeemed (of those settled) | router status |
| router cycle p50/p99 (placement to done, beyond requested work) | router status |
| slots, healthy, busy, backend (node's own) | node status |
| GPU utilisation | node status (its last NVML reading), else `plane_gpu_utilization_ratio` |
| refusals, first-retry success (tickets honoured / issued), accepted p50/p99 | `--metrics` |
| slot streams: messages, leader, replicas current/all (a cluster's) | `$JS.API.STREAM.INFO` |

Everything here is bounded in time: a dead server or a silent process costs at most
`timeout_s`, never a hang (a compose health check allows 5 s). What the server refused to
let this connection ask is named as such (`plane.observe.denials`), not as silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterable
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.js.api import DEFAULT_PREFIX as JS_API
from nats.js.api import StreamInfo
from nats.micro.service import ServiceVerb, control_subject
from prometheus_client.parser import text_string_to_metric_families

from plane.contract.config import ConnectOptions
from plane.contract.errors import Unavailable
from plane.contract.natsconn import ROLE_CREDENTIALS, connect_kwargs
from plane.contract.provision import slot_stream_infos
from plane.contract.refusals import refusal_of, what_to_do
from plane.contract.subjects import Names
from plane.observe.denials import Denials

QUIET_S = 0.15  # discovery ends this long after the last service answered
SETTLE_S = 0.5  # for the server's word on what it refused (`_settle`)


class ModelFacts(msgspec.Struct, kw_only=True):
    slots: int = 0
    healthy: int = 0
    busy: int = 0
    # None: unknown, or only the window's prior (no cycle measured lately: `cycle_samples` 0).
    cycle_p50_us: int | None = None
    cycle_p99_us: int | None = None
    cycle_samples: int | None = None  # None: a router too old to say
    # A called holder's way back (router to holder and back), once holders were called lately.
    call_trip_p50_us: int | None = None
    call_trip_p99_us: int | None = None
    # How late holders started past the start they were promised (the p99, by how far ahead
    # it was: `ahead_<k>`, `plane.router.slips.bucket`), once any was placed.
    start_slip_p99_us: dict[str, int] | None = None


class TicketReturns(msgspec.Struct, kw_only=True):
    """A model's tickets settled at a router since it started (`plane.router.ticket_tally`)."""

    redeemed: int = 0
    no_shows: int = 0

    @property
    def settled(self) -> int:
        return self.redeemed + self.no_shows


class RouterFacts(msgspec.Struct, kw_only=True):
    router: str
    models: dict[str, ModelFacts]
    promises_open: int | None = None
    in_flight: int | None = None
    # The router's recent average of redeemed tickets, which decides whether promises pin
    # slot time: it starts at 1 and moves a tenth of the way per ticket settled, so it is no
    # share of tickets (16 no-shows: 18.5%). `ticket_returns` counts them.
    redemption: dict[str, float] = {}
    ticket_returns: dict[str, TicketReturns] = {}  # empty: none settled, or a router too old
    ticket_stats: dict[str, int] = {}  # what ticket holders found (parked, refused, late)
    # How long the router has been behind on its inbox (0: it is not; None: not reported).
    behind_ms: int | None = None


class NodeFacts(msgspec.Struct, kw_only=True):
    node: str
    model: str
    backend: str
    slots: int
    healthy: int
    busy: int | None = None  # None: a node too old to say
    gpu_util_pct: float | None = None


class SlotStreamFacts(msgspec.Struct, kw_only=True):
    """One slot stream as the broker says (`plane.contract.provision`: one on a server, one
    per replica in a cluster, each with its leader)."""

    stream: str
    messages: int  # requests on slots now (each slot holds one at most)
    leader: str | None = None  # a cluster's; None on a single server
    replicas: int = 1
    current: int = 1  # replicas up to date, the leader included
    # False: a node's slots are in it, and it did not answer (no leader: a cluster electing
    # one); `messages` and `replicas` are then not known.
    answered: bool = True


class MetricsFacts(msgspec.Struct, kw_only=True):
    """One /metrics endpoint, totals since its process started (rates: `plane top`)."""

    url: str
    error: str | None = None
    refusals: float = 0.0
    placements: float = 0.0
    tickets_issued: float = 0.0
    tickets_honoured: float = 0.0
    first_retry_success: float | None = None  # honoured / issued
    # plane_router_answered_seconds (else plane_slot_service_seconds), interpolated
    accepted_p50_ms: float | None = None
    accepted_p99_ms: float | None = None
    gpu_util_pct: dict[str, float] = {}  # "node/device" -> %
    refusals_per_s: float | None = None  # `plane top` only: from two scrapes
    buckets: dict[float, float] = {}  # accepted latency histogram (cumulative, summed)
    # Refused unread by a router behind on its inbox (plane_router_behind_total: its CPU is
    # the limit), and its decisions' time from receipt, all outcomes.
    refused_unread: float = 0.0
    refused_unread_per_s: float | None = None  # `plane top` only: from two scrapes
    decision_p50_ms: float | None = None
    decision_p99_ms: float | None = None
    decision_buckets: dict[float, float] = {}


class PlaneView(msgspec.Struct, kw_only=True):
    routers: list[RouterFacts]
    nodes: list[NodeFacts]
    slot_streams: list[SlotStreamFacts] = []
    metrics: list[MetricsFacts] = []
    problems: list[str] = []
    took_ms: float = 0.0
    # The one router whose health this view is about (`plane status --router`: a router's
    # own health check); None: the plane's.
    router: str | None = None
    # False: the server could not be reached or refused us; `problems` says why, and there
    # is nothing else to show.
    connected: bool = True

    @property
    def healthy(self) -> bool:
        """A router and a node answer, and some slot is healthy to a router; with `router`,
        that router answers and sees a healthy slot (so it has a node)."""
        routers = [r for r in self.routers if self.router in (None, r.router)]
        return bool(routers) and (self.router is not None or bool(self.nodes)) and any(
            m.healthy > 0 for r in routers for m in r.models.values())


async def connect_fast(opts: ConnectOptions, timeout_s: float,
                       denials: Denials | None = None) -> Client:
    """One try per server, bounded by `timeout_s` (the commands that serve retry for ten
    seconds; a health check must not). `denials` hears what the server refuses it."""
    async def quiet(exc: Exception) -> None:
        return None

    kw = {**connect_kwargs(opts), "max_reconnect_attempts": 1, "allow_reconnect": False,
          "connect_timeout": timeout_s, "reconnect_time_wait": 0.05}
    try:
        async with asyncio.timeout(timeout_s):
            return await nats.connect(
                **kw, error_cb=denials.on_error if denials is not None else quiet)
    except Exception as exc:
        refusal = refusal_of(exc)
        if refusal is not None:
            raise Unavailable(f"cannot connect to NATS at {opts.url}: {exc}: "
                              f"{what_to_do(refusal, credentials=ROLE_CREDENTIALS)}") from exc
        raise Unavailable(f"cannot connect to NATS at {opts.url}: {exc!r}") from exc


async def _gather_replies(nc: Client, subject: str, timeout_s: float) -> list[dict[str, Any]]:
    """Every answer to one request on `subject` until QUIET_S passes without one."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    out: list[dict[str, Any]] = []
    try:
        await nc.publish(subject, b"", reply=inbox)
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                m = await sub.next_msg(timeout=min(left, QUIET_S if out else left))
            except (TimeoutError, nats.errors.TimeoutError):
                break
            if not m.data:  # the server's "no responders"
                break
            with contextlib.suppress(ValueError):
                out.append(json.loads(m.data))
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


def _status_subject(info: dict[str, Any]) -> str | None:
    for ep in info.get("endpoints") or []:
        if ep.get("name") == "status":
            return str(ep.get("subject"))
    return None


def model_facts(v: dict[str, Any]) -> ModelFacts:
    """A model's entry in a router's status. A cycle of no samples is the window's prior
    (`ServiceWindow.prior_us`, 1000 µs): shown as measured, `plane status` said "cycle
    p50/p99 1000/1000 µs" seconds after the load stopped. It is unknown (`-`) instead."""
    samples = v.get("overhead_samples")
    measured = samples != 0
    return ModelFacts(slots=v.get("slots", 0), healthy=v.get("healthy", 0),
                      busy=v.get("busy", 0),
                      cycle_p50_us=v.get("p50_overhead_us") if measured else None,
                      cycle_p99_us=v.get("p99_overhead_us") if measured else None,
                      cycle_samples=samples,
                      call_trip_p50_us=v.get("call_trip_p50_us"),
                      call_trip_p99_us=v.get("call_trip_p99_us"),
                      start_slip_p99_us=v.get("start_slip_p99_us"))


def router_facts(body: dict[str, Any]) -> RouterFacts:
    return RouterFacts(
        router=str(body.get("router", "?")),
        models={m: model_facts(v) for m, v in (body.get("models") or {}).items()},
        promises_open=body.get("tickets"), in_flight=body.get("inflight"),
        redemption=body.get("redemption") or {},
        ticket_returns={m: TicketReturns(redeemed=int(v.get("redeemed", 0)),
                                         no_shows=int(v.get("no_shows", 0)))
                        for m, v in (body.get("ticket_returns") or {}).items()},
        ticket_stats=body.get("ticket_stats") or {}, behind_ms=body.get("behind_ms"))


def node_facts(body: dict[str, Any]) -> NodeFacts:
    slots = body.get("slots") or []
    busy = body.get("busy")
    gpu = body.get("gpu") or {}
    return NodeFacts(
        node=str(body.get("node", "?")), model=str(body.get("model", "?")),
        backend=str(body.get("backend", "?")), slots=len(slots),
        healthy=sum(1 for s in slots if s.get("healthy")),
        busy=None if busy is None else sum(1 for b in busy if b),
        gpu_util_pct=gpu.get("utilization_pct"))


async def collect(nc: Client, names: Names, *, timeout_s: float = 1.0,
                  denials: Denials | None = None, router: str | None = None) -> PlaneView:
    """Find the plane's services and ask each for its status, within about `timeout_s`.
    `denials`: the connection's (`connect_fast`), to name what the server refused as such;
    `router`: the router whose health the view is about (`PlaneView.router`)."""
    t0 = time.monotonic()
    told = denials if denials is not None else Denials(None)
    services = (names.router_service, names.node_service)
    found = await asyncio.gather(*(
        _gather_replies(nc, control_subject(ServiceVerb.INFO, s), timeout_s / 2)
        for s in services))
    wanted = [(i.get("name"), _status_subject(i)) for infos in found for i in infos
              if i.get("name") in services]
    problems: list[str] = []

    async def ask(kind: str, subject: str) -> tuple[str, dict[str, Any] | None]:
        try:
            m = await nc.request(subject, b"", timeout=timeout_s / 2)
            return kind, json.loads(m.data)
        except Exception as exc:
            await _settle(nc)
            if not told.refused(subject):
                problems.append(f"{subject}: no answer ({type(exc).__name__})")
            return kind, None

    answers, infos = await asyncio.gather(
        asyncio.gather(*(ask(str(k), s) for k, s in wanted if s is not None)),
        slot_stream_infos(nc.jetstream(timeout=timeout_s / 2), names))
    routers = sorted((router_facts(b) for k, b in answers
                      if b is not None and k == names.router_service), key=lambda r: r.router)
    nodes = sorted((node_facts(b) for k, b in answers
                    if b is not None and k == names.node_service), key=lambda n: n.node)
    problems.extend(behind_problems(routers))
    await _settle(nc)  # the server's refusals, if any, are in
    used = streams_in_use(b for k, b in answers if b is not None and k == names.node_service)
    streams, unanswered = slot_stream_facts(
        [(n, i) for n, i in infos if not told.refused(f"{JS_API}.STREAM.INFO.{n}")], used)
    problems.extend(f"slot stream {name}: no answer ({why}): no leader (a cluster electing "
                    "one)?" for name, why in unanswered)
    for service, none in ((names.router_service, not routers), (names.node_service, not nodes)):
        if none and not told.refused(control_subject(ServiceVerb.INFO, service)):
            what = "router" if service == names.router_service else "node"
            problems.append(f"no {what} answers (plane {what}, or plane up)")
    if router is not None and routers and router not in {r.router for r in routers}:
        problems.append(f"router {router} does not answer (the others do)")
    problems.extend(told.problems())
    return PlaneView(routers=routers, nodes=nodes, slot_streams=streams, problems=problems,
                     took_ms=(time.monotonic() - t0) * 1000, router=router)


async def _settle(nc: Client) -> None:
    """Until the server has answered everything sent so far (its -ERR of a refusal comes
    before the PONG), briefly: a dead server must not hold a health check up."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(SETTLE_S):
            await nc.flush()


# A router behind on its inbox this long is named among the problems: a burst puts one behind
# for tens of milliseconds; a second on end is a load past what its CPU decides.
BEHIND_PROBLEM_MS = 1000


def behind_problems(routers: list[RouterFacts]) -> list[str]:
    """The routers that have been behind on their inbox for BEHIND_PROBLEM_MS or more."""
    return [f"router {r.router} has been behind on its inbox for {r.behind_ms} ms: its CPU "
            f"is the plane's limit (give it a core of its own, or add a router)"
            for r in routers if r.behind_ms is not None and r.behind_ms >= BEHIND_PROBLEM_MS]


def streams_in_use(node_bodies: Iterable[dict[str, Any]]) -> set[str] | None:
    """The slot streams the nodes' slots are in, as their status says (each slot's advert
    names its stream); None: no node named one (none answered, or all predate `stream`)."""
    used = {str(s["stream"]) for b in node_bodies for s in b.get("slots") or []
            if s.get("stream")}
    return used or None


def slot_stream_facts(infos: list[tuple[str, StreamInfo | Exception]],
                      used: set[str] | None) -> tuple[list[SlotStreamFacts], list[tuple[str, str]]]:
    """The slot streams as the broker said (`slot_stream_infos`), and those that did not
    answer (name, why). A stream that did not answer is one only if a node's slot is in it
    (`used`; None: nobody can say, so each counts): in a cluster electing its meta leader,
    asking about a name no stream has times out as well, and every possible shard was named a
    problem while only the stream that had lost its leader was one. That one is listed too,
    without a leader (`answered` False)."""
    facts: list[SlotStreamFacts] = []
    unanswered: list[tuple[str, str]] = []
    for name, info in infos:
        if isinstance(info, Exception):
            if used is None or name in used:
                unanswered.append((name, type(info).__name__))
                facts.append(SlotStreamFacts(stream=name, messages=0, current=0,
                                             answered=False))
            continue
        c = info.cluster
        if c is None or not c.replicas:
            facts.append(SlotStreamFacts(stream=name, messages=info.state.messages,
                                         leader=c.leader if c else None))
            continue
        facts.append(SlotStreamFacts(
            stream=name, messages=info.state.messages, leader=c.leader,
            replicas=1 + len(c.replicas),
            current=int(bool(c.leader)) + sum(1 for p in c.replicas if p.current)))
    return facts, unanswered


# -- Prometheus endpoints ----------------------------------------------------------------------
def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus's histogram_quantile on cumulative buckets (upper bound -> count)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == float("inf"):
                return prev_bound
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return None


def _ms(buckets: dict[float, float], q: float) -> float | None:
    s = bucket_quantile(buckets, q)
    return None if s is None else 1000 * s


def metrics_facts(url: str, text: str) -> MetricsFacts:
    f = MetricsFacts(url=url)
    buckets: dict[float, float] = {}
    answered: dict[float, float] = {}
    decisions: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            match s.name:
                case "plane_refusals_total":
                    f.refusals += s.value
                case "plane_router_decision_seconds_count" if s.labels.get("outcome") == "placed":
                    f.placements += s.value
                case "plane_tickets_issued_total":
                    f.tickets_issued += s.value
                case "plane_tickets_honoured_total":
                    f.tickets_honoured += s.value
                case "plane_slot_service_seconds_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                case "plane_router_answered_seconds_bucket":
                    le = float(s.labels["le"])
                    answered[le] = answered.get(le, 0.0) + s.value
                case "plane_gpu_utilization_ratio":
                    key = f"{s.labels.get('node', '')}/{s.labels.get('device', '')}"
                    f.gpu_util_pct[key] = 100 * s.value
                case "plane_router_behind_total":
                    f.refused_unread += s.value
                case "plane_router_decision_seconds_bucket":
                    le = float(s.labels["le"])
                    decisions[le] = decisions.get(le, 0.0) + s.value
    # Accepted latency as callers wait for it, from a router's /metrics (its receipt to the
    # answer); a node's alone has only the time on the slot.
    if any(answered.values()):
        buckets = answered
    f.buckets, f.decision_buckets = buckets, decisions
    return with_latency(f, buckets, decisions)


def with_latency(f: MetricsFacts, buckets: dict[float, float],
                 decisions: dict[float, float]) -> MetricsFacts:
    f.accepted_p50_ms, f.accepted_p99_ms = _ms(buckets, 0.5), _ms(buckets, 0.99)
    f.decision_p50_ms, f.decision_p99_ms = _ms(decisions, 0.5), _ms(decisions, 0.99)
    f.first_retry_success = (f.tickets_honoured / f.tickets_issued if f.tickets_issued
                             else None)
    return f


def scrape(url: str, timeout_s: float) -> MetricsFacts:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return metrics_facts(url, resp.read().decode())
    except (OSError, ValueError) as exc:
        return MetricsFacts(url=url, error=f"{type(exc).__name__}: {exc}")


def over_interval(new: MetricsFacts, old: MetricsFacts | None, dt_s: float) -> MetricsFacts:
    """What happened between two scrapes: refusals per second, and first-retry success and
    accepted p50/p99 of that interval alone (`plane top`)."""
    if old is None or old.error or new.error or dt_s <= 0:
        return new
    f = msgspec.structs.replace(
        new, tickets_issued=new.tickets_issued - old.tickets_issued,
        tickets_honoured=new.tickets_honoured - old.tickets_honoured,
        refusals_per_s=max(0.0, new.refusals - old.refusals) / dt_s,
        refused_unread_per_s=max(0.0, new.refused_unread - old.refused_unread) / dt_s)
    return with_latency(f, bucket_delta(new.buckets, old.buckets),
                        bucket_delta(new.decision_buckets, old.decision_buckets))


def bucket_delta(new: dict[float, float], old: dict[float, float]) -> dict[float, float]:
    """Cumulative histogram buckets over an interval: the later counts less the earlier."""
    return {b: c - old.get(b, 0.0) for b, c in new.items()}
