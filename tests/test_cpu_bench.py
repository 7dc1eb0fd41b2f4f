"""Smoke test of the CPU-per-request benchmark: both paths start, every load is measured,
every process's CPU and wake-ups are read, and the JSON comes out. (The real run is 20 s per
load and path: see docs/perf/README.md.)"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def test_cpu_per_request_smoke() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "cpu_per_request.py"),
        "--requests", "300", "--warmup", "50", "--idle", "0.5", "--settle", "0", "--slots", "2",
        "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    data = json.loads(out)
    rows = data["rows"]
    assert [(r["system"], r["load"].split(",")[0]) for r in rows] == [
        (s, load) for load in ("closed", "closed", "open", "refusals")
        for s in ("floor", "plane")]
    for r in rows[:6]:
        assert r["requests"] == 300 and r["statuses"].get("200", 0) > 0
        roles = {"echo", "nats-server"} if r["system"] == "floor" else {
            "router", "node", "nats-server"}
        assert set(r["cpu_us"]) == roles
        assert set(r["wakes"]) == roles
    # Every slot held by long calls: the plane's requests are refused (a slot freed between
    # two held calls may take one), the router's CPU per refusal is read, the node has none.
    floor, refused = rows[6:]
    assert floor["statuses"] == {"200": 300}
    assert refused["statuses"].get("429", 0) >= 290, refused["statuses"]
    assert set(refused["cpu_us"]) == {"router", "nats-server"}
    assert refused["p50_ms"] > 0  # the 429s' round trip
    # Read, not just present: 300 requests cost the router CPU between the two reads (a
    # clock tick is 10 ms; it spends some 200 us on each: 6 ticks). The floor's echo and a
    # node at the open load may spend less than a tick.
    for r in rows[1::2]:
        assert r["cpu_ticks"]["router"] > 0, r
    # ... and each request wakes the echo, or the router, at least now and then (a closed loop
    # of one caller leaves them idle between requests).
    assert rows[0]["wakes"]["echo"] > 0.1 and rows[1]["wakes"]["router"] > 0.1, rows[:2]
    assert data["capacity_per_s"] > 0 and 0 <= data["false_refusal_share"] <= 1
    assert {r["name"] for r in data["ratios"]} and all(
        len(r["by_load"]) == 4 for r in data["ratios"])


async def test_cpu_per_request_two_routers_smoke() -> None:
    """`--routers 2`: two `plane router` processes in one queue group serve every load, and
    the routers' CPU (both processes, summed) is read over each."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "cpu_per_request.py"),
        "--requests", "300", "--warmup", "50", "--idle", "0.5", "--settle", "0", "--slots", "2",
        "--routers", "2", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    data = json.loads(out)
    assert data["config"]["routers"] == 2
    plane = [r for r in data["rows"] if r["system"] == "plane"]
    assert len(plane) == 4 and all(r["cpu_ticks"]["router"] > 0 for r in plane)
    assert sum(r["statuses"].get("200", 0) for r in plane[:3]) > 0


async def test_interleaved_ab_smoke() -> None:
    """The interleaved before/after (benchmarks/interleaved_ab.py), this tree against
    itself, one short round: both runs measured, one table row each."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "interleaved_ab.py"), "--base", str(REPO),
        "--rounds", "1", "--seconds", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-2000:]
    rows = [line for line in out.decode().splitlines() if line.startswith(("| base", "| this"))]
    assert len(rows) == 2, out.decode()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[6]) > 0  # answered/s, 1 and 4 callers
        router_ns, node_ns = (float(x) for x in cells[5].split("/"))  # ÷ nats-server's CPU
        assert router_ns > 0 and node_ns > 0


async def test_router_split_smoke() -> None:
    """benchmarks/router_split.py: the probed router serves, the load runs, and each timed
    function of a placement's path is reported once per request."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "router_split.py"), "--load", "placements",
        "--slots", "2", "--callers", "2", "--duration", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    text = out.decode()
    assert "router CPU per request (/proc):" in text, text
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip()
            for line in text.splitlines() if line.startswith("| ") and "function" not in line}
    for probed in ("RequestPath.on_request", "Admission.decide", "SlotPublisher._on_ack",
                   "Router._done_event"):
        # (a broker's depth refusal, published again, is one more PubAck now and then)
        assert 0.95 <= float(rows.get(probed, "0")) <= 1.1, (probed, text)
    # Done-event messages: one a request, or fewer where a node's slots finished together
    # and sent theirs as one (gpu_node/done_batch.py).
    assert 0.3 <= float(rows.get("Router._done_read", "0")) <= 1.1, text


