"""The plane's promise under overload: `plane pulse --retry` at 0.9x and 2x the capacity.

    .venv/bin/python benchmarks/overload_2x.py [--duration 60] [--slots 4] [--work-us 20000]
                                               [--deadline-ms 1000] [--routers 1] [--no-retry]
                                               [--device-waits loop|thread]

One run: an embedded nats-server, `plane up --nats URL --models calibrated --slots N` as its
own process (router and node), `--routers` - 1 more `plane router` processes (the routers
share one queue group: a retry lands on any of them), and this process as the caller (the
pulse driver: open loop, latency from each request's scheduled send time, the SDK's retries:
Retry-After, tickets).
The capacity is measured first (closed loop, one caller per slot); then 0.9x and 2x of it are
offered for --duration seconds each. Prints the issue's targets next to what was measured,
the accepted attempts' p50 and p99 split by who was let in (newcomers at their first try,
ticket holders), the routers' counters over both loads (refusals by reason, tickets issued
and honoured, holders parked, the broker's depth refusals, the histogram of holders'
lateness) and the first retries not let in at 2x, by their attempts' statuses.
With --no-retry the callers never come back (like `hey`, or `plane pulse --no-retry`): what
counts then is the goodput at 2x against the closed-loop capacity (issue 10: >= 90%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from plane.client import Client
from plane.contract.backoff import NO_RETRY, RetryPolicy
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.lifecycle import run
from plane.contract.quantiles import quantile
from plane.contract.subjects import Names
from plane.observe.planeview import collect
from plane.pulse.outcome import Outcome
from plane.pulse.runner import LoadConfig, run_load
from plane.pulse.targets import NatsTarget

BIN = Path(sys.executable).parent
DEADLINE_MS = 1000
WARMUP_S = 2.0  # closed loop before the capacity is measured


async def capacity(url: ConnectOptions | str, body: bytes, callers: int,
                   seconds: float, deadline_ms: int = DEADLINE_MS) -> float:
    async with Client.connect(url) as c:
        # Warm up first: a plane just started (its slots' first calls, the router's first
        # estimates) measured half its capacity at a 50 ms deadline in a slow spell.
        warm_end = time.monotonic() + WARMUP_S
        while time.monotonic() < warm_end:
            await asyncio.gather(*(c.call("calibrated", body, deadline_ms=deadline_ms)
                                   for _ in range(callers)))
        done = 0
        end = time.monotonic() + seconds

        async def caller() -> None:
            nonlocal done
            while time.monotonic() < end:
                r = await c.call("calibrated", body, deadline_ms=deadline_ms)
                done += r.status == 200

        t0 = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return done / (time.monotonic() - t0)


def pct(values: list[int], p: float) -> float:
    """The p-th percentile of microsecond values, in ms."""
    return quantile(values, p / 100) / 1000


def figures(outcomes: list[Outcome], seconds: float,
            deadline_ms: int = DEADLINE_MS) -> dict[str, float]:
    accepted = [o for o in outcomes if o.attempts.final == "200"]
    refused_first = [o for o in outcomes if o.attempts.statuses[:1] == (429,)]
    retried = _retried(outcomes)
    firsts = [o.accepted_us for o in accepted if len(o.attempts.statuses) == 1]
    holders = [o.accepted_us for o in accepted if len(o.attempts.statuses) > 1]
    return {
        "offered": len(outcomes),
        "accepted_per_s": len(accepted) / seconds,
        "accepted_within_deadline": sum(o.latency_us <= deadline_ms * 1000 for o in accepted)
        / max(1, len(accepted)),
        "accepted_p50_ms": pct([o.accepted_us for o in accepted], 50),
        "accepted_p99_ms": pct([o.accepted_us for o in accepted], 99),
        # The same split by who was let in: a newcomer at its first try, or a ticket holder
        # (its attempt's time includes any wait, parked, for the slot its ticket was for).
        # At 2x of 4 x 2 ms on this project's host the accepted tail was the holders' alone
        # (BENCHMARKS.md, forty-sixth session). NaN for a group that is empty.
        "first_try_p50_ms": pct(firsts, 50),
        "first_try_p99_ms": pct(firsts, 99),
        "holder_p50_ms": pct(holders, 50),
        "holder_p99_ms": pct(holders, 99),
        "first_try_share_of_accepted": len(firsts) / max(1, len(accepted)),
        # What the caller waited in all, retries included, from the request's scheduled send.
        "whole_p50_ms": pct([o.latency_us for o in accepted], 50),
        "whole_p99_ms": pct([o.latency_us for o in accepted], 99),
        "refused_first_share": len(refused_first) / max(1, len(outcomes)),
        "first_retry_success": sum(o.attempts.statuses[1] == 200 for o in retried)
        / max(1, len(retried)),
        # Over the refused that came back (as `plane pulse` counts it): a final refusal
        # (`deadline`, `overloaded`) counted as 0 retries pulled the mean under 1.2 whatever
        # the retries did.
        "mean_retries_per_refused": sum(len(o.attempts.statuses) - 1 for o in retried)
        / max(1, len(retried)),
        "retried_share_of_refused": len(retried) / max(1, len(refused_first)),
    }


def failed_first_retries(outcomes: list[Outcome]) -> dict[str, int]:
    """The requests whose first retry was not let in, by the statuses of their attempts
    (`429,429`: refused again, `429,0`: no answer within the caller's wait), most first."""
    failed = Counter(",".join(map(str, o.attempts.statuses[:3])) for o in _retried(outcomes)
                     if o.attempts.statuses[1] != 200)
    return dict(failed.most_common())


def _retried(outcomes: list[Outcome]) -> list[Outcome]:
    """The requests refused at their first try (429) that tried again."""
    return [o for o in outcomes
            if o.attempts.statuses[:1] == (429,) and len(o.attempts.statuses) >= 2]


def counters(metrics_text: str) -> str:
    """The routers' refusals by reason, tickets issued and honoured, holders parked, the
    broker's depth refusals, floods shed and requests refused unread by a router behind on
    its inbox (summed over routers): where the refusals came from."""
    sums: dict[str, float] = {}
    pattern = (r'^plane_(refusals_total|tickets_issued_total|tickets_honoured_total|'
               r'tickets_parked_total|broker_slot_refusals_total|'
               r'ticket_lateness_seconds_bucket|router_shed_total|router_behind_total)'
               r'\{([^}]*)\} (\S+)$')
    for kind, labels, value in re.findall(pattern, metrics_text, re.MULTILINE):
        label = re.search(r'(?:reason|le)="([^"]*)"', labels)
        kind = kind.removesuffix("_total")
        key = f"{kind}[{label.group(1)}]" if label else kind
        sums[key] = sums.get(key, 0.0) + float(value)
    return ", ".join(f"{k} {v:.0f}" for k, v in sums.items())


def refusal_share_within_1ms(metrics_text: str) -> tuple[float, int]:
    """From the routers' decision histograms (summed): the share of refusals decided within
    1 ms by the router that decided them."""
    def bucket(le: str) -> float:
        found = re.findall(r'plane_router_decision_seconds_bucket\{le="' + re.escape(le)
                           + r'",model="calibrated",outcome="refused"\} (\S+)', metrics_text)
        return sum(float(v) for v in found)
    total = bucket("+Inf")
    return (bucket("0.001") / total if total else float("nan")), int(total)


async def holder_stats(url: str) -> dict[str, int]:
    """The routers' `ticket_stats` (their status, found as `plane status` finds them),
    summed: what ticket holders found."""
    async with Client.connect(url) as c:
        view = await collect(c.nc, Names(), timeout_s=2.0)
    total: Counter[str] = Counter()
    for r in view.routers:
        total.update(r.ticket_stats)
    return dict(sorted(total.items()))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--work-us", type=int, default=20_000)
    ap.add_argument("--metrics-port", type=int, default=9791)
    ap.add_argument("--routers", type=int, default=1)
    ap.add_argument("--capacity", type=float, default=None, metavar="REQ_PER_S",
                    help="take this as the closed-loop capacity instead of measuring it: "
                         "versions compared offer the same loads (on this host the measure "
                         "moves 20-30%% from run to run)")
    ap.add_argument("--deadline-ms", type=int, default=DEADLINE_MS,
                    help="each request's Plane-Deadline-Ms (retries included)")
    ap.add_argument("--no-retry", action="store_true",
                    help="callers that never come back: goodput against the capacity")
    ap.add_argument("--device-waits", choices=("loop", "thread"), default=None,
                    help="`plane up --device-waits` (default: plane up's own)")
    args = ap.parse_args()
    body = json.dumps({"duration_us": args.work_us}).encode()
    async with EmbeddedNats() as srv:
        up = subprocess.Popen(
            [str(BIN / "plane"), "up", "--nats", srv.url, "--models", "calibrated",
             "--slots", str(args.slots), "--log-level", "warning",
             "--metrics-port", str(args.metrics_port),
             *(["--device-waits", args.device_waits] if args.device_waits else [])],
            stdout=subprocess.PIPE, text=True)
        more = [subprocess.Popen(
            [str(BIN / "plane"), "router", "--nats", srv.url, "--router-id", f"router{i + 1}",
             "--log-level", "warning", "--metrics-port", str(args.metrics_port + 1 + i)])
            for i in range(args.routers - 1)]
        try:
            assert up.stdout is not None
            while "Ctrl-C" not in (line := await asyncio.to_thread(up.stdout.readline)):
                if not line:
                    raise RuntimeError("plane up exited")
            await asyncio.sleep(2.0 if more else 0.0)  # the extra routers see the node's advert
            # Given a capacity, the closed loop only warms the plane up (1 s after WARMUP_S).
            measured = await capacity(srv.url, body, args.slots,
                                      1.0 if args.capacity else 10.0, args.deadline_ms)
            cap = args.capacity or measured
            rows = {}
            failed: dict[float, dict[str, int]] = {}
            for factor in (0.9, 2.0):
                target = NatsTarget(ConnectOptions(url=srv.url, name="overload"),
                                    model="calibrated", deadline_ms=args.deadline_ms,
                                    policy=NO_RETRY if args.no_retry else RetryPolicy())
                async with target:
                    t0 = time.monotonic()
                    result = await run_load(target, body, LoadConfig(
                        rate=factor * cap, duration_s=args.duration, concurrency=4096))
                    rows[factor] = figures(result.outcomes, time.monotonic() - t0,
                                           args.deadline_ms)
                    failed[factor] = failed_first_retries(result.outcomes)
            stats = await holder_stats(srv.url)
            text = "\n".join(urllib.request.urlopen(
                f"http://127.0.0.1:{args.metrics_port + i}/metrics", timeout=5).read().decode()
                for i in range(args.routers))
        finally:
            procs: list[subprocess.Popen[Any]] = [*more, up]
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
    share_1ms, refusals = refusal_share_within_1ms(text)
    r09, r2 = rows[0.9], rows[2.0]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.slots} slots x {args.work_us} us calibrated, "
          f"{args.routers} router(s), deadline {args.deadline_ms} ms, {args.duration:.0f} s per "
          "load"
          f"{', callers never retry' if args.no_retry else ''}")
    print(f"capacity ({'given' if args.capacity else 'closed loop'}, {args.slots} callers): "
          f"{cap:.1f} req/s "
          f"(ideal {args.slots / args.work_us * 1e6:.0f})\n")
    print("| load | offered | accepted/s | accepted within deadline | accepted p50 ms | "
          "accepted p99 ms | p99/p50 | refused at first try | first-retry success | "
          "mean retries per refused | whole wait p50 / p99 ms (retries included) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for f, r in rows.items():
        print(f"| {f}x | {r['offered']:.0f} | {r['accepted_per_s']:.1f} | "
              f"{r['accepted_within_deadline']:.2%} | {r['accepted_p50_ms']:.1f} | "
              f"{r['accepted_p99_ms']:.1f} | {r['accepted_p99_ms'] / r['accepted_p50_ms']:.2f} "
              f"| {r['refused_first_share']:.1%} | {r['first_retry_success']:.2%} | "
              f"{r['mean_retries_per_refused']:.2f} | {r['whole_p50_ms']:.1f} / "
              f"{r['whole_p99_ms']:.1f} |")
    print("\naccepted attempts by who was let in (p50 / p99 ms, share of the accepted): "
          + "; ".join(
              f"{f}x newcomers at their first try {r['first_try_p50_ms']:.1f} / "
              f"{r['first_try_p99_ms']:.1f} ({r['first_try_share_of_accepted']:.1%}), ticket "
              f"holders {r['holder_p50_ms']:.1f} / {r['holder_p99_ms']:.1f}"
              for f, r in rows.items()))
    print(f"router counters over both loads: {counters(text)}")
    print(f"what ticket holders found (routers' status, both loads): {stats}")
    print(f"first retries not let in at 2x, by the statuses of the attempts: {failed[2.0]}\n")
    if args.no_retry:
        print(f"goodput at 2x: {r2['accepted_per_s'] / cap:.0%} of the capacity")
        for name, ok in [
            ("accepted within deadline at 2x >= 99.9%", r2["accepted_within_deadline"] >= 0.999),
            ("goodput at 2x >= 90% of the capacity", r2["accepted_per_s"] >= 0.9 * cap),
        ]:
            print(f"- [{'x' if ok else ' '}] {name}")
        return
    checks = [
        ("accepted within deadline at 2x >= 99.9%", r2["accepted_within_deadline"] >= 0.999),
        ("accepted p99/p50 at 2x <= 1.8",
         r2["accepted_p99_ms"] / r2["accepted_p50_ms"] <= 1.8),
        ("first-retry success at 2x >= 99.5%", r2["first_retry_success"] >= 0.995),
        ("mean retries per refused request at 2x <= 1.2", r2["mean_retries_per_refused"] <= 1.2),
        ("goodput at 2x >= 90% of accepted/s at 0.9x",
         r2["accepted_per_s"] >= 0.9 * r09["accepted_per_s"]),
        (f"refusals decided within 1 ms (router): {share_1ms:.2%} of {refusals} >= 99%",
         share_1ms >= 0.99),
    ]
    print(f"goodput at 2x: {r2['accepted_per_s'] / r09['accepted_per_s']:.0%} of 0.9x")
    for name, ok in checks:
        print(f"- [{'x' if ok else ' '}] {name}")


if __name__ == "__main__":
    run(main())
