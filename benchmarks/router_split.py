"""Where the router's time per request goes, function by function, under a closed loop.

`cpu_per_request.py` says how much CPU the router spends per decision; a cProfile spreads it
flat and doubles it (every small call pays the profiler). This wraps a chosen set of the
router's own functions with a wall-clock timer (the loop is one thread: a function's time is
its own and its callees', awaits included) and reports µs per request for each, beside the
router's whole CPU per request from `/proc`. What the wrapped functions do not cover is
nats-py (parsing, the subscription's queue and task, the socket) and the loop.

    .venv/bin/python benchmarks/router_split.py --load refusals      # every request refused
    .venv/bin/python benchmarks/router_split.py --load placements    # every request placed

The plane is `benchmarks/cpu_per_request.py`'s (`plane_system`, with this router in place of
`plane router`), and so is the holding of its slots. `refusals`: one slot held by back-to-
back 10 s calls, `--callers` closed-loop callers all refused 429 (one message in and one out
per request). `placements`: `--slots` slots of `calibrated` with `duration_us: 0` and
`--callers` closed-loop callers (the request, its PubAck and its done-event in; the slot
publish out). The timers cost ~0.3 µs a call, so the figures run a few per cent above an
unwrapped router's; they cover the router's whole life (its warm-up's ~500 requests too),
the CPU figure only the measured seconds. Run it a few times: this host's speed moves by
tens of per cent within minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
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
    ("plane.router.service", "Router", "_done_read"),  # a message: one event, or a batch
    ("plane.router.service", "Router", "_done_event"),
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


async def _run(load: str, slots: int, callers: int, seconds: float) -> None:
    from benchmarks.core_caller import Size, closed_loop
    from benchmarks.cpu_per_request import cpu_ticks, plane_system, slots_held

    logs = Path(tempfile.mkdtemp(prefix="router-split-"))
    out = logs / "split.json"
    os.environ[SPLIT_OUT] = str(out)  # the probed router (our child) writes its table there
    body = b'{"duration_us": 0}'
    refusals = load == "refusals"
    async with plane_system(logs, body, slots=1 if refusals else slots, deadline_ms=1000,
                            router_cmd=(sys.executable, __file__, "--serve-router", "--")
                            ) as plane, contextlib.AsyncExitStack() as held:
        if refusals:
            await held.enter_async_context(slots_held(plane, 1))
        async with plane.target() as target:
            await closed_loop(target, body, callers, Size(requests=500, seconds=0))
            router = plane.pids["router"][0]
            t0, w0 = cpu_ticks(router), time.monotonic()
            done = await closed_loop(target, body, callers, Size(requests=None,
                                                                 seconds=seconds))
            cpu_us = (cpu_ticks(router) - t0) * 1e6 / os.sysconf("SC_CLK_TCK")
            took = time.monotonic() - w0
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
