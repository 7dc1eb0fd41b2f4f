"""What a publish with headers costs: nats-py's `publish(headers=...)` against
`plane.contract.publish.publish`, with the headers of a slot message.

    .venv/bin/python benchmarks/publish_headers.py [--messages 50000] [--rounds 2]

What runs: an embedded nats-server; on uvloop (as the plane runs), `--messages` publishes of a
17-byte body with the 8 headers a router puts on a slot message, through each path in turn,
`--rounds` times, yielding to the loop every 100 (the flusher writes meanwhile). Prints the
CPU µs per publish (process time, the flusher's writes included).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import click
import nats
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plane.contract.embedded import EmbeddedNats
from plane.contract.publish import publish

HEADERS = {
    "Plane-Reply-To": "_INBOX.4CXDPkS4rtQlr9h57auJqo.12345",
    "Plane-Request-Id": "01JDXYZABCDEFGHJKMNPQRSTVW",
    "Plane-Deadline-At": "1764612345678",
    "Plane-Deadline-Ms": "1000",
    "Plane-Work-Us": "0",
    "Plane-Router": "router-1",
    "Plane-Attempt": "1",
    "Nats-TTL": "11s",
}
BODY = b'{"duration_us":0}'


async def _per_publish(messages: int, send: Callable[[], Awaitable[None]]) -> float:
    cpu0 = time.process_time()
    for i in range(messages):
        await send()
        if i % 100 == 0:
            await asyncio.sleep(0)
    return (time.process_time() - cpu0) / messages * 1e6


async def _main(messages: int, rounds: int) -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url)
        paths: dict[str, Callable[[], Awaitable[None]]] = {
            "nats-py publish(headers=...)":
                lambda: nc.publish("bench.slot", BODY, reply="_INBOX.x.1", headers=HEADERS),
            "plane.contract.publish":
                lambda: publish(nc, "bench.slot", BODY, HEADERS, reply="_INBOX.x.1"),
        }
        print(f"{messages} publishes per path and round, {len(HEADERS)} headers, uvloop, "
              f"Python {sys.version.split()[0]}")
        print("| path | round | CPU µs per publish |\n| --- | --- | --- |")
        for r in range(rounds):
            for name, send in paths.items():
                us = await _per_publish(messages, send)
                await nc.flush()
                print(f"| {name} | {r + 1} | {us:.1f} |")
        await nc.close()


@click.command()
@click.option("--messages", default=50_000, show_default=True)
@click.option("--rounds", default=2, show_default=True)
def main(messages: int, rounds: int) -> None:
    """What a publish with headers costs."""
    uvloop.run(_main(messages, rounds))


if __name__ == "__main__":
    main()
