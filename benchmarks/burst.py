"""A burst: many requests sent at once to a plane, and how long each waits for its answer.

    .venv/bin/python benchmarks/burst.py [--requests 2000] [--rounds 3] [--slots 4]
                                         [--work-us 20000] [--deadline-ms 1000]
                                         [--routers 1] [--json]

A Kafka consumer that catches up after a pause, a batch job, a retry storm: thousands of
requests arrive within milliseconds. A plane with no request queue should refuse the excess
at once, but a router reads requests one after another, so the last of a burst waits for
every decision before its own, a queue that no metric of the plane's names. This measures
that wait.

What runs: a nats-server, `--routers` `plane router` processes (one queue group) and `plane
node --model calibrated --slots N --backend torch`, each its own process, on loopback. This
process sends each round's burst (one publish per request, `Plane-Deadline-Ms`, each
with its own reply subject under one inbox, then one flush) and reads every answer. Two
clocks per answer:
- at the caller: from the publish to the answer read here (this process reads the answers
  one by one, which adds to the tail);
- made: the answer's `Plane-Server-Time` (the wall clock of the router or node that made it,
  epoch ms) less the publish's wall clock (one host, so one clock; ms resolution).
Rounds are 2 s apart (promises made to the refused, who never come back, lapse meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.children import child, until  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.quantiles import quantile  # noqa: E402
from plane.contract.subjects import Header, Names  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "calibrated"
ROUND_GAP_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests per burst")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--work-us", type=int, default=20_000, help="calibrated work per request")
    p.add_argument("--deadline-ms", type=int, default=1000, help="Plane-Deadline-Ms")
    p.add_argument("--routers", type=int, default=1, help="router processes (a queue group)")
    p.add_argument("--json", action="store_true", help="one JSON object per round")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Waits:
    """One status's answers in one round: how many, and their waits (ms) by each clock."""

    count: int
    caller_p50_ms: float
    caller_max_ms: float
    made_p50_ms: float
    made_p90_ms: float
    made_max_ms: float


@dataclass(frozen=True)
class Round:
    round: int
    requests: int
    publish_ms: float  # how long this process took to publish the burst
    unanswered: int
    by_status: dict[str, Waits]


@contextlib.asynccontextmanager
async def plane(logs: Path, slots: int, routers: int) -> AsyncIterator[str]:
    async with EmbeddedNats() as srv, contextlib.AsyncExitStack() as stack:
        common = ["--nats", srv.url, "--log-level", "warning"]
        for i in range(routers):
            await stack.enter_async_context(child(
                [str(BIN / "plane"), "router", *common, "--router-id", f"burst{i}"],
                logs / f"router{i}.log"))
        await stack.enter_async_context(child(
            [str(BIN / "plane"), "node", *common, "--model", MODEL, "--slots", str(slots),
             "--backend", "torch", "--node-id", "burst"], logs / "node.log"))
        nc = await nats.connect(srv.url)
        try:
            body = json.dumps({"duration_us": 1000}).encode()

            async def ready() -> bool:
                with contextlib.suppress(Exception):
                    m = await nc.request(Names().infer(MODEL), body, timeout=1)
                    return (m.headers or {}).get(Header.STATUS, "200") == "200"
                return False

            await until("the plane", ready, 90, logs / "node.log")
        finally:
            await nc.close()
        yield srv.url


async def burst(nc: Client, n: int, body: bytes, index: int, deadline_ms: int) -> Round:
    subject = Names().infer(MODEL)
    inbox = nc.new_inbox()
    answers: dict[int, tuple[float, str, int]] = {}
    all_in = asyncio.get_running_loop().create_future()

    async def on_answer(msg: Msg) -> None:
        h = msg.headers or {}
        i = int(msg.subject.rsplit(".", 1)[1])
        answers[i] = (time.perf_counter(), h.get(Header.STATUS, "?"),
                      int(h.get(Header.SERVER_TIME, "0")))
        if len(answers) == n and not all_in.done():
            all_in.set_result(None)

    sub = await nc.subscribe(f"{inbox}.*", cb=on_answer)
    sent_s: list[float] = []
    sent_wall_ms: list[float] = []
    headers = {Header.DEADLINE_MS: str(deadline_ms)}
    for i in range(n):
        sent_s.append(time.perf_counter())
        sent_wall_ms.append(time.time() * 1000)
        await nc.publish(subject, body, reply=f"{inbox}.{i}", headers=headers)
    await nc.flush()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline_ms / 1000 + 10):
            await all_in
    await sub.unsubscribe()
    caller: dict[str, list[float]] = {}
    made: dict[str, list[float]] = {}
    for i, (at_s, status, server_ms) in answers.items():
        caller.setdefault(status, []).append((at_s - sent_s[i]) * 1000)
        if server_ms:
            made.setdefault(status, []).append(server_ms - sent_wall_ms[i])
    by_status = {}
    for status, waits in sorted(caller.items()):
        m = made.get(status) or [float("nan")]
        by_status[status] = Waits(
            count=len(waits), caller_p50_ms=quantile(waits, 0.5), caller_max_ms=max(waits),
            made_p50_ms=quantile(m, 0.5), made_p90_ms=quantile(m, 0.9), made_max_ms=max(m))
    return Round(round=index, requests=n, publish_ms=(sent_s[-1] - sent_s[0]) * 1000,
                 unanswered=n - len(answers), by_status=by_status)


def show(r: Round) -> str:
    parts = [f"round {r.round}: {r.requests} requests (published in {r.publish_ms:.0f} ms), "
             f"{r.unanswered} unanswered"]
    for status, w in r.by_status.items():
        parts.append(f"  {status}: {w.count:5d}  made after p50 {w.made_p50_ms:6.1f}  p90 "
                     f"{w.made_p90_ms:6.1f}  max {w.made_max_ms:6.1f} ms   at the caller p50 "
                     f"{w.caller_p50_ms:6.1f}  max {w.caller_max_ms:6.1f} ms")
    return "\n".join(parts)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    body = json.dumps({"duration_us": args.work_us}).encode()
    with tempfile.TemporaryDirectory(prefix="burst-") as tmp:
        async with plane(Path(tmp), args.slots, args.routers) as url:
            if not args.json:
                print(f"{args.routers} router(s), {args.slots} slots x {args.work_us} us "
                      f"({MODEL}), bursts of {args.requests}, deadline {args.deadline_ms} ms")
            nc = await nats.connect(url)
            try:
                for i in range(args.rounds):
                    r = await burst(nc, args.requests, body, i, args.deadline_ms)
                    print(json.dumps(asdict(r)) if args.json else show(r), flush=True)
                    await asyncio.sleep(ROUND_GAP_S)
            finally:
                await nc.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
