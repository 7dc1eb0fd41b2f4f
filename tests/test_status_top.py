"""`plane status` and `plane top` against real planes: the facts of every router and node (and
of /metrics when given), an exit code a health check can use, fast against a live plane and
a dead server alike; the pure parts (histogram quantiles, rates between two scrapes)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
from nats.js.api import ClusterInfo, PeerInfo, StreamConfig, StreamInfo, StreamState
from rich.console import Console

from plane.contract.subjects import Names
from plane.observe.denials import Denials
from plane.observe.planeview import (
    MetricsFacts,
    PlaneView,
    behind_problems,
    bucket_quantile,
    collect,
    connect_fast,
    metrics_facts,
    over_interval,
    router_facts,
    slot_stream_facts,
    streams_in_use,
)
from plane.observe.top import routers_table, run_top
from plane.router.occupancy import CYCLE_MAX_AGE_S
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import calibrated, client

PLANE = str(Path(sys.executable).parent / "plane")
HEALTH_CHECK_S = 5.0  # what a compose health check allows


async def _status(*args: str) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = await asyncio.create_subprocess_exec(
        PLANE, "status", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - t0


async def _load(url: str) -> None:
    """Answers, refusals and tickets: one slot, four at once."""
    async with client(url) as nc:
        await asyncio.gather(*(nc.request("plane.infer.calibrated", calibrated(30_000),
                                          timeout=5) for _ in range(4)))


async def test_status_prints_every_router_and_node_and_exits_0() -> None:
    async with PlaneStack(StackConfig(models=("calibrated", "risk"), slots=1,
                                      metrics_port=0)) as stack:
        await _load(stack.url)
        metrics = f"http://127.0.0.1:{stack.metrics_port}/metrics"
        code, out, err, took_s = await _status("--nats", stack.url, "--json",
                                               "--metrics", metrics)
        text_code, text, _, _ = await _status("--nats", stack.url)
    assert code == 0, err
    assert took_s < HEALTH_CHECK_S
    s = json.loads(out)
    assert s["healthy"] is True and not s["problems"]
    (r,) = s["routers"]
    assert r["router"] == "router0" and r["promises_open"] is not None
    assert r["behind_ms"] == 0  # it keeps up with this load
    assert r["ticket_stats"] == {}  # tickets issued, but no holder came back with one
    assert r["models"]["calibrated"]["slots"] == 1 and r["models"]["calibrated"]["healthy"] == 1
    assert {n["node"] for n in s["nodes"]} == {"node0-calibrated", "node0-risk"}
    for n in s["nodes"]:
        assert n["slots"] == 1 and n["healthy"] == 1 and n["busy"] == 0
        assert n["gpu_util_pct"] is None  # no GPU here: nothing made up
    (slots,) = s["slot_streams"]  # one server: the one shared stream
    assert slots["stream"] == "PLANE_SLOTS" and slots["messages"] == 0
    (m,) = s["metrics"]
    assert m["error"] is None and m["refusals"] >= 1 and m["tickets_issued"] >= 1
    assert m["accepted_p50_ms"] is not None and 20 <= m["accepted_p50_ms"] <= 100
    assert text_code == 0
    for word in ("routers", "nodes", "router0", "node0-risk", "healthy", "--metrics",
                 "node0-calibrated", "cycle p50/p99", "slot streams", "PLANE_SLOTS"):
        assert word in text, word
    assert "…" not in text, text  # into a pipe, no column is cut short


async def test_a_cycle_nobody_measured_is_shown_as_unknown_not_as_the_prior() -> None:
    """Before any placement, and again once the router's samples aged out after the load,
    `plane status` showed the window's prior as "cycle p50/p99 1000/1000 µs"."""
    async with PlaneStack(StackConfig(models=("calibrated",), slots=1)) as stack:
        fresh = await _status("--nats", stack.url, "--json")
        fresh_text = await _status("--nats", stack.url)
        async with client(stack.url) as nc:
            async def load() -> None:  # through the status call: samples age out in 2 s
                while True:
                    await nc.request("plane.infer.calibrated", calibrated(2_000), timeout=5)
                    await asyncio.sleep(0.05)

            loading = asyncio.create_task(load())
            await asyncio.sleep(0.5)
            loaded = await _status("--nats", stack.url, "--json")
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
        await asyncio.sleep(CYCLE_MAX_AGE_S + 1.5)  # the samples age out (the watchdog's tick)
        quiet = await _status("--nats", stack.url, "--json")
    for code, _, err, _ in (fresh, loaded, quiet):
        assert code == 0, err
    [before, during, after] = [json.loads(out)["routers"][0]["models"]["calibrated"]
                               for _, out, _, _ in (fresh, loaded, quiet)]
    assert before["cycle_samples"] == 0 and before["cycle_p50_us"] is None
    assert before["cycle_p99_us"] is None
    assert during["cycle_samples"] >= 1 and during["cycle_p50_us"] is not None
    assert after["cycle_samples"] == 0 and after["cycle_p50_us"] is None
    assert "1000/1000" not in fresh_text[1], fresh_text[1]


