"""Time from a slot hanging to its withdrawal, as routers see it.

    .venv/bin/python benchmarks/hang_withdrawal.py [--trials 10] [--probe-ms 100]

A real nats-server, a router and a node (2 calibrated slots, probe period 100 ms, 3 misses)
in one process. Each trial makes slot 0 hang (fault injection over NATS), takes the moment the
hung call started on the slot's thread, and waits for the router's view to drop the slot; then
releases the hang and waits for the slot to be reclaimed. Prints per-trial and summary times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import nats

from plane.contract.logs import configure
from plane.contract.messages import FaultCommand, json_encoder
from plane.contract.subjects import Names
from plane.stack import PlaneStack, StackConfig

NODE = "node0-calibrated"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    configure("error")
    names = Names()
    withdraw_ms: list[float] = []
    reclaim_ms: list[float] = []
    async with PlaneStack(StackConfig(models=("calibrated",), slots=2, allow_faults=True)) as st:
        nc = await nats.connect(st.url)
        view = st.routers[0].models["calibrated"].slots[f"{NODE}/0"]
        slot = st.nodes[0].slots[0]
        for _ in range(args.trials):
            await nc.request(names.fault(NODE), json_encoder.encode(
                FaultCommand(k=0, mode="hang")), timeout=2)
            while slot.runner.call_started_s is None:
                await asyncio.sleep(0.001)
            started = slot.runner.call_started_s
            while view.healthy:
                await asyncio.sleep(0.001)
            withdraw_ms.append((time.monotonic() - started) * 1000)
            t0 = time.monotonic()
            await nc.request(names.fault(NODE), json_encoder.encode(
                FaultCommand(k=0, mode="none")), timeout=2)
            while not view.healthy:
                await asyncio.sleep(0.001)
            reclaim_ms.append((time.monotonic() - t0) * 1000)
            await asyncio.sleep(0.3)
        await nc.close()
    print(f"trials: {args.trials}, probe period 100 ms, 3 misses")
    print("| measure | min ms | median ms | max ms |")
    print("| --- | --- | --- | --- |")
    for name, xs in (("hang start -> withdrawn in router view", withdraw_ms),
                     ("hang released -> reclaimed in router view", reclaim_ms)):
        print(f"| {name} | {min(xs):.0f} | {statistics.median(xs):.0f} | {max(xs):.0f} |")


if __name__ == "__main__":
    asyncio.run(main())
