"""What a call costs its caller: the SDK's `Client.call` against nats-py's bare `request`.

    .venv/bin/python benchmarks/sdk_call.py [--calls 6000] [--concurrency 1,50] [--rounds 3]
                                            [--json]

Every Python caller of the plane pays this per try: the gateway per HTTP request, `plane
pulse` per attempt (on a 2-core host the load generator's CPU is the plane's loss). The
callee is a responder in its own process that answers every request as a router refuses one
(a 429 with the plane's headers and a JSON body), so that the caller reads a reply as large
as the plane's; the caller is this process, `--concurrency` calls in flight at once (1: a
closed loop, every reply a wake-up; 50: replies read in batches, as a busy gateway reads
them). Per row, `time.process_time` (the kernel's exact CPU of this process) over `--calls`
calls, the two paths interleaved in rounds (the host's speed moves within minutes). Prints
the median of the rounds, µs of the caller's CPU per call, and calls a second.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import click
import nats
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plane.client import Client
from plane.contract.backoff import NO_RETRY
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header, Names

MODEL = "calibrated"
BODY = b'{"duration_us": 0}'
# The responder: a router's refusal, as large as one (its headers and its JSON body).
RESPONDER = r"""
import asyncio, sys, nats
async def main(url, subject):
    nc = await nats.connect(url)
    headers = {"Plane-Status": "429", "Plane-Reason": "busy", "Retry-After-Ms": "3",
               "Plane-Server-Time": "1764000000000", "Plane-Ticket": "r1.abcdefgh.12345"}
    async def refuse(msg):
        await nc.publish(msg.reply, b'{"error":"every slot is busy","reason":"busy"}',
                         headers={**headers, "Plane-Request-Id": msg.headers["Plane-Request-Id"]})
    await nc.subscribe(subject, cb=refuse)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def timed(one: Callable[[], Awaitable[object]], calls: int, concurrency: int
                ) -> tuple[float, float]:
    """(caller CPU µs per call, calls a second) of `calls` calls, `concurrency` at once."""
    async def worker(n: int) -> None:
        for _ in range(n):
            await one()

    await worker(100)  # warm: the reply subscription, the first allocations
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    done = calls // concurrency * concurrency
    return 1e6 * cpu / done, done / wall


async def measure(calls: int, concurrencies: list[int], rounds: int) -> list[dict[str, object]]:
    subject = Names().infer(MODEL)
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    async with EmbeddedNats() as srv:
        responder = subprocess.Popen([sys.executable, "-c", RESPONDER, srv.url, subject],
                                     stdout=subprocess.PIPE, text=True)
        try:
            assert responder.stdout is not None
            if "ready" not in responder.stdout.readline():
                raise RuntimeError("the responder did not start")
            nc = await nats.connect(srv.url, name="bench-sdk-bare")
            async with Client.connect(ConnectOptions(url=srv.url, name="bench-sdk")) as plane:
                async def bare() -> object:
                    return await nc.request(subject, BODY, timeout=5, headers={
                        Header.REQUEST_ID: "bench", Header.ATTEMPT: "1"})

                async def sdk() -> object:
                    return await plane.call(MODEL, BODY, policy=NO_RETRY)

                for _ in range(rounds):
                    for conc in concurrencies:
                        for name, one in (("nats-py request", bare), ("Client.call", sdk)):
                            samples.setdefault((name, conc), []).append(
                                await timed(one, calls, conc))
            await nc.close()
        finally:
            responder.terminate()
            responder.wait(timeout=10)
    return [{"path": name, "concurrency": conc,
             "cpu_us_per_call": statistics.median(s[0] for s in runs),
             "calls_per_s": statistics.median(s[1] for s in runs),
             "rounds_cpu_us": [round(s[0], 1) for s in runs]}
            for (name, conc), runs in samples.items()]


@click.command()
@click.option("--calls", type=int, default=6000, show_default=True, help="per row and round")
@click.option("--concurrency", default="1,50", show_default=True, help="calls in flight")
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON")
def main(calls: int, concurrency: str, rounds: int, as_json: bool) -> None:
    uvloop.install()
    rows = asyncio.run(measure(calls, [int(c) for c in concurrency.split(",")], rounds))
    if as_json:
        print(json.dumps(rows))
        return
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; {calls} calls "
          f"per row and round, {rounds} rounds (median; each round's CPU in brackets)\n")
    print("| path | in flight | caller CPU µs per call | calls/s |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['path']} | {r['concurrency']} | {r['cpu_us_per_call']:.1f} "
              f"{r['rounds_cpu_us']} | {r['calls_per_s']:.0f} |")


if __name__ == "__main__":
    main()
