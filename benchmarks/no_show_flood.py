"""Callers who never come back for their tickets must not leave slots idle.

    .venv/bin/python benchmarks/no_show_flood.py [--slots 2] [--work-us 200000]
                                                 [--duration 4] [--gap-ms 5] [--json]

One run: an embedded nats-server, `plane up --models calibrated --slots N` as its own
process, two honest SDK callers (closed loop: each retry after Retry-After with its ticket)
and one flooder: a raw NATS caller that sends its next request --gap-ms after each answer,
never with the ticket it was given (a client that ignores Retry-After). Every 50 ms the node's
own status says how many of its slots run a request.

Before the forty-seventh session the flooder's promises filled the book (8 a slot): each slot
idled through the chain's due times, nobody's promise kept, every caller refused
`overloaded`, for the whole chain (2 x 200 ms: 1.6 s and more). Now no-shows are counted
when their promises lapse and, once they are most tickets, the promises still pinned let
their slots go.

Prints the share of samples with a slot idle (after the first work's length: the first
requests are running then), the 200s of each kind of caller, and the router's redemption
average at the end. `--json`: one object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the plane's own modules (run as a script from any directory)
sys.path.insert(0, str(ROOT / "benchmarks"))

import nats  # noqa: E402
from burst_line import plane_up  # noqa: E402

from plane.client import Client  # noqa: E402
from plane.contract.backoff import RetryPolicy  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.lifecycle import run  # noqa: E402
from plane.contract.subjects import Header, Names  # noqa: E402
from plane.observe.planeview import collect  # noqa: E402

NODE = "node0-calibrated"  # `plane up`'s node for the model
DEADLINE_MS = 2000
SAMPLE_S = 0.05


async def honest(url: str, body: dict[str, int], until_s: float) -> int:
    """A closed-loop SDK caller (tickets, Retry-After, calls back): its 200s."""
    ok = 0
    async with Client.connect(url) as c:
        while time.monotonic() < until_s:
            r = await c.call("calibrated", body, deadline_ms=DEADLINE_MS, policy=RetryPolicy())
            ok += r.status == 200
    return ok


async def flooder(url: str, body: bytes, until_s: float, gap_s: float) -> tuple[int, int]:
    """A raw caller that never brings its ticket back: (200s, requests)."""
    nc = await nats.connect(url)
    ok = sent = 0
    try:
        while time.monotonic() < until_s:
            sent += 1
            m = await nc.request(Names().infer("calibrated"), body, timeout=5,
                                 headers={Header.DEADLINE_MS: str(DEADLINE_MS)})
            ok += (m.headers or {}).get(Header.STATUS, "200") == "200"
            await asyncio.sleep(gap_s)
    finally:
        await nc.close()
    return ok, sent


async def busy_slots(url: str, until_s: float) -> list[tuple[float, int]]:
    """(seconds in, slots running a request) every SAMPLE_S, from the node's own status."""
    nc = await nats.connect(url)
    t0, out = time.monotonic(), []
    try:
        while time.monotonic() < until_s:
            m = await nc.request(Names().node_status(NODE), b"", timeout=1)
            out.append((time.monotonic() - t0, sum(map(bool, json.loads(m.data)["busy"]))))
            await asyncio.sleep(SAMPLE_S)
    finally:
        await nc.close()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--work-us", type=int, default=200_000)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    body = {"duration_us": args.work_us}
    async with EmbeddedNats() as srv, plane_up(srv.url, args.slots):
        until_s = time.monotonic() + args.duration
        honest_tasks = [asyncio.ensure_future(honest(srv.url, body, until_s))
                        for _ in range(2)]
        samples_task = asyncio.ensure_future(busy_slots(srv.url, until_s))
        flood_ok, flood_sent = await flooder(srv.url, json.dumps(body).encode(), until_s,
                                             args.gap_ms / 1000)
        honest_ok = [await t for t in honest_tasks]
        samples = await samples_task
        async with Client.connect(srv.url) as c:
            view = await collect(c.nc, Names(), timeout_s=2.0)
    counted = [busy for at_s, busy in samples if at_s >= args.work_us / 1e6]
    idle = sum(1 for busy in counted if busy < args.slots) / max(1, len(counted))
    out: dict[str, Any] = {
        "slots": args.slots, "work_us": args.work_us, "duration_s": args.duration,
        "samples_with_a_slot_idle": round(idle, 4),
        "busy_by_sample": [busy for _, busy in samples],
        "honest_200s": honest_ok, "flooder_200s": flood_ok, "flooder_requests": flood_sent,
        "redemption": {r.router: r.redemption for r in view.routers},
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.slots} slots x {args.work_us} us, {args.duration:.0f} s: two honest callers "
          f"and a flooder every {args.gap_ms:g} ms that never brings its tickets back")
    print(f"samples with a slot idle: {100 * idle:.0f}% (busy slots every {SAMPLE_S * 1000:.0f}"
          f" ms: {''.join(str(b) for _, b in samples)})")
    print(f"200s: honest {honest_ok}, flooder {flood_ok} of {flood_sent}; capacity "
          f"~{args.slots * args.duration / (args.work_us / 1e6):.0f}; redemption at the end "
          f"{out['redemption']}")


if __name__ == "__main__":
    run(main())
