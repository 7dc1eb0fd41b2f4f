"""What nats-py's per-subscription queue and task cost a responder, against handling each
message as it is read (`plane.contract.inline`).

    .venv/bin/python benchmarks/inline_dispatch.py [--requests 10000] [--rounds 3]

What runs: an embedded nats-server and two echo responders, each its own process on uvloop
(as the plane runs): one subscribed with a nats-py callback (`nc.subscribe(cb=...)`: a queue
and a task per subscription), one through `Inline` (the same coroutine, run as the message
is read). This process calls each in turn, closed loop with one caller and then with four,
`--requests` per load, `--rounds` times, and asks each responder for its own CPU time
(`time.process_time`) before and after. Prints CPU µs per request and the p50 at the
caller.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import click
import nats
import uvloop
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plane.contract.embedded import EmbeddedNats
from plane.contract.inline import Inline

MODES = ("nats-py", "inline")


async def _serve(url: str, mode: str) -> None:
    nc = await nats.connect(url)

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    async def cpu(msg: Msg) -> None:
        await msg.respond(b"%.6f" % time.process_time())

    if mode == "inline":
        await Inline.of(nc).subscribe(f"bench.{mode}", echo)
    else:
        await nc.subscribe(f"bench.{mode}", cb=echo)
    await nc.subscribe(f"bench.{mode}.cpu", cb=cpu)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _load(url: str, mode: str, requests: int, callers: int) -> tuple[float, float]:
    """CPU µs per request of the responder, and the p50 ms at the caller."""
    nc = await nats.connect(url)
    took: list[float] = []

    async def caller() -> None:
        for _ in range(requests // callers):
            t0 = time.perf_counter()
            await nc.request(f"bench.{mode}", b"x" * 64, timeout=5)
            took.append(time.perf_counter() - t0)

    cpu0 = float((await nc.request(f"bench.{mode}.cpu", b"", timeout=5)).data)
    await asyncio.gather(*(caller() for _ in range(callers)))
    cpu1 = float((await nc.request(f"bench.{mode}.cpu", b"", timeout=5)).data)
    await nc.close()
    took.sort()
    return (cpu1 - cpu0) / len(took) * 1e6, took[len(took) // 2] * 1e3


async def _main(requests: int, rounds: int) -> None:
    async with EmbeddedNats() as srv:
        procs = [subprocess.Popen([sys.executable, __file__, "--serve", mode, "--url", srv.url],
                                  stdout=subprocess.PIPE) for mode in MODES]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            print(f"{requests} requests per load, echo of 64 B, uvloop, "
                  f"Python {sys.version.split()[0]}")
            print("| responder | round | callers | CPU µs per request | p50 ms |\n"
                  "| --- | --- | --- | --- | --- |")
            for r in range(rounds):
                for mode in MODES:
                    for callers in (1, 4):
                        us, p50 = await _load(srv.url, mode, requests, callers)
                        print(f"| {mode} | {r + 1} | {callers} | {us:.1f} | {p50:.3f} |",
                              flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()


@click.command()
@click.option("--requests", default=10_000, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--serve", type=click.Choice(MODES), default=None, hidden=True)
@click.option("--url", default="", hidden=True)
def main(requests: int, rounds: int, serve: str | None, url: str) -> None:
    """nats-py's subscription queue and task against `Inline`, for an echo responder."""
    if serve is not None:
        uvloop.run(_serve(url, serve))
    else:
        uvloop.run(_main(requests, rounds))


if __name__ == "__main__":
    main()
