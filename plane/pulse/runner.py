"""The open-loop driver: a constant arrival rate, whatever the target does.

Request i is *scheduled* at `i / rate` seconds after the start (`arrivals="poisson"`: at the
times of a Poisson process of that rate, as independent callers arrive: in bursts and
lulls) and sent then (or at once, if the driver is behind: never later on purpose). Its
latency runs from the scheduled time, so a slow target cannot slow the arrivals and hide its
own queue (no coordinated omission). At most `concurrency` requests are in flight: an
arrival beyond that is counted as dropped, not delayed. Every request is a task of one
TaskGroup; the run ends when the last one answers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from plane.contract.errors import ConfigError
from plane.pulse.outcome import Outcome
from plane.pulse.progress import ProgressBar
from plane.pulse.targets import Target


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    rate: float  # arrivals per second
    duration_s: float
    concurrency: int = 512  # at most this many in flight; arrivals beyond are dropped
    progress: bool = False  # a rich progress bar on stderr
    arrivals: Literal["even", "poisson"] = "even"
    seed: int | None = None  # of the Poisson arrivals (None: random)

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1_000_000:
            raise ConfigError("--rate must be in (0, 1e6] requests per second")
        if not 0 < self.duration_s <= 86_400:
            raise ConfigError("--duration must be in (0, 86400] seconds")
        if not 1 <= self.concurrency <= 100_000:
            raise ConfigError("--concurrency must be in [1, 100000]")
        if self.rate * self.duration_s < 1:
            raise ConfigError("--rate x --duration must schedule at least one request")
        if self.arrivals not in ("even", "poisson"):
            raise ConfigError("--arrivals must be even or poisson")

    def offsets_s(self) -> list[float]:
        """The scheduled send times, seconds from the start."""
        if self.arrivals == "poisson":
            return poisson_offsets_s(self.rate, self.duration_s, random.Random(self.seed))
        return arrival_offsets_s(self.rate, self.duration_s)


def arrival_offsets_s(rate: float, duration_s: float) -> list[float]:
    """Scheduled send times, seconds from the start: evenly spaced at `rate`."""
    return [i / rate for i in range(int(rate * duration_s))]


def poisson_offsets_s(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s), seconds from the start: exponential gaps of mean
    1 / rate."""
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class Live:
    """Counters the progress bar reads while the run goes on."""

    scheduled: int
    launched: int = 0
    done: int = 0
    ok: int = 0
    refused: int = 0
    dropped: int = 0
    in_flight: int = 0

    def ended(self, final: str) -> None:
        """One launched request (or stream) is over, with its final status."""
        self.ok += final == "200"
        self.refused += final == "429"
        self.in_flight -= 1
        self.done += 1


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    dropped: int = 0
    elapsed_s: float = 0.0


async def run_load(target: Target, body: bytes, config: LoadConfig) -> Run:
    """Drive `target` open loop with `body` as `config` says; return every outcome."""
    offsets = config.offsets_s()
    live = Live(scheduled=len(offsets))
    run = Run()
    start = time.monotonic()

    async def one(offset_s: float) -> None:
        final = ""
        try:
            attempts = await target.send(body)
            latency_us = int((time.monotonic() - start - offset_s) * 1e6)
            run.outcomes.append(Outcome(scheduled_s=offset_s, latency_us=latency_us,
                                        attempts=attempts))
            final = attempts.final
        finally:
            live.ended(final)

    await open_loop(offsets, start, live, config, one)
    run.dropped = live.dropped
    run.elapsed_s = time.monotonic() - start
    return run


async def open_loop(offsets: list[float], start: float, live: Live, config: LoadConfig,
                    one: Callable[[float], Coroutine[Any, Any, None]]) -> None:
    """Launch `one(offset)` at each scheduled offset (seconds after `start`), never more than
    `config.concurrency` at once (one past it is dropped and counted), with the progress bar;
    return when every launched one has ended. `one` must count itself done in `live`."""
    finished = asyncio.Event()
    async with asyncio.TaskGroup() as outer:
        outer.create_task(_show(live, finished, config.progress))
        try:
            async with asyncio.TaskGroup() as launched:
                for offset_s in offsets:
                    wait_s = start + offset_s - time.monotonic()
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)
                    if live.in_flight >= config.concurrency:
                        live.dropped += 1
                        continue
                    live.in_flight += 1
                    live.launched += 1
                    launched.create_task(one(offset_s))
        finally:
            finished.set()


async def _show(live: Live, finished: asyncio.Event, enabled: bool) -> None:
    if not enabled:
        return
    with ProgressBar(total=live.scheduled) as bar:
        while not finished.is_set():
            bar.update(live)
            try:
                async with asyncio.timeout(0.2):
                    await finished.wait()
            except TimeoutError:
                pass
        bar.update(live)
