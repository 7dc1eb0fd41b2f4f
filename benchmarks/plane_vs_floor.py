"""Closed-loop latency of a zero-duration `calibrated` request through the plane, against bare
core-NATS request-reply with nats-py on the same server (the floor), in one run.

    .venv/bin/python benchmarks/plane_vs_floor.py [--requests 5000] [--warmup 500]

The plane runs as `plane up --nats URL --models calibrated` (router and node in one process,
the embedded default's topology); the floor responder is its own process; so is the depth-one
relay (`depth_one_relay.py`: the plane's messages through a JetStream slot with none of its
code, relay and worker in one process as `plane up` has router and node), so that the plane's
distance to the floor splits into its message flow's share and its own code's. The caller is
this process, one request outstanding at a time, the three paths interleaved in rounds.
Prints a Markdown table (p50, p99, ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import nats
from hdrh.histogram import HdrHistogram
from nats.aio.client import Client

from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header, Names

ROOT = Path(__file__).resolve().parent.parent
# `plane` through this interpreter: the same where the project is only on PYTHONPATH (a bare
# GPU box: scripts/gpu_plane.sh).
PLANE = [sys.executable, "-m", "plane"]


async def closed_loop(nc: Client, subject: str, body: bytes, n: int, warmup: int,
                      check: bool) -> HdrHistogram:
    hist = HdrHistogram(1, 60_000_000, 3)  # µs
    for i in range(n + warmup):
        t0 = time.perf_counter_ns()
        msg = await nc.request(subject, body, timeout=5)
        dt_us = (time.perf_counter_ns() - t0) // 1000
        if check and (msg.headers or {}).get(Header.STATUS) != "200":
            raise RuntimeError(f"plane answered {msg.headers}: {msg.data!r}")
        if i >= warmup:
            hist.record_value(max(1, dt_us))
    return hist


async def wait_ready(proc: subprocess.Popen[str], marker: str, timeout_s: float = 60) -> None:
    assert proc.stdout is not None
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        line = await asyncio.to_thread(proc.stdout.readline)
        if marker in line:
            return
        if not line and proc.poll() is not None:
            raise RuntimeError(f"process exited: {proc.args!r}")
    raise TimeoutError(f"{proc.args!r} not ready")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--backend", default="auto",
                    help="the node's backend (auto: triton on a GPU, torch on a CPU)")
    args = ap.parse_args()
    names = Names()
    procs: list[subprocess.Popen[str]] = []
    async with EmbeddedNats() as srv:
        try:
            floor = subprocess.Popen(
                [sys.executable, str(ROOT / "benchmarks" / "floor_responder.py"), srv.url,
                 "bench.echo"], stdout=subprocess.PIPE, text=True)
            procs.append(floor)
            await wait_ready(floor, "ready")
            relay = subprocess.Popen(
                [sys.executable, str(ROOT / "benchmarks" / "depth_one_relay.py"), srv.url,
                 "bench.relay"], stdout=subprocess.PIPE, text=True)
            procs.append(relay)
            await wait_ready(relay, "ready")
            # In this tree: `python -m` puts the working directory first on sys.path, ahead
            # of PYTHONPATH, so run from elsewhere it ran that directory's plane (an A/B of
            # `PYTHONPATH=<tree> <tree>/benchmarks/plane_vs_floor.py` from a checkout timed
            # the checkout twice).
            up = subprocess.Popen(
                [*PLANE, "up", "--nats", srv.url, "--models", "calibrated",
                 "--slots", str(args.slots), "--backend", args.backend, "--log-level", "warning"],
                stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(up)
            await wait_ready(up, "Ctrl-C")
            nc = await nats.connect(srv.url)
            body = json.dumps({"duration_us": 0}).encode()
            results = {}
            # Interleave in rounds so both see the same machine conditions.
            rounds = 5
            per = args.requests // rounds
            hf = HdrHistogram(1, 60_000_000, 3)
            hp = HdrHistogram(1, 60_000_000, 3)
            hr = HdrHistogram(1, 60_000_000, 3)
            for r in range(rounds):
                hf.add(await closed_loop(nc, "bench.echo", body, per,
                                         args.warmup if r == 0 else 50, False))
                hr.add(await closed_loop(nc, "bench.relay", body, per,
                                         args.warmup if r == 0 else 50, False))
                hp.add(await closed_loop(nc, names.infer("calibrated"), body, per,
                                         args.warmup if r == 0 else 50, True))
            results["bare NATS request-reply (floor)"] = hf
            results["depth-one relay: the plane's messages, no decisions"] = hr
            results["plane, calibrated 0 us"] = hp
            await nc.close()
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=30)
    f50 = hf.get_value_at_percentile(50) / 1000
    f99 = hf.get_value_at_percentile(99) / 1000
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{__import__('os').cpu_count()} cores, Python {platform.python_version()}")
    print(f"requests per path: {per * rounds} (closed loop, 1 outstanding), "
          f"plane slots: {args.slots}, backend: {args.backend}\n")
    print("| path | p50 ms | p99 ms | p50 / floor | p99 / floor |")
    print("| --- | --- | --- | --- | --- |")
    for name, h in results.items():
        p50 = h.get_value_at_percentile(50) / 1000
        p99 = h.get_value_at_percentile(99) / 1000
        print(f"| {name} | {p50:.3f} | {p99:.3f} | {p50 / f50:.2f}x | {p99 / f99:.2f}x |")


if __name__ == "__main__":
    asyncio.run(main())
