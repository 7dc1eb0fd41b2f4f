"""CPU per publish: nats-py's flusher task against `plane.contract.soon_flush`, one publish a turn.

    .venv/bin/python benchmarks/soon_flush.py [--publishes 5000] [--rounds 5]

Two connections to one nats-server (started here, on loopback): one as nats-py makes it, one
with `use_soon_flush`. Each publishes a small message with a header (`plane.contract.publish`,
the hot path's publish) once per turn of the loop, as a router placing one request at a time
does, and the CPU of this process (`time.process_time`) per publish is printed for each,
interleaved round by round (the host's speed moves; the rounds show by how much). The socket
write itself is in both figures.
"""

from __future__ import annotations

import asyncio
import time

import click
import nats
import uvloop
from nats.aio.client import Client

from plane.contract.embedded import EmbeddedNats
from plane.contract.publish import publish
from plane.contract.soon_flush import use_soon_flush

HEADERS = {"Plane-Request-Id": "r-1", "Plane-Deadline-Ms": "250"}


async def cpu_per_publish_us(nc: Client, publishes: int) -> float:
    t0 = time.process_time()
    for _ in range(publishes):
        await publish(nc, "bench.soon", b"hello", HEADERS)
        await asyncio.sleep(0)  # the turn ends: the buffer is written
        await asyncio.sleep(0)
    return (time.process_time() - t0) * 1e6 / publishes


async def run(publishes: int, rounds: int) -> None:
    async with EmbeddedNats() as srv:
        theirs = await nats.connect(srv.url)
        ours = await nats.connect(srv.url)
        use_soon_flush(ours)
        try:
            print("| round | nats-py's flusher, µs per publish | soon_flush, µs per publish |")
            print("| --- | --- | --- |")
            for r in range(1, rounds + 1):
                a = await cpu_per_publish_us(theirs, publishes)
                b = await cpu_per_publish_us(ours, publishes)
                print(f"| {r} | {a:.1f} | {b:.1f} |")
        finally:
            await theirs.close()
            await ours.close()


@click.command()
@click.option("--publishes", type=int, default=5000, show_default=True)
@click.option("--rounds", type=int, default=5, show_default=True)
def main(publishes: int, rounds: int) -> None:
    uvloop.run(run(publishes, rounds))


if __name__ == "__main__":
    main()
