"""Fair shares between tenants (NATS accounts) at overload, and what accounts cost.

    .venv/bin/python benchmarks/tenant_shares.py [--duration 60] [--slots 2] [--work-us 20000]

One run, on an embedded nats-server with accounts (the plane's `PLANE`, tenants `HEAVY`,
`LIGHT`, `T1`, `T2`, `T3`, each importing `plane.infer.>` with `share: true`), and
`plane up --nats URL --user ...` as its own process (router and node):

1. capacity: closed loop from one tenant, one caller per slot;
2. heavy and light, equal weights: HEAVY offers 3x the capacity, LIGHT 0.3x, both open
   loop with the SDK's retries (Retry-After, tickets), for --duration s. Targets: LIGHT
   admitted on its first try or its ticket's retry >= 99%, its accepted p99/p50 <= 1.8;
   total goodput >= 95% of the capacity;
3. weights 1:2:3 (`share.T1=1`, `share.T2=2`, `share.T3=3` in PLANE_CONFIG), each tenant
   offering 2x the capacity for --duration s: each tenant's share of the slot time (the
   router's meter) within +-5% of 1/6, 2/6, 3/6.
4. what accounts cost: the closed-loop p50 of one caller with zero work, through a tenant's
   import against a caller inside the plane's account (the same server, one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import nats

from plane.client import Client
from plane.contract.backoff import RetryPolicy
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.lifecycle import run
from plane.contract.quantiles import quantile
from plane.contract.subjects import Names
from plane.pulse.outcome import Outcome
from plane.pulse.runner import LoadConfig, run_load
from plane.pulse.targets import NatsTarget

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.overload_2x import capacity  # noqa: E402

DEADLINE_MS = 1000
TENANTS = ("HEAVY", "LIGHT", "T1", "T2", "T3")


def accounts_conf() -> str:
    tenants = "\n".join(
        f'  {t} {{ users: [{{user: {t.lower()}, password: {t.lower()}-pw}}]\n'
        f'    imports: [{{service: {{account: PLANE, subject: "plane.infer.>"}}, '
        f'share: true}}] }}' for t in TENANTS)
    return ("accounts {\n  PLANE { jetstream: enabled\n"
            "    users: [{user: plane, password: plane-pw}]\n"
            '    exports: [{service: "plane.infer.>"}] }\n' + tenants + "\n}\n")


def opts(url: str, user: str) -> ConnectOptions:
    return ConnectOptions(url=url, user=user, password=f"{user}-pw", name=f"bench-{user}")


async def load(o: ConnectOptions, body: bytes, rate: float, seconds: float) -> list[Outcome]:
    target = NatsTarget(o, model="calibrated", deadline_ms=DEADLINE_MS, policy=RetryPolicy())
    async with target:
        result = await run_load(target, body, LoadConfig(rate=rate, duration_s=seconds,
                                                         concurrency=4096))
    return result.outcomes


def first_or_ticketed(o: Outcome) -> bool:
    s = o.attempts.statuses
    return s[:1] == (200,) or s[:2] == (429, 200)


def ms(values: list[int], p: float) -> float:
    return quantile(values, p) / 1000 if values else float("nan")


async def meter(o: ConnectOptions) -> dict[str, int]:
    """Slot µs per tenant, summed over the routers."""
    assert o.url is not None  # opts() always names the server
    nc = await nats.connect(o.url, user=o.user, password=o.password)
    try:
        info = await nc.request("$SRV.INFO.plane-router", b"", timeout=2)
        router = json.loads(info.data)["metadata"]["router_id"]
        reply = await nc.request(Names().router_meter(router), b"", timeout=2)
    finally:
        await nc.close()
    out: dict[str, int] = {}
    for row in json.loads(reply.data)["meter"]:
        out[row["tenant"]] = out.get(row["tenant"], 0) + row["slot_us"]
    return out


async def set_shares(o: ConnectOptions, shares: dict[str, int]) -> None:
    assert o.url is not None  # opts() always names the server
    nc = await nats.connect(o.url, user=o.user, password=o.password)
    try:
        kv = await nc.jetstream().key_value(Names().config_bucket)
        for tenant, w in shares.items():
            await kv.put(f"share.{tenant}", str(w).encode())
    finally:
        await nc.close()


async def p50s_zero_work(a: ConnectOptions, b: ConnectOptions, n: int,
                         chunk: int = 100) -> tuple[float, float]:
    """The p50 latency (µs) of one caller with zero work, through `a` and through `b`,
    interleaved in chunks so that both see the same machine (the box is shared)."""
    body = json.dumps({"duration_us": 0}).encode()
    lat: dict[int, list[int]] = {0: [], 1: []}
    async with Client.connect(a) as ca, Client.connect(b) as cb:
        for i in range(2 * n // chunk):
            c = (ca, cb)[i % 2]
            for _ in range(chunk):
                t0 = time.perf_counter_ns()
                await c.call("calibrated", body, deadline_ms=DEADLINE_MS)
                lat[i % 2].append((time.perf_counter_ns() - t0) // 1000)
    return quantile(lat[0], 0.5), quantile(lat[1], 0.5)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--work-us", type=int, default=20_000)
    args = ap.parse_args()
    body = json.dumps({"duration_us": args.work_us}).encode()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "accounts.conf"
        conf.write_text(accounts_conf())
        async with EmbeddedNats(NatsServerSpec(extra_args=["-c", str(conf)])) as srv:
            plane = opts(srv.url, "plane")
            up = subprocess.Popen(
                [str(BIN / "plane"), "up", "--nats", srv.url, "--user", "plane",
                 "--password", "plane-pw", "--models", "calibrated", "--slots",
                 str(args.slots), "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
            try:
                assert up.stdout is not None
                while "Ctrl-C" not in (line := await asyncio.to_thread(up.stdout.readline)):
                    if not line:
                        raise RuntimeError("plane up exited")
                cap = await capacity(opts(srv.url, "t1"), body, args.slots, 8.0)
                before = await meter(plane)
                heavy, light = await asyncio.gather(
                    load(opts(srv.url, "heavy"), body, 3 * cap, args.duration),
                    load(opts(srv.url, "light"), body, 0.3 * cap, args.duration))
                await set_shares(plane, {"T1": 1, "T2": 2, "T3": 3})
                await asyncio.sleep(1.0)
                mid = await meter(plane)
                await asyncio.gather(*(load(opts(srv.url, t.lower()), body, 2 * cap,
                                            args.duration) for t in ("T1", "T2", "T3")))
                await asyncio.sleep(1.0)
                after = await meter(plane)
                await asyncio.sleep(2.0)  # the loads' last retries and promises are over
                p50_tenant, p50_plane = await p50s_zero_work(opts(srv.url, "t1"), plane, 3000)
            finally:
                up.terminate()
                up.wait(timeout=30)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.slots} slots x {args.work_us} us calibrated, "
          f"deadline {DEADLINE_MS} ms, {args.duration:.0f} s per load")
    print(f"capacity (closed loop, {args.slots} callers): {cap:.1f} req/s\n")

    rows = []
    for name, outs in (("HEAVY (3x)", heavy), ("LIGHT (0.3x)", light)):
        acc = [o for o in outs if o.attempts.final == "200"]
        p50, p99 = ms([o.accepted_us for o in acc], 0.5), ms([o.accepted_us for o in acc], 0.99)
        rows.append((name, len(outs), len(acc) / args.duration,
                     sum(map(first_or_ticketed, outs)) / max(1, len(outs)), p50, p99))
    print("| tenant | offered | accepted/s | first try or ticketed retry | accepted p50 ms | "
          "accepted p99 ms | p99/p50 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n, aps, fot, p50, p99 in rows:
        print(f"| {name} | {n} | {aps:.1f} | {fot:.2%} | {p50:.1f} | {p99:.1f} | "
              f"{p99 / p50:.2f} |")
    light_paths = Counter(o.attempts.statuses[:3] for o in light if not first_or_ticketed(o))
    print(f"\nLIGHT's other paths (first three statuses): {light_paths.most_common(5)}")
    goodput = (rows[0][2] + rows[1][2]) / cap
    used = {t: after.get(t, 0) - mid.get(t, 0) for t in ("T1", "T2", "T3")}
    total = sum(used.values()) or 1
    shares = {t: u / total for t, u in used.items()}
    print("\nweights 1:2:3, each offering 2x: slot-time shares "
          + ", ".join(f"{t} {s:.1%}" for t, s in shares.items()))
    print(f"heavy/light slot us (meter): {after.get('HEAVY', 0) - before.get('HEAVY', 0)} / "
          f"{after.get('LIGHT', 0) - before.get('LIGHT', 0)}")
    print(f"zero-work p50, one caller: through a tenant's import {p50_tenant / 1000:.3f} ms, "
          f"inside the plane's account {p50_plane / 1000:.3f} ms "
          f"({p50_tenant / p50_plane - 1:+.1%})\n")
    light_row = rows[1]
    checks = [
        ("LIGHT first try or ticketed retry >= 99%", light_row[3] >= 0.99),
        ("LIGHT accepted p99/p50 <= 1.8", light_row[5] / light_row[4] <= 1.8),
        ("total goodput >= 95% of capacity", goodput >= 0.95),
        ("1:2:3 shares within +-5% (points) of 1/6, 2/6, 3/6",
         all(abs(shares[t] - w / 6) <= 0.05 for t, w in (("T1", 1), ("T2", 2), ("T3", 3)))),
        ("accounts cost <= 5% of the p50", p50_tenant <= 1.05 * p50_plane),
    ]
    print(f"total goodput (heavy + light): {goodput:.0%} of capacity")
    for name, ok in checks:
        print(f"- [{'x' if ok else ' '}] {name}")


if __name__ == "__main__":
    run(main())
