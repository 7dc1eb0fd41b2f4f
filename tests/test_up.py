"""`plane up` as a user runs it: prints the URL and an example call, serves, and on SIGTERM
stops everything it started (no orphan nats-server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import click
import nats
from click.testing import CliRunner

from plane.app import main
from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header, Names
from tests.up_process import (
    PLANE,
    children,
    left_none,
    plane_up,
    router_process,
    router_processes,
    until_up,
    url_of,
)


async def test_plane_up_serves_and_stops_cleanly_on_sigterm() -> None:
    # Its logs and its banner on one pipe, unbuffered (as a container image often runs it):
    # the banner comes after the start-up's logs, each of its lines whole.
    with plane_up("--log-level", "info", "--metrics-port", "0",
                  env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        await _serves_and_stops(proc)


async def _serves_and_stops(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    url = None
    lines = []
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        lines.append(line)
        if m := re.fullmatch(r"plane is up: NATS (nats://127\.0\.0\.1:\d+)\n", line):
            url = m.group(1)
        if "Ctrl-C" in line:
            break
    assert url, "".join(lines)
    banner = lines[next(i for i, line in enumerate(lines) if line.startswith("plane is up")):]
    assert [line.split(":")[0].strip() for line in banner if not line.startswith(" ")] == [
        "plane is up", "metrics", "call it from any NATS client, for example",
        "Ctrl-C stops everything."], "".join(lines)
    assert any("req plane.infer.risk" in line for line in banner)
    assert any('"router started"' in line for line in lines[:-len(banner)]), "".join(lines)
    kids = children(proc.pid)
    assert kids, "plane up should run nats-server as its child"
    assert router_process(proc.pid) in kids, "plane up's router runs in its own process"
    nc = await nats.connect(url)
    msg = await nc.request(Names().infer("risk"), json.dumps(
        {"features": [0.5] * 32}).encode(), timeout=5)
    assert (msg.headers or {})[Header.STATUS] == "200"
    await nc.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    left_none(kids)


def test_plane_up_says_where_its_metrics_are_as_bound() -> None:
    # The banner said http://127.0.0.1:PORT/metrics whatever --metrics-host bound (found
    # from outside): here a loopback address other than 127.0.0.1.
    with plane_up("--models", "calibrated", "--log-level", "warning", "--metrics-port", "0",
                  "--metrics-host", "127.0.0.2") as proc:
        lines = until_up(proc)
        [url] = [m.group(1) for line in lines
                 if (m := re.fullmatch(r"metrics: +(\S+)\n", line))]
        assert re.fullmatch(r"http://127\.0\.0\.2:\d+/metrics", url), "".join(lines)
        with urllib.request.urlopen(url, timeout=10) as r:
            assert b"plane_" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_plane_up_stops_whole_when_its_router_process_dies() -> None:
    # A plane with no router answers nothing: `plane up` stops everything it started and
    # exits 1, so that whatever runs it (systemd, a container) starts it again whole.
    with plane_up("--models", "calibrated", "--log-level", "warning") as proc:
        lines = until_up(proc)
        router = router_process(proc.pid)
        assert router is not None, "".join(lines)
        kids = children(proc.pid)
        os.kill(router, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert "the router's process exited" in rest, rest
        left_none(kids)


def test_a_router_process_signalled_alone_says_so_at_warning() -> None:
    # It drains and exits 0 (a supervisor's SIGTERM), and the whole plane stops with it: at
    # info, a `--log-level warning` plane stopped without a word why (found from outside).
    with plane_up("--models", "calibrated", "--log-level", "warning") as proc:
        lines = until_up(proc)
        router = router_process(proc.pid)
        assert router is not None, "".join(lines)
        os.kill(router, signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert "the router's process exited on its own: the plane stops" in rest, rest


def test_plane_up_stops_whole_when_its_nats_server_dies() -> None:
    # Its embedded server's JetStream state (the slot stream, placements in flight, live
    # settings) dies with it: `plane up` neither restarts it in place nor serves on without
    # it (it went on serving /metrics with stale values, its slots "healthy"), but stops
    # everything and exits 1 saying so, for a supervisor to start it again whole.
    with plane_up("--models", "calibrated", "--log-level", "warning") as proc:
        lines = until_up(proc)
        kids = children(proc.pid)
        [server] = [c for c in kids
                    if b"nats-server" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(server, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1, "".join(lines)
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert ("stopping: the embedded nats-server exited on its own (killed by SIGKILL)"
                in rest), rest
        assert "Traceback" not in rest, rest
        left_none(kids)


def test_plane_ups_metrics_say_when_its_router_did_not_answer_the_scrape() -> None:
    # A stalled router process (SIGSTOP here) left `plane up`'s /metrics without its series
    # (refusals, promises, decisions), HELP and TYPE lines kept: to Prometheus a quiet
    # plane, its refusal alerts blank exactly then (found from outside).
    with plane_up("--models", "calibrated", "--log-level", "error", "--metrics-port",
                  "0") as proc:
        lines = until_up(proc)
        [url] = [m.group(1) for line in lines
                 if (m := re.fullmatch(r"metrics: +(\S+)\n", line))]
        [router] = router_processes(proc.pid)

        def up_sample() -> list[str]:
            with urllib.request.urlopen(url, timeout=30) as r:
                return [line for line in r.read().decode().splitlines()
                        if line.startswith("plane_child_scrape_up")]

        assert up_sample() == ['plane_child_scrape_up{child="router"} 1.0']
        os.kill(router, signal.SIGSTOP)
        try:
            assert up_sample() == ['plane_child_scrape_up{child="router"} 0.0']
        finally:
            os.kill(router, signal.SIGCONT)
        assert up_sample() == ['plane_child_scrape_up{child="router"} 1.0']
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


async def test_plane_up_stops_cleanly_on_sigint_with_its_nats_server_gone() -> None:
    # A server of its own (`--nats`) that died: the nodes wait for it to come back (nats-py
    # reconnects), and a Ctrl-C meanwhile stops `plane up` as cleanly as any other: exit 0,
    # no traceback (nats-py's close raised into the stop: exit 1).
    async with EmbeddedNats() as server:
        with plane_up("--nats", server.url, "--models", "calibrated",
                       "--log-level", "warning") as proc:
            lines = until_up(proc)
            await server.stop(kill=True)
            await asyncio.sleep(3.0)  # the node's slots out of reach, its pulls waiting
            proc.send_signal(signal.SIGINT)
            rc = await asyncio.to_thread(proc.wait, 30)
            assert proc.stdout is not None
            rest = proc.stdout.read()
            assert rc == 0, "".join(lines) + rest
            assert "Traceback" not in rest and "pull silent" not in rest, rest


async def test_plane_up_runs_a_router_process_per_model_when_asked() -> None:
    # `--router-per-model`: a router process for each model, each serving that model only
    # (its micro endpoint's subject and count say which requests it took).
    with plane_up("--models", "calibrated,risk", "--router-per-model",
                   "--log-level", "warning") as proc:
        lines = until_up(proc)
        url = url_of(lines)
        routers = router_processes(proc.pid)
        assert len(routers) == 2, "".join(lines)
        kids = children(proc.pid)
        nc = await nats.connect(url)
        try:
            for model, body, n in (("calibrated", {"duration_us": 0}, 5),
                                   ("risk", {"features": [0.5] * 32}, 3)):
                for _ in range(n):
                    msg = await nc.request(Names().infer(model), json.dumps(body).encode(),
                                           timeout=5)
                    assert (msg.headers or {})[Header.STATUS] == "200"
            served = await _infer_requests_by_router(nc)
        finally:
            await nc.close()
        assert sorted(served.values()) == [
            (Names().infer("calibrated"), 5), (Names().infer("risk"), 3)], served
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        left_none(kids)


async def _infer_requests_by_router(nc: nats.NATS) -> dict[str, tuple[str, int]]:
    """Each router's infer endpoint: its subject and count of requests (`$SRV.STATS`, every
    router's answer)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"$SRV.STATS.{Names().router_service}", b"", reply=inbox)
    served: dict[str, tuple[str, int]] = {}
    with contextlib.suppress(TimeoutError):
        while True:
            stats = json.loads((await sub.next_msg(timeout=1.0)).data)
            [infer] = [e for e in stats["endpoints"] if e["name"].startswith("infer")]
            served[stats["id"]] = (infer["subject"], infer["num_requests"])
    await sub.unsubscribe()
    return served


