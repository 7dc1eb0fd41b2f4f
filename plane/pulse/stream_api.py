"""One call that loads the plane with streams and summarises it: what `plane pulse --stream`,
the tests and benchmarks/streams.py use.

    report = await pulse_streams(StreamTarget(opts, StreamSpec(policy=RetryPolicy())), body,
                                 LoadConfig(rate=5, duration_s=30), capacity_x=2.0, callers=2)
    print(report.summary.verdict)

With `capacity_x`, the capacity is measured first (closed loop, `callers` at a time, for
`capacity_s`) and the load's rate becomes `capacity_x` x its streams per second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plane.contract.errors import ConfigError
from plane.pulse.runner import LoadConfig
from plane.pulse.stream_runner import Capacity, StreamRun, closed_loop, run_streams
from plane.pulse.stream_summary import StreamSummary, summarize_streams
from plane.pulse.stream_target import StreamTarget

DEFAULT_CAPACITY_S = 10.0


@dataclass(frozen=True)
class StreamReport:
    run: StreamRun
    summary: StreamSummary
    capacity: Capacity | None = None


def at_capacity(load: LoadConfig, capacity: Capacity, factor: float) -> LoadConfig:
    """`load` with its rate set to `factor` x the measured streams per second."""
    if capacity.streams == 0:
        raise ConfigError("the closed loop finished no stream: is a node serving the model? "
                          "(nothing to take a multiple of)")
    return replace(load, rate=factor * capacity.streams_per_s)


async def pulse_streams(target: StreamTarget, body: bytes, load: LoadConfig, *,
                        seed: int | None = None, capacity_x: float | None = None,
                        callers: int = 1, capacity_s: float = DEFAULT_CAPACITY_S
                        ) -> StreamReport:
    """Open the target, (measure the capacity,) drive it open loop, close it, summarise."""
    capacity = None
    async with target:
        if capacity_x is not None:
            capacity = await closed_loop(target, body, callers=callers, seconds=capacity_s)
            load = at_capacity(load, capacity, capacity_x)
        run = await run_streams(target, body, load, seed=seed)
    spec = target.spec
    summary = summarize_streams(
        run.outcomes, target=target.name, rate=load.rate, duration_s=load.duration_s,
        elapsed_s=run.elapsed_s, deadline_ms=spec.deadline_ms,
        stream_deadline_ms=spec.stream_deadline_ms, dropped=run.dropped,
        after_final=run.after_final)
    return StreamReport(run=run, summary=summary, capacity=capacity)
