"""Where ticket holders wait: every admission decision of a run, and the long parks explained.

    .venv/bin/python benchmarks/admission_trace.py [--model calibrated] [--slots 2]
        [--work-us 20000] [--deadline-ms 1000] [--factor 2.0] [--seconds 15] [--show 6]

A whole plane in this process (`PlaneStack`: router and node share its loop, so tails are
wider than with `plane up`), its capacity measured closed loop (one caller per slot), then
Poisson arrivals at `--factor` times it for `--seconds`, the SDK's retries on (Retry-After,
tickets). Every call of the router's `Admission.decide` is recorded (a wrapper put on the
class for this run only: nothing in the plane changes): the ticket, how late its holder came
back, the slots' predicted free times and the first open promises. Then it prints the holders'
decisions by kind and, for the `--show` longest parks, the decisions that led to each: how
late the holders before it started, and why the slot was busy when it came.

For `--model tinylm` the load is streams (TTFT budget `--deadline-ms`); otherwise requests of
`calibrated` with `duration_us` `--work-us`. BENCHMARKS.md, tenth session, reads one run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from plane.contract import logs
from plane.contract.backoff import RetryPolicy
from plane.contract.config import ConnectOptions
from plane.contract.quantiles import quantile
from plane.pulse.bodies import default_body
from plane.pulse.runner import LoadConfig, run_load
from plane.pulse.stream_runner import closed_loop, run_streams
from plane.pulse.stream_target import StreamSpec, StreamTarget
from plane.pulse.targets import NatsTarget
from plane.router.admission import Admission, Ask
from plane.router.occupancy import ModelSlots
from plane.stack import PlaneStack, StackConfig


@dataclass
class Decision:
    at_s: float
    ticket: str | None
    parked_before: bool  # a parked holder deciding again
    late_ms: float | None  # now - its promise's due time (holders of this router's promises)
    free_in_ms: list[float]  # each slot's predicted free time, from now
    promises: list[tuple[str, float, bool]]  # (ticket tail, due in ms, parked), first four
    kind: str = ""


@dataclass
class Recorder:
    decisions: list[Decision] = field(default_factory=list)

    def wrap(self) -> Any:
        """Put a recording wrapper on `Admission.decide`; returns what undoes it."""
        original = Admission.decide
        rec = self

        def decide(adm: Admission, ms: ModelSlots, ask: Ask, **kw: Any) -> Any:
            now = ask.now_s
            mine = adm.tickets.get(ask.ticket) if ask.ticket else None
            d = Decision(
                at_s=now, ticket=ask.ticket, parked_before=ask.park_until_s is not None,
                late_ms=(now - mine.due_s) * 1000 if mine is not None else None,
                free_in_ms=[(max(now, v.expected_free_s) - now) * 1000 if v.busy else 0.0
                            for v in ms.slots.values()],
                promises=[(p.ticket[-4:], (p.due_s - now) * 1000, p.parked)
                          for p in list(ms.promises)[:4]])
            out = original(adm, ms, ask, **kw)
            d.kind = type(out).__name__
            rec.decisions.append(d)
            return out

        Admission.decide = decide  # type: ignore[method-assign,assignment]
        return lambda: setattr(Admission, "decide", original)


def _line(d: Decision, t0: float) -> str:
    late = f"{d.late_ms:+.1f} ms" if d.late_ms is not None else "-"
    free = ", ".join(f"{x:.1f}" for x in d.free_in_ms)
    promises = ", ".join(f"{t} due {due:+.1f}{' parked' if parked else ''}"
                         for t, due, parked in d.promises)
    return (f"  {(d.at_s - t0) * 1000:+8.1f} ms  {d.kind:<6} ticket {(d.ticket or '-')[-4:]:>4}"
            f"  late {late:>9}  slots free in [{free}] ms  promises: {promises}")


def report(decisions: list[Decision], show: int) -> None:
    holders = [d for d in decisions if d.ticket]
    print("holders' decisions:", dict(Counter(d.kind for d in holders)))
    lates = [d.late_ms for d in holders if d.late_ms is not None and not d.parked_before]
    if lates:
        print(f"holders' lateness: p50 {quantile(lates, 0.5):+.1f} ms, "
              f"p90 {quantile(lates, 0.9):+.1f} ms, p99 {quantile(lates, 0.99):+.1f} ms")
    parks = []
    for i, d in enumerate(decisions):
        if d.kind == "Park" and not d.parked_before:
            nxt = next((q for q in decisions[i + 1:] if q.ticket == d.ticket), None)
            if nxt is not None:
                parks.append(((nxt.at_s - d.at_s) * 1000, i, nxt.kind))
    waits = sorted(w for w, _, _ in parks)
    if not waits:
        print("no holder parked")
        return
    print(f"parks: {len(waits)}, wait p50 {quantile(waits, 0.5):.1f} ms, "
          f"p90 {quantile(waits, 0.9):.1f} ms, max {waits[-1]:.1f} ms")
    for wait, i, then in sorted(parks, reverse=True)[:show]:
        d = decisions[i]
        print(f"\npark of {wait:.1f} ms (then {then}); the decisions up to it:")
        for q in decisions[max(0, i - 4):i + 1]:
            print(_line(q, d.at_s))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="calibrated", choices=("calibrated", "tinylm"))
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--work-us", type=int, default=20_000)
    ap.add_argument("--deadline-ms", type=int, default=1000)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--show", type=int, default=6)
    args = ap.parse_args()
    logs.configure("warning")
    rec = Recorder()
    undo = rec.wrap()
    try:
        async with PlaneStack(StackConfig(models=(args.model,), slots=args.slots)) as stack:
            opts = ConnectOptions(url=stack.url, name="admission-trace")
            if args.model == "tinylm":
                body = default_body("tinylm")
                spec = StreamSpec(deadline_ms=args.deadline_ms, policy=RetryPolicy())
                async with StreamTarget(opts, spec) as st:
                    cap = (await closed_loop(st, body, callers=args.slots,
                                             seconds=5)).streams_per_s
                    rec.decisions.clear()
                    await run_streams(st, body, LoadConfig(rate=args.factor * cap,
                                                           duration_s=args.seconds))
            else:
                body = default_body("calibrated", duration_us=args.work_us)
                target = NatsTarget(opts, model="calibrated", deadline_ms=args.deadline_ms,
                                    policy=RetryPolicy())
                async with target:
                    for _ in range(10):  # the slots' first calls are slow (warm-up)
                        await target.send(body)
                    t0, done = time.monotonic(), 0
                    end = t0 + 5

                    async def caller() -> None:
                        nonlocal done
                        while time.monotonic() < end:
                            done += (await target.send(body)).final == "200"

                    await asyncio.gather(*(caller() for _ in range(args.slots)))
                    cap = done / (time.monotonic() - t0)
                    rec.decisions.clear()
                    await run_load(target, body, LoadConfig(rate=args.factor * cap,
                                                            duration_s=args.seconds))
    finally:
        undo()
    print(f"{args.model} on {args.slots} slots, capacity {cap:.1f}/s closed loop, "
          f"{args.factor}x for {args.seconds:g} s, deadline {args.deadline_ms} ms")
    report(rec.decisions, args.show)


if __name__ == "__main__":
    asyncio.run(main())
