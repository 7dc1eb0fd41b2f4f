"""The plane past its router's limit: goodput as the offered load passes what one router decides.

    .venv/bin/python benchmarks/router_limit.py [--spin-us 1500] [--slots 8] [--work-us 2000]
                                                [--rates 300,900,1800] [--seconds 8]

On a GPU host the router's process, not the device, is the plane's limit (BENCHMARKS.md, "The
plane on the GPU"): at 6,000/s offered it decided 60-120 ms after each request's receipt and
answered 94-994/s of the 1,300-2,900/s it manages below its limit. This host cannot offer that
many requests, so the router is made slower instead: its process spends --spin-us of CPU on
each request it reads before handling it (a busy loop in the request callback, holding the GIL
like a slower core would), which puts its limit at a few hundred requests/s while the node
(--slots x --work-us of `calibrated`) has room for thousands. Then `plane pulse --retry` (or
--no-retry) offers each of --rates for --seconds.

Processes: a nats-server, `plane node`, the router (this script as `router-child`), and `plane
pulse`, each on its own; all on loopback. Per rate it prints pulse's answers/s, first-try
refusals, first-retry success, accepted p50/p99, the router's CPU seconds, and from the
router's /metrics the decisions' time from receipt (p50/p99, interpolated within the
histogram's buckets) and refusals by reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the plane's own modules (run as a script from any directory)

from plane.observe.planeview import bucket_delta, bucket_quantile, metrics_facts  # noqa: E402

SHED_SHARE = 0.4
# pulse's own cap on requests in flight (a caller waiting out a Retry-After is in flight):
# high enough that pulse offers the whole rate instead of dropping arrivals itself.
CONCURRENCY = 20_000
SHED_PATHS = ("_shed", "overflowed", "_shed_stale")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plane(*args: str) -> list[str]:
    return [sys.executable, "-m", "plane", *args]


def wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], limit_s: float = 60) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if re.search(pattern, log.read_text(errors="replace")):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited {proc.returncode}: "
                               f"{log.read_text(errors='replace')[-800:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{log.name}: no {pattern!r} in {limit_s:g} s")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decision_buckets(texts: list[str]) -> dict[float, float]:
    """The routers' decision histograms (from receipt, all outcomes), summed."""
    out: dict[float, float] = {}
    for t in texts:
        for bound, count in metrics_facts("", t).decision_buckets.items():
            out[bound] = out.get(bound, 0.0) + count
    return out


def refusals(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^plane_(?:refusals|shed)_total\{([^}]*)\} (\S+)$", text,
                                    re.MULTILINE):
        reason = re.search(r'reason="([^"]*)"', labels)
        key = reason.group(1) if reason else "shed"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def decisions(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^plane_router_decision_seconds_count\{([^}]*)\} (\S+)$",
                                    text, re.MULTILINE):
        outcome = re.search(r'outcome="([^"]*)"', labels)
        key = outcome.group(1) if outcome else "?"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def router_child(argv: list[str]) -> None:
    """The router on a slower CPU: --spin-us of busy work (holding the GIL) for each request
    it decides, SHED_SHARE of that for each it refuses without a decision (a flood's, an
    overflow's: a reply and no admission, ~40% of a placement's CPU in `benchmarks/
    router_split.py`)."""
    spin_s = int(argv[0]) / 1e6
    from plane.router.requests import RequestPath

    def slowed(name: str, seconds: float) -> None:
        handle = getattr(RequestPath, name)

        async def wrapper(self: RequestPath, *args: object) -> None:
            spin(seconds)
            await handle(self, *args)

        setattr(RequestPath, name, wrapper)

    slowed("_route_one", spin_s)
    for name in SHED_PATHS:
        if hasattr(RequestPath, name):
            slowed(name, spin_s * SHED_SHARE)
    from plane.app import main

    main(args=argv[1:], prog_name="plane")


