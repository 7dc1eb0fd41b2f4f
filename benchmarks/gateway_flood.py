"""HTTP callers that never come back, as many as `hey -c N` keeps busy, through the gateway.

    .venv/bin/python benchmarks/gateway_flood.py [--slots 2] [--work-us 5000]
                                                 [--concurrency 4,50] [--duration 5]

`hey` (Debian's package) sends each of its N workers' next request as soon as the last one
is answered, and never retries a 429: a refusal that comes back fast makes the next request
come sooner, so N workers offer whatever the plane, the gateway and the host can refuse,
thousands a second, not a rate. What counts is the answers (200s) a second against the
slots' ideal (slots x 1 s / work): does the plane keep its slots fed while it refuses the
rest (issue 10: callers that never retry still get about the capacity)? The concurrencies
run in turn on one plane, as a user's traffic comes: `plane up --models calibrated --slots
S` (the README's main command: its embedded nats-server, router and node) and `plane
gateway`, each its own process; CPU of each (and of the nats-server) from /proc/<pid>/stat
over each run. On this project's 2-core VMs the
gateway's own CPU (aiohttp, ~180 us a request) is the largest share at 50 workers: the
figures say how much of the host the plane still gets, not what a gateway on its own cores
would give.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.children import child, until  # noqa: E402
from benchmarks.cpu_per_request import CLK_TCK, cpu_ticks  # noqa: E402
from plane.contract.processes import free_port  # noqa: E402

PLANE = [sys.executable, "-m", "plane"]


def serves(log: Path) -> bool:
    """`plane up` prints how to call it once it serves."""
    return "Ctrl-C stops everything" in log.read_text(errors="replace")


def nats_server_of(pid: int) -> int:
    """The nats-server `plane up` started (its child)."""
    for child_pid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if Path(f"/proc/{child_pid}/comm").read_text().strip() == "nats-server":
            return int(child_pid)
    raise RuntimeError(f"plane up ({pid}) has no nats-server child")


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def hey_load(spec: str) -> tuple[int, float | None]:
    """`N` (hey's workers, each sending its next request when answered) or `N@Q` (each worker
    at most Q requests a second: hey's -q, a rate; hey's workers then send together)."""
    workers, _, rate = spec.partition("@")
    return int(workers), float(rate) if rate else None


async def flood(hey: str, base: str, body: str, spec: str, duration_s: float,
                pids: tuple[int, int, int], ideal_per_s: float,
                wait_ms: int | None = None) -> dict[str, float]:
    workers, rate = hey_load(spec)
    cpu0 = tuple(cpu_ticks(p) for p in pids)
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        hey, "-z", f"{duration_s}s", "-c", str(workers), *(("-q", f"{rate:g}") if rate else ()),
        *(("-H", f"Plane-Wait-Ms: {wait_ms}") if wait_ms else ()),
        "-m", "POST", "-d", body, f"{base}/v1/infer/calibrated",
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    wall_s = time.monotonic() - t0
    up_cpu, gw_cpu, nats_cpu = ((cpu_ticks(p) - c) / CLK_TCK
                                for p, c in zip(pids, cpu0, strict=True))
    codes = {int(c): int(n)
             for c, n in re.findall(r"\[(\d{3})\]\s+(\d+) responses", out.decode())}
    total = sum(codes.values())
    # hey's latency distribution is of every answer, 429s (fast) and 200s alike.
    pcts = {int(q): float(v) * 1000
            for q, v in re.findall(r"(\d+)% in ([0-9.]+) secs", out.decode())}
    return {"workers": workers, "rate_per_worker": rate or 0.0, "wait_ms": wait_ms or 0,
            "requests_per_s": total / duration_s,
            "ok_per_s": codes.get(200, 0) / duration_s,
            "refused_per_s": codes.get(429, 0) / duration_s,
            "other": total - codes.get(200, 0) - codes.get(429, 0),
            "ideal_per_s": ideal_per_s,
            "p50_ms": pcts.get(50, 0.0), "p99_ms": pcts.get(99, 0.0),
            "cpu_up": up_cpu / wall_s, "cpu_gateway": gw_cpu / wall_s,
            "cpu_nats": nats_cpu / wall_s}


async def floods(hey: str, args: argparse.Namespace, logs: Path) -> list[dict[str, float]]:
    """Each concurrency in turn, on one plane (as a user's traffic comes: what a load leaves
    in the router's books, the next one meets)."""
    nats_port, port = free_port(), free_port()
    url = f"nats://127.0.0.1:{nats_port}"
    up_args = [*PLANE, "up", "--port", str(nats_port), "--models", "calibrated", "--slots",
               str(args.slots), "--log-level", args.log_level]
    gw_args = [*PLANE, "gateway", "--nats", url, "--port", str(port),
               "--log-level", args.log_level]
    async with child(up_args, logs / "up.log") as up:
        await until("plane up", lambda: asyncio.to_thread(serves, logs / "up.log"), 60,
                    logs / "up.log")
        async with child(gw_args, logs / "gateway.log") as gw:
            base = f"http://127.0.0.1:{port}"
            await until("the gateway", lambda: asyncio.to_thread(ready, f"{base}/readyz"),
                        60, logs / "gateway.log")
            body = json.dumps({"duration_us": args.work_us})
            # A second of warm-up, not counted (the slots' first calls, the budget's first
            # samples).
            warm = await asyncio.create_subprocess_exec(
                hey, "-z", "1s", "-c", "2", "-m", "POST", "-d", body,
                f"{base}/v1/infer/calibrated", stdout=asyncio.subprocess.DEVNULL)
            await warm.wait()
            assert up.pid is not None and gw.pid is not None
            server = nats_server_of(up.pid)
            return [await flood(hey, base, body, spec, args.duration,
                                (up.pid, gw.pid, server), args.slots * 1e6 / args.work_us,
                                wait_ms)
                    for wait_ms in args.wait_ms for spec in args.concurrency.split(",")]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--work-us", type=int, default=5000)
    ap.add_argument("--concurrency", default="4,50",
                    help="hey's workers, one run each, in this order, on one plane; N@Q: "
                         "N workers at most Q requests a second each (hey -q)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    ap.add_argument("--wait-ms", type=lambda v: [int(x) or None for x in v.split(",")],
                    default=[None], help="hey sends Plane-Wait-Ms: N (0: none); several, "
                    "comma separated: every concurrency with each, in turn")
    ap.add_argument("--log-level", default="info", choices=("info", "warning"),
                    help="of plane up and the gateway (info: their defaults, sampled lines)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    hey = shutil.which("hey")
    if hey is None:
        sys.exit("gateway_flood needs `hey` (Debian: apt-get install hey; `make test` does it)")
    with tempfile.TemporaryDirectory(prefix="gateway-flood-") as tmp:
        rows = await floods(hey, args, Path(tmp))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.slots} slots x {args.work_us} us calibrated, "
          f"`plane up` + `plane gateway` (log level {args.log_level}), hey for "
          f"{args.duration:.0f} s per row\n")
    print("| hey workers | requests/s | 200/s | of the slots' ideal | 429/s | other "
          "| p50 / p99 ms (all answers) | CPU plane up | CPU gateway | gateway µs a request "
          "| CPU nats-server |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        workers = (f"{r['workers']} at {r['rate_per_worker']:g}/s"
                   if r["rate_per_worker"] else f"{r['workers']}")
        if r["wait_ms"]:
            workers += f", Plane-Wait-Ms {r['wait_ms']:g}"
        print(f"| {workers} | {r['requests_per_s']:.0f} | {r['ok_per_s']:.1f} | "
              f"{r['ok_per_s'] / r['ideal_per_s']:.1%} | {r['refused_per_s']:.0f} | "
              f"{r['other']:.0f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | {r['cpu_up']:.0%} | "
              f"{r['cpu_gateway']:.0%} | "
              f"{1e6 * r['cpu_gateway'] / max(r['requests_per_s'], 1e-9):.0f} | "
              f"{r['cpu_nats']:.0%} |")


if __name__ == "__main__":
    asyncio.run(main())