async def test_tickets_redeemed_is_a_count_of_the_tickets_settled() -> None:
    """Tickets nobody comes back for: "tickets redeemed" was the router's average, which
    starts at 100% (18.5% after 16 no-shows, beside first-retry success 0.0%). It is the
    count now: none of those settled."""
    async with PlaneStack(StackConfig(models=("calibrated",), slots=1)) as stack:
        await _load(stack.url)  # refusals with tickets; nobody comes back with one
        async with client(stack.url) as nc:
            for _ in range(100):  # until they lapse (the watchdog's tick)
                view = await collect(nc, Names(), timeout_s=1.0)
                (r,) = view.routers
                if (t := r.ticket_returns.get("calibrated")) is not None and t.no_shows:
                    break
                await asyncio.sleep(0.1)
    assert t is not None and t.redeemed == 0 and t.no_shows >= 1, r
    assert r.redemption["calibrated"] > 0.5  # what the column showed: 90% after one
    out = io.StringIO()
    Console(file=out, width=200).print(routers_table(view))
    assert f"0/{t.no_shows} (0%)" in out.getvalue(), out.getvalue()


async def test_status_of_a_dead_server_is_unhealthy_and_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once closed
    code, out, err, took_s = await _status("--nats", f"nats://127.0.0.1:{port}", "--json")
    assert code == 1, err
    assert took_s < 3.0
    s = json.loads(out)
    assert s["healthy"] is False and "cannot connect" in s["problems"][0]


async def test_status_without_nodes_is_unhealthy(nats_server: object) -> None:
    async with PlaneStack(StackConfig(models=("calibrated",), slots=1)) as stack:
        for node in stack.nodes:
            await node.stop()
        code, out, _, took_s = await _status("--nats", stack.url, "--json")
    assert code == 1 and took_s < HEALTH_CHECK_S
    assert "no node answers" in " ".join(json.loads(out)["problems"])


async def test_status_without_nats_says_what_it_cannot_do() -> None:
    code, _, err, _ = await _status()
    assert code == 2 and "Without --nats there is nothing to ask" in err


async def test_top_refreshes_with_rates_over_each_interval() -> None:
    async with PlaneStack(StackConfig(models=("calibrated",), slots=1,
                                      metrics_port=0)) as stack:
        metrics = f"http://127.0.0.1:{stack.metrics_port}/metrics"
        async with client(stack.url) as nc:
            out = io.StringIO()
            top = asyncio.create_task(run_top(
                nc, Names(), [metrics], interval_s=0.5, iterations=3,
                console=Console(file=out, width=160, force_terminal=False)))
            await asyncio.sleep(0.3)
            await _load(stack.url)
            view = await top
    text = out.getvalue()
    assert "router0" in text and "node0-calibrated" in text and "refusals/s" in text
    (m,) = view.metrics
    assert m.refusals_per_s is not None  # a rate: two scrapes apart


async def test_collect_is_bounded_without_any_service(nats_server: object) -> None:
    from plane.contract.config import ConnectOptions

    nc = await connect_fast(ConnectOptions(url=nats_server.url), 1.0)  # type: ignore[attr-defined]
    try:
        t0 = time.monotonic()
        view = await collect(nc, Names(), timeout_s=1.0)
    finally:
        await nc.close()
    assert time.monotonic() - t0 < 1.5
    assert not view.healthy and view.routers == [] and view.nodes == []


