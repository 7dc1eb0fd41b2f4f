"""What one hand-off to a slot's thread and back costs: `loop.run_in_executor` on a one-thread
`ThreadPoolExecutor` (what the node used) against `gpu_node.slot_thread.SlotThread`.

    .venv/bin/python benchmarks/slot_thread_hop.py [--calls 20000] [--rounds 2]

What runs: on uvloop (as the node runs), `--calls` calls of a function that does nothing,
each awaited before the next (as a slot runs one request at a time), through each path in
turn, `--rounds` times. Prints the CPU µs (process time: the loop's thread and the slot's
together) and the wall µs per call. The node makes one such call per request.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_node.slot_thread import SlotThread


def _nothing(i: int) -> int:
    return i


async def _per_call(calls: int, hop: Callable[[int], Awaitable[int]]) -> tuple[float, float]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(calls):
        await hop(i)
    return ((time.process_time() - cpu0) / calls * 1e6,
            (time.perf_counter() - wall0) / calls * 1e6)


async def _main(calls: int, rounds: int) -> None:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1)
    thread = SlotThread("bench")
    paths: dict[str, Callable[[int], Awaitable[int]]] = {
        "run_in_executor (ThreadPoolExecutor(1))":
            lambda i: loop.run_in_executor(executor, _nothing, i),
        "SlotThread.run": lambda i: thread.run(_nothing, i),
    }
    print(f"{calls} calls per path and round, uvloop, Python {sys.version.split()[0]}")
    print("| path | round | CPU µs per call | wall µs per call |\n| --- | --- | --- | --- |")
    for r in range(rounds):
        for name, hop in paths.items():
            cpu_us, wall_us = await _per_call(calls, hop)
            print(f"| {name} | {r + 1} | {cpu_us:.1f} | {wall_us:.1f} |")
    executor.shutdown()
    thread.shutdown()


@click.command()
@click.option("--calls", default=20_000, show_default=True)
@click.option("--rounds", default=2, show_default=True)
def main(calls: int, rounds: int) -> None:
    """What one hand-off to a slot's thread and back costs."""
    uvloop.run(_main(calls, rounds))


if __name__ == "__main__":
    main()