async def test_router_limit_smoke() -> None:
    """benchmarks/router_limit.py: a router slowed by its spin serves, the pulse runs, and
    the line reports every request's final answer and the router's decisions."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "router_limit.py"), "--spin-us", "200",
        "--slots", "2", "--work-us", "1000", "--rates", "50", "--seconds", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    line = next(x for x in out.decode().splitlines() if x.startswith("50/s: "))
    assert line.startswith("50/s: 50 answered 200 in "), line  # far below the router's limit
    assert "final statuses {'200': 50}" in line and 'decisions {"placed": 50}' in line, line


async def test_cpu_per_request_relay_smoke() -> None:
    """`--relay`: the depth-one relay (the plane's messages, none of its code) runs between
    the floor and the plane on every load, places and refuses as the plane does, its two
    processes' CPU is read, and its ratios against the floor come out beside the plane's."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "cpu_per_request.py"),
        "--requests", "300", "--warmup", "50", "--idle", "0.5", "--settle", "0", "--slots", "2",
        "--relay", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    data = json.loads(out)
    assert [r["system"] for r in data["rows"]] == ["floor", "relay", "plane"] * 4
    relay = [r for r in data["rows"] if r["system"] == "relay"]
    # Closed loops: every request answered, nearly all placed (a slot freed by its
    # done-event is taken again even while the broker still holds the ack: the relay sends
    # again, as the plane does). The relay reads its done-events and requests on two
    # subscriptions, each on its own task, so now and then a request is read before the
    # done-event that came ahead of it and is refused: a cost floor, not the plane's rules.
    for r in relay[:2]:
        assert set(r["statuses"]) <= {"200", "429"}, r["statuses"]
        assert r["statuses"].get("200", 0) >= 290, r["statuses"]
        assert set(r["cpu_us"]) == {"router", "node", "nats-server"}
        assert r["cpu_ticks"]["router"] > 0
    # Every slot held: every request refused 429, at once.
    assert relay[3]["statuses"] == {"429": 300}, relay[3]["statuses"]
    assert {r["name"] for r in data["relay_ratios"]} == {r["name"] for r in data["ratios"]}
    assert all(len(r["by_load"]) == 4 for r in data["relay_ratios"])
    assert data["false_refusal_share"] == [r for r in data["rows"] if r["system"] == "plane"][
        1]["refused_share"]


async def test_routers_by_model_smoke() -> None:
    """benchmarks/routers_by_model.py: each plan (one router, two of every model, two split
    by model) starts, answers both models, and its routers' CPU is read."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "routers_by_model.py"), "--seconds", "1",
        "--callers", "1", "--slots", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-3000:]
    rows = [line.split("|") for line in out.decode().splitlines()
            if line.startswith(("| one", "| two"))]
    assert [r[1].strip() for r in rows] == [
        "one router", "two routers, every model", "two routers, split by model"], out.decode()
    for r in rows:
        assert int(r[2].strip().replace(",", "")) > 0  # answers a second
        assert "'200'" in r[3]
        each = [float(x) for x in r[4].split("+")]
        assert len(each) == (1 if r[1].strip() == "one router" else 2) and all(each), r


async def test_sdk_call_smoke() -> None:
    """benchmarks/sdk_call.py: both paths call the refusing responder at each concurrency,
    and the caller's CPU per call is read for each row."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "sdk_call.py"), "--calls", "200",
        "--concurrency", "1,20", "--rounds", "1", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    rows = json.loads(out)
    assert sorted((r["path"], r["concurrency"]) for r in rows) == [
        ("Client.call", 1), ("Client.call", 20), ("nats-py request", 1),
        ("nats-py request", 20)]
    for r in rows:
        # 200 calls cost the caller CPU (tens of µs each, at least a clock tick in all).
        assert r["cpu_us_per_call"] > 0 and r["calls_per_s"] > 0, r