def test_plane_up_refuses_a_router_per_model_on_one_process() -> None:
    out = subprocess.run([PLANE, "up", "--one-process", "--router-per-model"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--router-per-model runs each model's router" in out.stderr


def test_plane_up_demo_prints_answers_and_refusals() -> None:
    out = subprocess.run([PLANE, "up", "--demo", "--log-level", "warning"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"risk: 200 \{\"score\":0\.\d+", out.stdout)
    assert "calibrated: 200" in out.stdout
    assert re.search(r"refused with Plane-Ticket \S+, Retry-After-Ms \d+", out.stdout)
    # (Refused again with a new ticket when its slot ran late, it says so: CI's host once.)
    assert re.search(r"with the ticket: (refused again \d+ time\(s\) with a new ticket "
                     r"\(its slot ran late\), then )?200 on node0-calibrated", out.stdout)
    assert "demo: OK" in out.stdout


def test_help_shows_examples_and_bad_options_fail_clearly() -> None:
    out = subprocess.run([PLANE, "node", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Example" in out.stdout and "--slots" in out.stdout
    bad = subprocess.run([PLANE, "node", "--slots", "0", "--nats", "nats://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--slots must be between 1 and 1024" in bad.stderr


def test_help_says_plane_up_serves_metrics_only_with_a_metrics_port() -> None:
    """`plane --help` said `plane up  # ... metrics` and `plane up --help` "one /metrics for
    all", while `plane up` serves no /metrics unless --metrics-port is given."""
    top = CliRunner().invoke(main, ["--help"]).output
    for line in (line for line in top.splitlines() if "plane up" in line and "metrics" in line):
        assert "--metrics-port" in line, line
    up = main.commands["up"]
    assert "with --metrics-port, one /metrics for all (none without it)" in " ".join(
        (up.help or "").split())
    [port] = [p for p in up.params if p.name == "metrics_port"]
    assert isinstance(port, click.Option) and "default: no metrics served" in (port.help or "")


def test_plane_up_router_process_runs_the_plane_it_was_started_with(tmp_path: Path) -> None:
    # A `plane/` folder in the working directory (a checkout of another version, a
    # benchmark's worktree) is not what the router's process imports: `python -m` would put
    # the working directory first on its path. Here that folder cannot even be imported.
    decoy = tmp_path / "plane"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("the decoy plane was imported")\n')
    with plane_up("--models", "calibrated", "--log-level", "warning", cwd=tmp_path) as proc:
        lines = until_up(proc)
        assert router_process(proc.pid) is not None, "".join(lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is not None and "decoy" not in proc.stdout.read()
