"""Two models, one router or two: router CPU per request and answers per second, with the two
routers serving every model or split by model (`plane router --models`).

    .venv/bin/python benchmarks/routers_by_model.py [--seconds 8] [--rounds 1]
                                                    [--callers 2] [--slots 2] [--slow-us 0]

Processes: an embedded nats-server; `plane node` of `calibrated` (0 µs) and of `risk`, each
with --slots slots on the torch backend; the routers; the callers in this process, --callers
closed-loop callers per model (plain core-NATS requests, no retries). Three plans, each in
turn per round: one router of every model; two routers of every model (one queue group: each
reads every done-event and the other's notes); two routers split by model (`--models
calibrated`, `--models risk`: each reads its own model's traffic only). Router CPU is
utime + stime from /proc over the measured seconds, per request of the whole plane.

`--slow-us N` makes each router's decision block its loop for N µs (a sleep in the request
callback, not a spin: a router whose decisions take that long, without taking this 2-core
host's CPU from the node, the broker and the callers), so that the router, not the host, is
the plane's limit, as on a GPU host (BENCHMARKS.md, "The plane on the GPU"): what a second
router adds then shows in the answers per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click
import nats
from nats.aio.client import Client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.children import child  # noqa: E402
from benchmarks.cpu_per_request import CLK_TCK, cpu_ticks  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.subjects import Header, Names  # noqa: E402

BODIES = {"calibrated": b'{"duration_us": 0}', "risk": b'{"features": [' + b", ".join(
    [b"0.1"] * 32) + b"]}"}
PLANS: dict[str, list[list[str] | None]] = {  # plan -> each router's models (None: every one)
    "one router": [None],
    "two routers, every model": [None, None],
    "two routers, split by model": [["calibrated"], ["risk"]],
}
# `plane` through this interpreter: the same where the project is only on PYTHONPATH (a bare
# GPU box, as scripts/gpu_plane.sh runs it).
PLANE = [sys.executable, "-m", "plane"]
SLOW_US = "PLANE_BENCH_SLOW_US"  # the slowed router child reads its decision's wall time here


def serve_slowed_router(argv: list[str]) -> int:
    """`plane router ARGV`, each decision first blocking the loop for $PLANE_BENCH_SLOW_US."""
    from plane.app import main
    from plane.router.requests import RequestPath

    slow_s = int(os.environ[SLOW_US]) / 1e6
    real = RequestPath._route_one

    async def slowed(self: RequestPath, msg: object) -> None:
        time.sleep(slow_s)  # noqa: ASYNC251  # the point: a loop held as by a slower CPU
        await real(self, msg)  # type: ignore[arg-type]

    RequestPath._route_one = slowed  # type: ignore[method-assign]
    try:
        return int(main(args=["router", *argv], prog_name="plane") or 0)
    except SystemExit as end:
        return int(end.code or 0)


async def _status(nc: Client, subject: str, body: bytes) -> str:
    try:
        msg = await nc.request(subject, body, timeout=2)
    except Exception:
        return "none"
    return (msg.headers or {}).get(Header.STATUS, "200")


async def run_plan(plan: str, seconds: float, callers: int, slots: int, slow_us: int,
                   backend: str) -> str:
    names = Names()
    logs = Path(tempfile.mkdtemp(prefix="routers-by-model-"))
    router_cmd = ([sys.executable, __file__, "--serve-router", "--"] if slow_us
                  else [*PLANE, "router"])
    async with EmbeddedNats() as srv, contextlib.AsyncExitStack() as st:
        common = ["--nats", srv.url, "--log-level", "warning"]
        pids = []
        for i, models in enumerate(PLANS[plan]):
            served = ["--models", ",".join(models)] if models else []
            proc = await st.enter_async_context(child(
                [*router_cmd, *common, "--router-id", f"r{i}", *served], logs / f"r{i}.log"))
            assert proc.pid is not None
            pids.append(proc.pid)
        for model in BODIES:
            await st.enter_async_context(child(
                [*PLANE, "node", *common, "--model", model, "--slots", str(slots),
                 "--backend", backend, "--node-id", f"n-{model}", "--no-freshness"],
                logs / f"{model}.log"))
        conns = [await nats.connect(srv.url) for _ in range(callers * len(BODIES))]
        st.push_async_callback(lambda: asyncio.gather(*(nc.close() for nc in conns)))
        jobs = [(names.infer(m), body) for m, body in BODIES.items() for _ in range(callers)]
        for subject, body in {j[0]: j for j in jobs}.values():
            give_up = time.monotonic() + 90
            while await _status(conns[0], subject, body) != "200":
                if time.monotonic() > give_up:
                    raise RuntimeError(f"{subject} never answered 200: see {logs}")
                await asyncio.sleep(0.3)
        finals: Counter[str] = Counter()

        async def closed_loop(nc: Client, subject: str, body: bytes, until_s: float) -> None:
            while time.monotonic() < until_s:
                finals[await _status(nc, subject, body)] += 1

        async def load(s: float) -> None:
            until_s = time.monotonic() + s
            await asyncio.gather(*(closed_loop(nc, subject, body, until_s)
                                   for nc, (subject, body) in zip(conns, jobs, strict=True)))

        await load(2.0)  # warm-up
        finals.clear()
        before = [cpu_ticks(pid) for pid in pids]
        t0 = time.monotonic()
        await load(seconds)
        took = time.monotonic() - t0
        cpu_us = [(cpu_ticks(pid) - b) * 1e6 / CLK_TCK for pid, b in zip(pids, before,
                                                                           strict=True)]
    n = sum(finals.values())
    each = " + ".join(f"{us / n:.0f}" for us in cpu_us)
    return (f"| {plan} | {n / took:,.0f} | {dict(finals)} | {each} | "
            f"**{sum(cpu_us) / n:.0f}** |")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--seconds", default=8.0, show_default=True, help="Measured seconds per plan.")
@click.option("--rounds", default=1, show_default=True, help="Each plan this many times.")
@click.option("--callers", default=2, show_default=True, help="Closed-loop callers per model.")
@click.option("--slots", default=2, show_default=True, help="Slots per model's node.")
@click.option("--slow-us", default=0, show_default=True,
              help="Each decision blocks its router's loop this long (0: not slowed).")
@click.option("--backend", default="torch", show_default=True,
              help="The nodes' backend (a GPU host: triton; two nodes share its device).")
@click.option("--serve-router", is_flag=True, hidden=True)
@click.argument("router_args", nargs=-1, type=click.UNPROCESSED)
def cli(seconds: float, rounds: int, callers: int, slots: int, slow_us: int, backend: str,
        serve_router: bool, router_args: tuple[str, ...]) -> None:
    """Router CPU per request and answers/s: one router, two of every model, two by model."""
    if serve_router:
        sys.exit(serve_slowed_router(list(router_args)))
    os.environ[SLOW_US] = str(slow_us)  # (the slowed router children read it)
    click.echo(f"{os.cpu_count()} cores; calibrated 0 us and risk, {slots} {backend} slots each; "
               f"{callers} closed-loop callers per model; {seconds:g} s per plan"
               + (f"; each decision slowed by {slow_us} us" if slow_us else ""))
    click.echo("| plan | answers/s | final statuses | router CPU per plane request, us "
               "(each) | all routers |")
    click.echo("| --- | --- | --- | --- | --- |")
    for _ in range(rounds):
        for plan in PLANS:
            click.echo(asyncio.run(run_plan(plan, seconds, callers, slots, slow_us, backend)))


if __name__ == "__main__":
    cli()
