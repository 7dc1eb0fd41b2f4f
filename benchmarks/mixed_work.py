"""The plane under loads its own benchmarks do not make: Poisson arrivals and work that
differs per request, as a service's real callers send.

    .venv/bin/python benchmarks/mixed_work.py [--slots 4] [--work-us 1000:10000]
                                              [--duration 10] [--arrivals poisson|even]

One run: an embedded nats-server, `plane up --models calibrated --slots N` as its own
process, and this process as the callers, through the SDK (`plane.client.Client.invoke`,
its retries: Retry-After, tickets). Each request asks for `duration_us` drawn uniformly from
`--work-us LO:HI` (one value: all alike). The capacity is measured closed loop first (one
caller per slot, the same draw), then 0.9x and 2x of it are offered for `--duration`
seconds each, at Poisson arrivals (`--arrivals even`: evenly spaced, as `plane pulse` and
`overload_2x.py` send).

Printed per load: answered 200 per second, the share answered 200, refused at the first
try, first-retry success (of the requests refused once, the share whose second try was a
200), and the whole wait from the scheduled send to the answer (retries included), also
less the request's own work (what the plane and the refusals added). An M/G/c queue at 0.9x
already waits most of the time: compare with what a queue would do, not with zero.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plane.client import Client
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import PlaneError
from plane.contract.quantiles import quantile

BIN = Path(sys.executable).parent
DEADLINE_MS = 1000
WARMUP_S = 2.0
CAPACITY_S = 6.0


@dataclass(frozen=True, slots=True)
class Answer:
    waited_s: float  # from the scheduled send to the final answer, retries included
    work_us: int
    attempts: int
    ok: bool


def work_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError("--work-us is LO:HI microseconds, 0 <= LO <= HI")
    return low, high


async def one(plane: Client, at_s: float, work_us: int, out: list[Answer]) -> None:
    try:
        r = await plane.invoke("calibrated", {"duration_us": work_us}, deadline_ms=DEADLINE_MS)
        out.append(Answer(time.monotonic() - at_s, work_us, r.attempts, True))
    except PlaneError as exc:
        out.append(Answer(time.monotonic() - at_s, work_us, exc.attempts or 1, False))


async def capacity(plane: Client, slots: int, draw: random.Random, work: tuple[int, int]
                   ) -> float:
    answered = 0
    for seconds, counted in ((WARMUP_S, False), (CAPACITY_S, True)):
        end = time.monotonic() + seconds

        async def caller(counted: bool = counted, end: float = end) -> None:
            nonlocal answered
            while time.monotonic() < end:
                r = await plane.call("calibrated", {"duration_us": draw.randint(*work)},
                                     deadline_ms=DEADLINE_MS)
                answered += counted and r.status == 200

        await asyncio.gather(*(caller() for _ in range(slots)))
    return answered / CAPACITY_S


async def offer(plane: Client, rate: float, seconds: float, poisson: bool,
                draw: random.Random, work: tuple[int, int]) -> list[Answer]:
    out: list[Answer] = []
    start, t = time.monotonic(), 0.0
    async with asyncio.TaskGroup() as tg:
        while True:
            t += draw.expovariate(rate) if poisson else 1 / rate
            if t >= seconds:
                break
            if (wait := start + t - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            tg.create_task(one(plane, start + t, draw.randint(*work), out))
    return out


def row(load: str, answers: list[Answer], seconds: float) -> str:
    ok = [a for a in answers if a.ok]
    refused = [a for a in answers if a.attempts > 1]
    second_ok = [a for a in refused if a.ok and a.attempts == 2]
    waits = [a.waited_s * 1e3 for a in ok]
    added = [a.waited_s * 1e3 - a.work_us / 1e3 for a in ok]
    first_retry = f"{len(second_ok) / len(refused):.2%}" if refused else "-"
    return (f"| {load} | {len(answers)} | {len(ok) / seconds:.0f} | "
            f"{len(ok) / len(answers):.1%} | {len(refused) / len(answers):.1%} | "
            f"{first_retry} | {quantile(waits, 0.5):.1f} / {quantile(waits, 0.99):.1f} | "
            f"{quantile(added, 0.5):.1f} / {quantile(added, 0.99):.1f} |")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--work-us", type=work_range, default=(1000, 10_000))
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--arrivals", choices=("poisson", "even"), default="poisson")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--metrics-port", type=int, default=9781)
    args = ap.parse_args()
    draw = random.Random(args.seed)
    async with EmbeddedNats() as srv:
        up = subprocess.Popen(
            [str(BIN / "plane"), "up", "--nats", srv.url, "--models", "calibrated",
             "--slots", str(args.slots), "--log-level", "warning",
             "--metrics-port", str(args.metrics_port)], stdout=subprocess.PIPE, text=True)
        try:
            assert up.stdout is not None
            while "Ctrl-C" not in (line := await asyncio.to_thread(up.stdout.readline)):
                if not line:
                    raise RuntimeError("plane up exited")
            async with Client.connect(srv.url) as plane:
                cap = await capacity(plane, args.slots, draw, args.work_us)
                rows = [row(f"{f}x", await offer(plane, f * cap, args.duration,
                                                 args.arrivals == "poisson", draw,
                                                 args.work_us), args.duration)
                        for f in (0.9, 2.0)]
        finally:
            up.terminate()
            up.wait(timeout=30)
    lo, hi = args.work_us
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.slots} slots, calibrated work uniform in "
          f"[{lo}, {hi}] us, {args.arrivals} arrivals, deadline {DEADLINE_MS} ms, SDK retries")
    print(f"capacity (closed loop, {args.slots} callers): {cap:.1f} req/s\n")
    print("| load | sent | 200/s | answered 200 | refused at first try | first-retry success "
          "| whole wait p50 / p99 ms | less the work p50 / p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    asyncio.run(main())
