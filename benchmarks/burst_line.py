"""How long a burst's line of promises stands under a load below the capacity.

    .venv/bin/python benchmarks/burst_line.py [--slots 4] [--work-us 20000] [--capacity 180]
                                              [--factor 0.9] [--duration 30] [--burst 40]
                                              [--burst-at 3] [--json]

One run: an embedded nats-server, `plane up --models calibrated --slots N` as its own process,
a 1 s closed-loop warm-up, then this process offers `plane pulse --retry`'s open load (Poisson
arrivals, the SDK's retries: Retry-After, tickets, calls) at --factor x --capacity for
--duration s; --burst SDK calls go out at once --burst-at s in (0: none). A burst refuses most
of itself with tickets, and those promises make a line that newcomers are refused behind
(each told a later turn) until it drains. Below the capacity it should drain within a few
seconds; the forty-fifth session found lines that stood for the rest of the load, because
each promise kept cost its slot the holder's trip back (BENCHMARKS.md, "Forty-fifth
session").

Prints, per second of the load, the % of requests refused at their first try, how long the
line stood (the seconds from the burst on with at least half refused at first try), pulse's
figures (`overload_2x.figures`) and what ticket holders found (the routers' status:
`holder-called`, `holder-called-ahead`, `holder-no-free-slot`, ...). `--json`: one object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the plane's own modules (run as a script from any directory)
sys.path.insert(0, str(ROOT / "benchmarks"))

from overload_2x import capacity, figures, holder_stats  # noqa: E402

from plane.client import Client  # noqa: E402
from plane.contract.backoff import RetryPolicy  # noqa: E402
from plane.contract.config import ConnectOptions  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.lifecycle import run  # noqa: E402
from plane.pulse.outcome import Outcome  # noqa: E402
from plane.pulse.runner import LoadConfig, run_load  # noqa: E402
from plane.pulse.targets import NatsTarget  # noqa: E402

BIN = Path(sys.executable).parent
DEADLINE_MS = 1000
STANDING_SHARE = 0.5  # a second with at least this share refused at first try: the line stood


@contextlib.asynccontextmanager
async def plane_up(url: str, slots: int) -> AsyncIterator[None]:
    """`plane up` on `url`, serving `calibrated` on `slots` slots as its own process, from
    ready (its "Ctrl-C" line) to the block's end (then terminated)."""
    up = subprocess.Popen(
        [str(BIN / "plane"), "up", "--nats", url, "--models", "calibrated", "--slots",
         str(slots), "--log-level", "warning", "--metrics-port", "0"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        while "Ctrl-C" not in (line := await asyncio.to_thread(up.stdout.readline)):
            if not line:
                raise RuntimeError("plane up exited")
        yield
    finally:
        up.terminate()
        up.wait(timeout=30)


def refused_by_second(outcomes: list[Outcome]) -> list[float]:
    """The share of each whole second's requests (by scheduled send) refused at first try."""
    sent: Counter[int] = Counter()
    refused: Counter[int] = Counter()
    for o in outcomes:
        s = int(o.scheduled_s)
        sent[s] += 1
        refused[s] += o.attempts.statuses[:1] == (429,)
    return [refused[s] / sent[s] for s in range(max(sent, default=-1) + 1) if sent[s]]


def stood_s(shares: list[float], from_s: int) -> int:
    """How many seconds from `from_s` on had at least STANDING_SHARE refused at first try
    (the last such second, counted from `from_s`; 0: none)."""
    late = [s for s, share in enumerate(shares) if s >= from_s and share >= STANDING_SHARE]
    return max(late) - from_s + 1 if late else 0


async def burst(url: str, body: bytes, n: int, at_s: float) -> dict[str, int]:
    await asyncio.sleep(at_s)
    async with Client.connect(url) as c:
        results = await asyncio.gather(*(c.call("calibrated", body, deadline_ms=DEADLINE_MS)
                                         for _ in range(n)))
    return dict(Counter(str(r.status) for r in results))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--work-us", type=int, default=20_000)
    ap.add_argument("--capacity", type=float, default=180.0, metavar="REQ_PER_S",
                    help="the closed-loop capacity the load is a share of (measure it with "
                         "overload_2x.py; given, so that the trees compared offer the same)")
    ap.add_argument("--factor", type=float, default=0.9)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--burst", type=int, default=40)
    ap.add_argument("--burst-at", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    body = json.dumps({"duration_us": args.work_us}).encode()
    async with EmbeddedNats() as srv, plane_up(srv.url, args.slots):
        await capacity(srv.url, body, args.slots, 1.0)  # a warm-up (the given capacity)
        target = NatsTarget(ConnectOptions(url=srv.url, name="burst-line"),
                            model="calibrated", deadline_ms=DEADLINE_MS,
                            policy=RetryPolicy())
        burst_task = asyncio.create_task(
            burst(srv.url, body, args.burst, args.burst_at)) if args.burst else None
        async with target:
            t0 = time.monotonic()
            result = await run_load(target, body, LoadConfig(
                rate=args.factor * args.capacity, duration_s=args.duration,
                concurrency=4096))
            seconds = time.monotonic() - t0
        burst_answers = await burst_task if burst_task is not None else {}
        stats = await holder_stats(srv.url)
    shares = refused_by_second(result.outcomes)
    out: dict[str, Any] = {
        "slots": args.slots, "work_us": args.work_us, "offered_per_s": args.factor * args.capacity,
        "burst": args.burst, "burst_answers": burst_answers,
        "refused_first_by_second": [round(s, 4) for s in shares],
        "line_stood_s": stood_s(shares, int(args.burst_at)) if args.burst else None,
        "figures": {k: round(v, 4) for k, v in figures(result.outcomes, seconds,
                                                        DEADLINE_MS).items()},
        "holders_found": stats,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.slots} slots x {args.work_us} us calibrated, {args.factor}x of "
          f"{args.capacity:.0f}/s for {args.duration:.0f} s, burst of {args.burst} at "
          f"{args.burst_at:.0f} s: {burst_answers}")
    print("refused at first try, % a second: "
          + " ".join(f"{100 * s:.0f}" for s in shares))
    if args.burst:
        print(f"the line stood {out['line_stood_s']} s")
    print(f"figures: {out['figures']}")
    print(f"what ticket holders found: {stats}")


if __name__ == "__main__":
    run(main())