# -- pure --------------------------------------------------------------------------------------
def test_histogram_quantile_like_prometheus() -> None:
    # 90 answers under 1 ms, 10 between 5 and 10 ms (cumulative buckets).
    b = {0.0005: 0.0, 0.001: 90.0, 0.005: 90.0, 0.01: 100.0, float("inf"): 100.0}
    assert bucket_quantile(b, 0.5) == pytest.approx(0.0005 + 0.0005 * 50 / 90)
    assert bucket_quantile(b, 0.99) == pytest.approx(0.0095)
    assert bucket_quantile({float("inf"): 0.0}, 0.5) is None


METRICS_TEXT = """\
# TYPE plane_refusals counter
plane_refusals_total{model="risk",reason="busy"} 30.0
plane_refusals_total{model="risk",reason="deadline"} 10.0
# TYPE plane_tickets_issued counter
plane_tickets_issued_total{model="risk"} 30.0
# TYPE plane_tickets_honoured counter
plane_tickets_honoured_total{model="risk"} 27.0
# TYPE plane_slot_service_seconds histogram
plane_slot_service_seconds_bucket{model="risk",le="0.001"} 90.0
plane_slot_service_seconds_bucket{model="risk",le="0.01"} 100.0
plane_slot_service_seconds_bucket{model="risk",le="+Inf"} 100.0
plane_slot_service_seconds_count{model="risk"} 100.0
plane_slot_service_seconds_sum{model="risk"} 0.2
# TYPE plane_gpu_utilization_ratio gauge
plane_gpu_utilization_ratio{device="0",node="gpu-1"} 0.42
# TYPE plane_router_behind counter
plane_router_behind_total{model="risk"} 4.0
# TYPE plane_router_decision_seconds histogram
plane_router_decision_seconds_bucket{model="risk",outcome="placed",le="0.001"} 60.0
plane_router_decision_seconds_bucket{model="risk",outcome="placed",le="0.1"} 60.0
plane_router_decision_seconds_bucket{model="risk",outcome="placed",le="+Inf"} 60.0
plane_router_decision_seconds_bucket{model="risk",outcome="refused",le="0.001"} 30.0
plane_router_decision_seconds_bucket{model="risk",outcome="refused",le="0.1"} 40.0
plane_router_decision_seconds_bucket{model="risk",outcome="refused",le="+Inf"} 40.0
"""


def test_metrics_facts_and_rates_between_two_scrapes() -> None:
    old = metrics_facts("u", METRICS_TEXT)
    assert old.refusals == 40 and old.first_retry_success == pytest.approx(0.9)
    assert old.gpu_util_pct == {"gpu-1/0": pytest.approx(42.0)}
    assert old.accepted_p50_ms == pytest.approx(1000 * 0.001 * 50 / 90)
    # Decisions from receipt, summed over outcomes: 90 within 1 ms, 10 more within 100 ms.
    assert old.refused_unread == 4
    assert old.decision_p50_ms == pytest.approx(1000 * 0.001 * 50 / 90)
    assert old.decision_p99_ms == pytest.approx(1000 * (0.001 + 0.099 * 9 / 10))
    new = metrics_facts("u", METRICS_TEXT.replace(" 30.0\n", " 50.0\n")
                        .replace("} 27.0", "} 47.0").replace("} 4.0", "} 10.0")
                        .replace('refused",le="0.1"} 40.0', 'refused",le="0.1"} 80.0')
                        .replace('refused",le="+Inf"} 40.0', 'refused",le="+Inf"} 80.0'))
    rate = over_interval(new, old, 2.0)
    assert rate.refusals_per_s == pytest.approx(10.0)  # 20 more busy refusals in 2 s
    assert rate.refused_unread_per_s == pytest.approx(3.0)  # 6 more in 2 s
    # In the interval: 20 decided within 1 ms (that bucket 30 -> 50), all 40 within 100 ms.
    assert rate.decision_p99_ms == pytest.approx(1000 * (0.001 + 0.099 * 19.6 / 20))
    assert rate.first_retry_success == pytest.approx(1.0)  # 20 of 20 in the interval
    assert rate.accepted_p50_ms is None  # no answers in the interval
    assert over_interval(new, None, 0.0).refusals_per_s is None
    assert over_interval(MetricsFacts(url="u", error="down"), old, 1.0).error == "down"