def main() -> int:
    if sys.argv[1:2] == ["router-child"]:
        router_child(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spin-us", type=int, default=1500)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--work-us", type=int, default=2000)
    ap.add_argument("--rates", default="300,900,1800")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--routers", type=int, default=1,
                    help="routers, each slowed alike (one queue group)")
    ap.add_argument("--no-retry", action="store_true",
                    help="callers that never come back (like hey), instead of the SDK's retries")
    ap.add_argument("--keep", action="store_true", help="keep the logs' folder")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="router-limit-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                             cwd=ROOT)
        procs.append(p)
        return p

    try:
        nats = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
        port = free_port()
        srv = start([nats, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(d / "js")],
                    d / "nats.log")
        wait_for(d / "nats.log", r"Server is ready", srv)
        url = f"nats://127.0.0.1:{port}"
        node = start(plane("node", "--nats", url, "--model", "calibrated", "--slots",
                           str(a.slots), "--backend", "torch", "--log-level", "warning"),
                     d / "node.log")
        routers, metrics_urls = [], []
        for i in range(a.routers):
            mport = free_port()
            log = d / f"router{i}.log"
            routers.append(start([sys.executable, __file__, "router-child", str(a.spin_us),
                                  "router", "--nats", url, "--log-level", "info",
                                  "--router-id", f"r{i}", "--metrics-port", str(mport),
                                  "--metrics-host", "127.0.0.1"], log))
            metrics_urls.append(f"http://127.0.0.1:{mport}/metrics")
            wait_for(log, r"router started", routers[-1])
        time.sleep(3.0)  # the node's slots claimed and announced
        if node.poll() is not None:
            raise RuntimeError(f"node exited: {(d / 'node.log').read_text()[-800:]}")

        def scrape() -> list[str]:  # every router's exposition
            return [urllib.request.urlopen(u, timeout=5).read().decode() for u in metrics_urls]

        print(f"{a.routers} router(s), each spinning {a.spin_us} us a request; calibrated "
              f"{a.work_us} us on {a.slots} slots; {a.seconds:g} s a rate; logs in {d}")
        for rate in (int(r) for r in a.rates.split(",")):
            before_text = scrape()
            before_cpu = sum(cpu_s(r.pid) for r in routers)
            t0 = time.monotonic()
            pulse = subprocess.run(
                plane("pulse", "--nats", url, "--model", "calibrated", "--duration-us",
                      str(a.work_us), "--rate", str(rate),
                      "--no-retry" if a.no_retry else "--retry", "--duration",
                      str(a.seconds), "--json", "--no-progress", "--concurrency",
                      str(CONCURRENCY)),
                capture_output=True, text=True, cwd=ROOT, env=env, timeout=a.seconds + 90)
            router_cpu = sum(cpu_s(r.pid) for r in routers) - before_cpu
            wall_s = time.monotonic() - t0
            text = scrape()
            try:
                s = json.loads(pulse.stdout)
            except ValueError:
                print(f"{rate}/s: pulse failed: {pulse.stderr[-800:]}")
                continue
            print(f"{rate}/s: " + report(s, wall_s, router_cpu, text, before_text))
            time.sleep(2.0)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def report(s: dict[str, object], wall_s: float, router_cpu: float, texts: list[str],
           before_texts: list[str]) -> str:
    """One rate's line: pulse's summary `s`, the routers' CPU and their /metrics before and
    after."""
    statuses = s.get("status_counts")
    ok = statuses.get("200", 0) if isinstance(statuses, dict) else 0
    # The decision histogram over this rate alone (interpolated within its buckets).
    lag = bucket_delta(decision_buckets(texts), decision_buckets(before_texts))
    p50, p99 = (bucket_quantile(lag, q) for q in (0.5, 0.99))
    text, before_text = "\n".join(texts), "\n".join(before_texts)
    refused = diff(refusals(text), refusals(before_text))
    decided = diff(decisions(text), decisions(before_text))
    return (f"{ok} answered 200 in {wall_s:.1f} s (the pulse and its callers' retries; "
            f"{ok / wall_s:.0f}/s), refused first {s.get('refusal_rate', 0):.3f}, first-retry "
            f"{s.get('first_retry_success')}, accepted p50/p99 {s.get('p50_ms')}/"
            f"{s.get('p99_ms')} ms, final statuses {statuses}; router CPU {router_cpu:.2f} s; "
            f"decision from receipt p50/p99 {fmt(p50)}/{fmt(p99)} ms; refusals "
            f"{json.dumps({k: round(v) for k, v in refused.items()})}; decisions "
            f"{json.dumps({k: round(v) for k, v in decided.items()})}")


def fmt(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f}"


if __name__ == "__main__":
    sys.exit(main())
