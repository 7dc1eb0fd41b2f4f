"""One call that runs a load and summarises it: what the CLI, the tests and the benchmarks
use (they differ only in the target they pass)."""

from __future__ import annotations

from dataclasses import dataclass

from plane.pulse.runner import LoadConfig, Run, run_load
from plane.pulse.summary import Summary, summarize
from plane.pulse.targets import Target


@dataclass(frozen=True)
class Report:
    run: Run
    summary: Summary


async def pulse(target: Target, body: bytes, load: LoadConfig, *,
                deadline_ms: int | None) -> Report:
    """Open the target, drive it open loop, close it, summarise."""
    async with target:
        run = await run_load(target, body, load)
    summary = summarize(
        run.outcomes, target=target.name, rate=load.rate, duration_s=load.duration_s,
        concurrency=load.concurrency, deadline_ms=deadline_ms, dropped=run.dropped,
        arrivals=load.arrivals,
    )
    return Report(run=run, summary=summary)
