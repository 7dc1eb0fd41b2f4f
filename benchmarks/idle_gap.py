"""What an idle gap costs the next request: the plane against the bare floor.

    .venv/bin/python benchmarks/idle_gap.py [--gaps-ms 0,5,20,50,200] [--per-gap 60]
                                            [--warmup 500] [--slots 2]

A newcomer to an idle plane is slower than one that finds it busy (issue 14's time to first
token at 0.9x: newcomers after a gap 4.5 ms at p50, holders who come as a slot frees 3.0 ms).
This says how much of that the plane's own path adds. The two systems of
`cpu_per_request.py` (the floor: a bare nats-py echo in its own process; the plane: `plane
router` and `plane node --model calibrated` in their own processes, zero-work requests),
each warmed with `--warmup` requests, then for each gap `--per-gap` requests one at a time,
each after sleeping the gap. Prints the p50 and p90 ms per gap and path, and the plane's
p50 over the floor's: if the floor slows after a gap as much as the plane does, per process
on its path, the cost is the host's wake-ups, not the plane's logic.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.cpu_per_request import System, floor_system, plane_system  # noqa: E402
from plane.contract.lifecycle import run  # noqa: E402
from plane.contract.quantiles import quantile  # noqa: E402

BODY = b'{"duration_us": 0}'


async def after_gaps(system: System, gaps_s: list[float], per_gap: int,
                     warmup: int) -> dict[float, tuple[float, float]]:
    """(p50, p90) ms of a request sent after each gap."""
    out: dict[float, tuple[float, float]] = {}
    async with system.target() as target:
        for _ in range(warmup):
            await target.send(BODY)
        for gap_s in gaps_s:
            ms: list[float] = []
            for _ in range(per_gap):
                if gap_s:
                    await asyncio.sleep(gap_s)
                sent = time.monotonic()
                await target.send(BODY)
                ms.append((time.monotonic() - sent) * 1e3)
            out[gap_s] = (quantile(ms, 0.5), quantile(ms, 0.9))
    return out


async def measure(gaps_s: list[float], per_gap: int, warmup: int, slots: int) -> None:
    with tempfile.TemporaryDirectory() as logs:
        async with floor_system(Path(logs), BODY) as floor:
            bare = await after_gaps(floor, gaps_s, per_gap, warmup)
        async with plane_system(Path(logs), BODY, slots=slots, deadline_ms=1000) as plane:
            ours = await after_gaps(plane, gaps_s, per_gap, warmup)
    print(f"{per_gap} zero-work requests per gap, one at a time, after {warmup} to warm")
    print("| gap ms | floor p50 / p90 ms | plane p50 / p90 ms | plane p50 / floor p50 |")
    print("| --- | --- | --- | --- |")
    for gap_s in gaps_s:
        (f50, f90), (p50, p90) = bare[gap_s], ours[gap_s]
        print(f"| {gap_s * 1e3:g} | {f50:.3f} / {f90:.3f} | {p50:.3f} / {p90:.3f} | "
              f"{p50 / f50:.2f}x |")


@click.command()
@click.option("--gaps-ms", default="0,5,20,50,200", show_default=True,
              help="Idle before each request, comma-separated.")
@click.option("--per-gap", type=int, default=60, show_default=True)
@click.option("--warmup", type=int, default=500, show_default=True)
@click.option("--slots", type=int, default=2, show_default=True)
def main(gaps_ms: str, per_gap: int, warmup: int, slots: int) -> None:
    gaps_s = [float(g) / 1e3 for g in gaps_ms.split(",") if g.strip()]
    run(measure(gaps_s, per_gap, warmup, slots))


if __name__ == "__main__":
    main()
