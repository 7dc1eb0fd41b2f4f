"""Drivers for streams: open loop (Poisson arrivals at a rate, whatever the plane does) and
closed loop (N callers, each asking for its next stream when the previous one ends: the
capacity a rate is a multiple of).

Open loop, as `runner.run_load` for requests: stream i is scheduled at its arrival time and
sent then (or at once when the driver is behind), never later on purpose; at most
`concurrency` streams are in flight and an arrival beyond is counted as dropped. Arrivals are
a Poisson process (exponential gaps from a seeded random source): streams arrive in bursts as
users do, which is what a TTFT promise must hold against.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import msgspec

from plane.contract.errors import ConfigError
from plane.pulse.runner import Live, LoadConfig, open_loop, poisson_offsets_s
from plane.pulse.stream_outcome import StreamOutcome
from plane.pulse.stream_target import StreamTarget


@dataclass
class StreamRun:
    outcomes: list[StreamOutcome] = field(default_factory=list)
    dropped: int = 0
    elapsed_s: float = 0.0  # from the start to the last stream's end
    after_final: int = 0  # messages after a stream's final message (the contract: none)


async def run_streams(target: StreamTarget, body: bytes, config: LoadConfig, *,
                      seed: int | None = None) -> StreamRun:
    """Drive `target` open loop: Poisson arrivals at `config.rate` for `config.duration_s`."""
    offsets = poisson_offsets_s(config.rate, config.duration_s, random.Random(seed))
    live = Live(scheduled=len(offsets))
    run = StreamRun()
    start = time.monotonic()
    after_final_before = target.after_final

    async def one(offset_s: float) -> None:
        final = ""
        try:
            o = await target.stream(body, t0=start, scheduled_s=offset_s)
            run.outcomes.append(o)
            final = o.final
        finally:
            live.ended(final)

    await open_loop(offsets, start, live, config, one)
    run.dropped = live.dropped
    run.elapsed_s = time.monotonic() - start
    run.after_final = target.after_final - after_final_before
    return run


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """Closed loop: `callers` streams at a time, each started when the previous ended."""

    callers: int
    seconds: float  # from the start to the last stream's end
    streams: int  # ended 200
    tokens: int  # delivered by those
    refused: int  # attempts refused (a caller's next stream can beat the slot's done-event)
    other: int  # streams that ended otherwise (504, 503, timeout, ...)

    @property
    def streams_per_s(self) -> float:
        return self.streams / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


async def closed_loop(target: StreamTarget, body: bytes, *, callers: int, seconds: float,
                      keep: list[StreamOutcome] | None = None) -> Capacity:
    """`callers` callers for `seconds` (each finishes the stream it is in): the capacity.
    With callers = the slots, every slot is kept busy without a queue anywhere; with one,
    each stream runs alone (its TPOT is the plane's unloaded per-token time). Every outcome
    is appended to `keep` too when given."""
    if callers < 1 or seconds <= 0:
        raise ConfigError("closed loop needs at least one caller and a positive duration")
    start = time.monotonic()
    end = start + seconds
    outcomes: list[StreamOutcome] = []

    async def caller() -> None:
        while time.monotonic() < end:
            outcomes.append(await target.stream(body, t0=start,
                                                scheduled_s=time.monotonic() - start))

    async with asyncio.TaskGroup() as tg:
        for _ in range(callers):
            tg.create_task(caller())
    if keep is not None:
        keep.extend(outcomes)
    ok = [o for o in outcomes if o.final == "200"]
    return Capacity(callers=callers, seconds=time.monotonic() - start, streams=len(ok),
                    tokens=sum(o.tokens for o in ok),
                    refused=sum(o.statuses.count(429) for o in outcomes),
                    other=len(outcomes) - len(ok))