def test_accepted_latency_is_what_callers_waited_when_a_router_says() -> None:
    """A router's /metrics has the time from its receipt to the answer: accepted p50/p99 are
    read from it (the slot's own time cannot show a wait before the slot); a node's alone
    gives the slot's time."""
    answered = METRICS_TEXT + """# TYPE plane_router_answered_seconds histogram
plane_router_answered_seconds_bucket{model="risk",le="0.001"} 10.0
plane_router_answered_seconds_bucket{model="risk",le="0.01"} 100.0
plane_router_answered_seconds_bucket{model="risk",le="+Inf"} 100.0
"""
    f = metrics_facts("u", answered)
    assert f.accepted_p50_ms == pytest.approx(1000 * (0.001 + 0.009 * 40 / 90))
    assert metrics_facts("u", METRICS_TEXT).accepted_p50_ms == pytest.approx(
        1000 * 0.001 * 50 / 90)


def test_router_facts_keep_the_call_trips_a_router_reports() -> None:
    """A router that called holders lately reports their way back (`plane status --json`
    shows it); one that did not leaves the fields out, and they read as unknown."""
    body = {"router": "r0", "models": {
        "tinylm": {"slots": 1, "healthy": 1, "busy": 1, "p50_overhead_us": 900,
                   "p99_overhead_us": 1500, "call_trip_p50_us": 700, "call_trip_p99_us": 2100,
                   "start_slip_p99_us": {"ahead_0": 1200, "ahead_2": 4200}},
        "calibrated": {"slots": 2, "healthy": 2, "busy": 0}}}
    r = router_facts(body)
    assert r.behind_ms is None  # a router of an earlier version does not say
    behind = router_facts({**body, "behind_ms": 1200})
    assert behind.behind_ms == 1200
    # Named among the problems once it has lasted a second; a burst's moment is not.
    (problem,) = behind_problems([r, behind, router_facts({**body, "behind_ms": 40})])
    assert "r0 has been behind on its inbox for 1200 ms" in problem and "add a router" in problem
    called, quiet = r.models["tinylm"], r.models["calibrated"]
    assert (called.call_trip_p50_us, called.call_trip_p99_us) == (700, 2100)
    assert called.cycle_p50_us == 900
    assert quiet.call_trip_p50_us is None and quiet.call_trip_p99_us is None
    assert called.start_slip_p99_us == {"ahead_0": 1200, "ahead_2": 4200}
    assert quiet.start_slip_p99_us is None


def test_a_cycle_of_no_samples_is_unknown_and_an_older_routers_figure_is_kept() -> None:
    """`overhead_samples` 0: the p50/p99 a router reports are its window's prior (1000 µs),
    shown as `-`; a router too old to report the count keeps its figures."""
    r = router_facts({"router": "r0", "models": {
        "calibrated": {"slots": 1, "healthy": 1, "busy": 0, "p50_overhead_us": 1000,
                       "p99_overhead_us": 1000, "overhead_samples": 0},
        "risk": {"slots": 1, "healthy": 1, "busy": 0, "p50_overhead_us": 900,
                 "p99_overhead_us": 1500}}})
    prior, older = r.models["calibrated"], r.models["risk"]
    assert (prior.cycle_p50_us, prior.cycle_p99_us, prior.cycle_samples) == (None, None, 0)
    assert (older.cycle_p50_us, older.cycle_p99_us, older.cycle_samples) == (900, 1500, None)
    out = io.StringIO()
    Console(file=out, width=200).print(routers_table(PlaneView(routers=[r], nodes=[])))
    assert "1000/1000" not in out.getvalue() and "900/1500 µs" in out.getvalue()


