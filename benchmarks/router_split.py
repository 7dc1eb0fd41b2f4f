"""Where the router's time per request goes, function by function, under a closed loop.

`cpu_per_request.py` says how much CPU the router spends per decision; a cProfile spreads it
flat and doubles it (every small call pays the profiler). This wraps a chosen set of the
router's own functions with a wall-clock timer (the loop is one thread: a function's time is
its own and its callees', awaits included) and reports µs per request for each, beside the
router's whole CPU per request from `/proc`. What the wrapped functions do not cover is
nats-py (parsing, the subscription's queue and task, the socket) and the loop.

    .venv/bin/python benchmarks/router_split.py --load refusals      # every request refused
    .venv/bin/python benchmarks/router_split.py --load placements    # every request placed

`refusals`: one slot held by back-to-back 10 s calls, `--callers` closed-loop callers all
refused 429 (one message in and one out per request). `placements`: `--slots` slots of
`calibrated` with `duration_us: 0` and `--callers` closed-loop callers (the request, its
PubAck and its done-event in; the slot publish out). The timers cost ~0.3 µs a call, so the
figures run a few per cent above an unwrapped router's; they cover the router's whole life
(its warm-up's ~500 requests too), the CPU figure only the measured seconds. Run it a few
times: this host's speed moves by tens of per cent within minutes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parent.parent
SPLIT_OUT = "PLANE_ROUTER_SPLIT_OUT"  # where the probed router writes its table at exit

# What is timed: (module, class or None, function). Nested ones count inside their caller too.
PROBED = [
    ("plane.router.requests", "RequestPath", "on_request"),
    ("plane.router.requests", "RequestPath", "_route_one"),
    ("plane.router.requests", None, "read_caller"),
    ("plane.router.admission", "Admission", "decide"),
    ("plane.router.requests", "RequestPath", "_conclude"),
    ("plane.router.requests", "RequestPath", "_answer"),
    ("plane.router.requests", "RequestPath", "_try_candidate"),
    ("plane.router.requests", "RequestPath", "_placed"),
    ("plane.router.requests", "RequestPath", "_decided"),
    ("plane.router.slot_publish", "SlotPublisher", "_on_ack"),
    ("plane.router.service", "Router", "_on_done"),
    ("plane.router.service", "Router", "_placed_done"),
]


def _timed(f: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(f):
        async def timed_async(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return await f(*args, **kw)
            finally:
                acc[0] += time.perf_counter() - t
                acc[1] += 1
        return timed_async

    def timed(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kw)
        finally:
            acc[0] += time.perf_counter() - t
            acc[1] += 1
    return timed


def serve_probed_router(argv: list[str]) -> int:
    """`plane router ARGV` with the PROBED functions timed; the table goes to $SPLIT_OUT."""
    import importlib

    from plane.app import main

    accs: dict[str, list[float]] = {}
    for module, owner_name, name in PROBED:
        mod = importlib.import_module(module)
        owner = getattr(mod, owner_name) if owner_name else mod
        label = f"{owner_name}.{name}" if owner_name else name
        accs[label] = acc = [0.0, 0]
        setattr(owner, name, _timed(getattr(owner, name), acc))
    try:
        return int(main(args=["router", *argv], prog_name="plane") or 0)
    except SystemExit as end:  # click's way out of a command, when it ends
        return int(end.code or 0)
    finally:
        Path(os.environ[SPLIT_OUT]).write_text(json.dumps(accs))


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def _run(load: str, slots: int, callers: int, seconds: float) -> None:
    from benchmarks.core_caller import CoreRequest, Size, closed_loop
    from plane.contract.embedded import EmbeddedNats
    from plane.contract.subjects import Header, Names

    subject = Names().infer("calibrated")
    out = Path(tempfile.mkdtemp(prefix="router-split-")) / "split.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{SPLIT_OUT: str(out)})
    async with EmbeddedNats() as srv:
        common = ["--nats", srv.url, "--log-level", "warning"]
        router = subprocess.Popen(
            [sys.executable, __file__, "--serve-router", "--", *common, "--router-id", "split"],
            env=env, cwd=ROOT)
        node = subprocess.Popen(
            [str(Path(sys.executable).parent / "plane"), "node", *common, "--model", "calibrated",
             "--slots", str(1 if load == "refusals" else slots), "--backend", "torch",
             "--node-id", "split"], env=env, cwd=ROOT)
        target = CoreRequest(srv.url, subject, {Header.DEADLINE_MS: "1000"})
        holder = CoreRequest(srv.url, subject, {Header.DEADLINE_MS: "30000"})
        holding = None
        try:
            async with target, holder:
                for _ in range(300):  # until the plane answers
                    if (await target.send(b'{"duration_us": 0}')).final == "200":
                        break
                    await asyncio.sleep(0.2)
                if load == "refusals":
                    async def hold() -> None:
                        while True:
                            await holder.send(b'{"duration_us": 10000000}')
                    holding = asyncio.ensure_future(hold())
                    await asyncio.sleep(0.5)
                body = b'{"duration_us": 0}'
                await closed_loop(target, body, callers, Size(requests=500, seconds=0))
                t0, w0 = _cpu_ticks(router.pid), time.monotonic()
                done = await closed_loop(target, body, callers, Size(requests=None,
                                                                     seconds=seconds))
                cpu_us = (_cpu_ticks(router.pid) - t0) * 1e6 / os.sysconf("SC_CLK_TCK")
                took = time.monotonic() - w0
        finally:
            if holding is not None:
                holding.cancel()
            for p in (router, node):
                p.send_signal(signal.SIGTERM)
            for p in (router, node):
                p.wait(30)
    n = len(done)
    finals = Counter(o.attempts.final for o in done)
    table = json.loads(out.read_text())
    asked = table["RequestPath.on_request"][1] or 1
    print(f"{load}: {n} requests in {took:.1f} s ({n / took:.0f}/s), answers {dict(finals)}")
    print(f"router CPU per request (/proc): {cpu_us / n:.1f} µs")
    print("| function | µs per request | calls per request |")
    print("| --- | --- | --- |")
    for label, (total_s, calls) in table.items():
        if calls >= asked / 100:  # (what the warm-up alone called: not this load's)
            print(f"| {label} | {total_s * 1e6 / asked:.1f} | {calls / asked:.2f} |")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--load", type=click.Choice(["refusals", "placements"]), default="placements",
              show_default=True)
@click.option("--slots", default=4, show_default=True, help="placements: slots of the node")
@click.option("--callers", default=4, show_default=True)
@click.option("--duration", default=8.0, show_default=True, help="seconds measured")
@click.option("--serve-router", is_flag=True, hidden=True)
@click.argument("router_args", nargs=-1, type=click.UNPROCESSED)
def cli(load: str, slots: int, callers: int, duration: float, serve_router: bool,
        router_args: tuple[str, ...]) -> None:
    """Where the router's time per request goes, function by function."""
    if serve_router:
        sys.exit(serve_probed_router(list(router_args)))
    asyncio.run(_run(load, slots, callers, duration))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cli()