async def test_what_the_server_refused_is_named_with_its_subject_not_taken_for_silence() -> None:
    # nats-py hands the server's -ERR to the error callback, lowercased.
    d = Denials("gateway")
    violation = "nats: permissions violation for {} to \"{}\""
    await d.on_error(Exception(violation.format("publish", "$srv.info.plane-router")))
    await d.on_error(Exception("nats: some other error"))
    assert not d.refused("$SRV.INFO.plane-node")
    assert d.refused("$SRV.INFO.plane-router")
    [told] = d.problems()
    assert told.startswith(
        'not allowed: user "gateway" may not publish to $SRV.INFO.plane-router '), told
    # What no asking named: the inbox (no reply could come back).
    d = Denials("gateway")
    await d.on_error(Exception(violation.format("subscription", "_inbox.x.*")))
    assert [p.split(" (")[0] for p in d.problems()] == [
        'not allowed: user "gateway" may not subscribe to _inbox.x.*']


async def test_a_user_refused_everywhere_is_told_so_once_and_to_use_admin() -> None:
    """A tenant running `plane status` was refused on every router's, node's and slot
    stream's subject: eight near-identical sentences. Now one, saying what to do."""
    d = Denials("acme")
    subjects = ["$srv.info.plane-router", "$srv.info.plane-node",
                *(f"$js.api.stream.info.plane_slots_{i}" for i in range(5))]
    for subject in subjects:
        await d.on_error(Exception(f'nats: permissions violation for publish to "{subject}"'))
    assert all(d.refused(s.upper()) for s in subjects)
    [told] = d.problems()
    assert told.startswith('not allowed: user "acme" may not publish to $SRV.INFO.PLANE-ROUTER '
                           "(nor to 6 more subjects"), told
    assert "a tenant" in told and "run it as admin" in told, told


def _led(name: str, leader: str) -> StreamInfo:
    peers = [PeerInfo(name=p, current=True) for p in ("c0", "c1", "c2") if p != leader]
    state = StreamState(messages=1, bytes=0, first_seq=1, last_seq=1, consumer_count=1)
    return StreamInfo(config=StreamConfig(name=name), state=state,
                      cluster=ClusterInfo(leader=leader, replicas=peers))


def test_a_cluster_electing_names_only_the_slot_stream_in_use_that_has_no_leader() -> None:
    """A cluster electing its leaders (a server killed): asking about a name no stream has
    times out too, and `plane status` named PLANE_SLOTS, _3 and _4 (which did not exist) as
    leaderless problems beside _0, and listed only _1 and _2. Now: the nodes say which
    streams their slots are in; only _0 is a problem, and it is listed without a leader."""
    n = Names()
    node_bodies = [{"node": f"node0-{m}", "slots": [
        {"k": k, "stream": n.slot_shard_stream(k % 3)} for k in range(3)]}
        for m in ("calibrated", "risk")]
    used = streams_in_use(node_bodies)
    assert used == {n.slot_shard_stream(i) for i in range(3)}
    infos: list[tuple[str, StreamInfo | Exception]] = [
        (n.slots_stream, TimeoutError()), (n.slot_shard_stream(0), TimeoutError()),
        (n.slot_shard_stream(1), _led(n.slot_shard_stream(1), "c0")),
        (n.slot_shard_stream(2), _led(n.slot_shard_stream(2), "c1")),
        (n.slot_shard_stream(3), TimeoutError()), (n.slot_shard_stream(4), TimeoutError())]
    facts, unanswered = slot_stream_facts(infos, used)
    assert unanswered == [(n.slot_shard_stream(0), "TimeoutError")]
    assert [(f.stream, f.answered, f.leader) for f in facts] == [
        ("PLANE_SLOTS_0", False, None), ("PLANE_SLOTS_1", True, "c0"),
        ("PLANE_SLOTS_2", True, "c1")]
    assert [(f.current, f.replicas) for f in facts[1:]] == [(3, 3), (3, 3)]
    # Nodes that name no stream (none answered, or too old to say): each silence counts.
    assert streams_in_use([{"node": "old", "slots": [{"k": 0}]}]) is None
    _, unanswered = slot_stream_facts(infos, None)
    assert [name for name, _ in unanswered] == [
        "PLANE_SLOTS", "PLANE_SLOTS_0", "PLANE_SLOTS_3", "PLANE_SLOTS_4"]
