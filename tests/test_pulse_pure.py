"""Pure parts of pulse: the plateau detector on seeded synthetic latency sets, the verdict,
the summary's figures, the schedule and the default bodies."""

from __future__ import annotations

import json
import random

import pytest

from plane.errors import ConfigError
from plane.pulse import (
    Attempts,
    LoadConfig,
    Outcome,
    arrival_offsets_s,
    default_body,
    detect_plateau,
    summarize,
    verdict,
)
from plane.pulse.summary import ABSENT, INCONCLUSIVE, PRESENT

N = 5000


# -- synthetic latency sets (ms) ------------------------------------------------------------
def healthy_tight(rng: random.Random) -> list[float]:
    """A slot: the service time plus a little jitter (the plane's accepted answers)."""
    return [20 + abs(rng.gauss(0, 0.6)) for _ in range(N)]


def healthy_exponential(rng: random.Random) -> list[float]:
    return [rng.expovariate(1 / 2.0) for _ in range(N)]


def healthy_lognormal(rng: random.Random) -> list[float]:
    return [rng.lognormvariate(0, 0.5) for _ in range(N)]


def healthy_pareto(rng: random.Random) -> list[float]:
    return [rng.paretovariate(1.5) for _ in range(N)]


def healthy_with_outliers(rng: random.Random) -> list[float]:
    """GC pauses: a handful of far outliers are not a plateau."""
    xs = healthy_tight(rng)
    for i in rng.sample(range(N), 20):
        xs[i] = rng.uniform(100, 800)
    return xs


def growing_queue(rng: random.Random) -> list[float]:
    """Unbounded queue past capacity: waits grow linearly with time (a flat shelf)."""
    return [10 + 2000 * i / N + rng.gauss(0, 1) for i in range(N)]


def capped_queue(rng: random.Random) -> list[float]:
    """A queue bounded by a concurrency cap: a short ramp, then everyone at the ceiling."""
    ramp = N // 20
    return [10 + 500 * i / ramp + abs(rng.gauss(0, 2)) if i < ramp else 510 + rng.gauss(0, 5)
            for i in range(N)]


def timeout_pileup(rng: random.Random) -> list[float]:
    """Most answers fast, 5% stuck until the client's timeout: a shelf at the timeout."""
    return [1000 + rng.uniform(0, 3) if rng.random() < 0.05 else 2 + rng.expovariate(1)
            for _ in range(N)]


@pytest.mark.parametrize("make", [healthy_tight, healthy_exponential, healthy_lognormal,
                                  healthy_pareto, healthy_with_outliers])
def test_no_plateau_in_healthy_tails(make: object, rng: random.Random) -> None:
    p = detect_plateau(make(rng))  # type: ignore[operator]
    assert not p.found, p


@pytest.mark.parametrize("make", [growing_queue, capped_queue, timeout_pileup])
def test_plateau_in_queues(make: object, rng: random.Random) -> None:
    p = detect_plateau(make(rng))  # type: ignore[operator]
    assert p.found, p
    assert p.level_ms is not None and p.level_ms > 3 * p.floor_ms


@pytest.mark.parametrize("seed", range(20))
def test_detector_is_stable_across_seeds(seed: int) -> None:
    rng = random.Random(seed)
    assert not detect_plateau(healthy_lognormal(rng)).found
    assert not detect_plateau(healthy_pareto(rng)).found
    assert detect_plateau(growing_queue(rng)).found
    assert detect_plateau(capped_queue(rng)).found


def test_too_few_samples_is_no_plateau() -> None:
    assert not detect_plateau([1.0] * 10 + [500.0] * 10).found


# -- verdict ---------------------------------------------------------------------------------
def test_verdict() -> None:
    assert verdict(1.2, False, 10, 1.0)[0] == ABSENT
    assert verdict(1.9, False, 10, 1.0)[0] == PRESENT
    assert verdict(1.2, True, 10, 1.0)[0] == PRESENT
    assert verdict(1.2, False, 10, 0.5)[0] == PRESENT
    assert verdict(1.2, False, 0, None)[0] == INCONCLUSIVE
    assert verdict(None, False, 10, 1.0)[0] == INCONCLUSIVE


# -- summary ---------------------------------------------------------------------------------
def _o(t: float, ms: float, statuses: tuple[int, ...], hinted: int = 0,
       last_ms: float | None = None) -> Outcome:
    final = "timeout" if statuses[-1] == 0 else str(statuses[-1])
    return Outcome(scheduled_s=t, latency_us=int(ms * 1000),
                   attempts=Attempts(statuses=statuses, final=final, hinted=hinted,
                                     last_attempt_us=int((last_ms or ms) * 1000)))


def test_summary_counts_and_retry_figures() -> None:
    outs = [_o(i / 100, 10 + (i % 5) * 0.1, (200,)) for i in range(100)]
    outs += [_o(0.5, 1.0, (429,), hinted=1)]  # refused, not retried
    outs += [_o(0.6, 45.0, (429, 200), hinted=1, last_ms=10.2)]  # first retry ok
    outs += [_o(0.7, 80.0, (429, 429, 200), hinted=1, last_ms=10.1)]  # hint missing once
    outs += [_o(0.8, 1500.0, (0,))]  # a timeout counts at its time
    s = summarize(outs, target="t", rate=104, duration_s=1.0, concurrency=8, deadline_ms=1000,
                  dropped=3)
    assert s.sent == 107 and s.dropped == 3 and s.answered == 103
    assert s.status_counts == {"200": 102, "429": 1, "timeout": 1}
    assert s.retry_after_share == pytest.approx(3 / 4)
    assert s.first_retry_success == pytest.approx(1 / 2)  # of the two that retried
    assert s.mean_retries == pytest.approx((0 + 1 + 2) / 3)
    assert s.refusal_rate == pytest.approx(3 / 104)
    assert s.within_deadline_share == pytest.approx(102 / 107)
    assert s.p50_ms == pytest.approx(10.2, abs=0.05)
    assert s.max_ms == pytest.approx(1500, rel=0.01)
    assert s.e2e_p99_ms is not None and s.e2e_p99_ms >= 45
    assert s.verdict == PRESENT  # a 429 without Retry-After
    keys = {"p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "p99_over_p50", "sent",
            "answered", "dropped", "status_counts", "retry_after_share",
            "first_retry_success", "mean_retries", "plateau", "verdict"}
    from plane.pulse.report import to_json

    assert keys <= set(json.loads(to_json(s)))


def test_no_retries_means_no_retry_figures() -> None:
    outs = [_o(i / 100, 10.0, (200,)) for i in range(100)] + [_o(0.5, 1, (429,), hinted=1)]
    s = summarize(outs, target="t", rate=101, duration_s=1.0, concurrency=8, deadline_ms=100,
                  dropped=0)
    assert s.first_retry_success is None and s.mean_retries is None
    assert s.verdict == ABSENT


# -- schedule, config, bodies ------------------------------------------------------------------
def test_arrivals_are_evenly_spaced() -> None:
    xs = arrival_offsets_s(200, 2.5)
    assert len(xs) == 500 and xs[0] == 0 and xs[1] == pytest.approx(0.005)
    assert xs[-1] == pytest.approx(2.495)


@pytest.mark.parametrize("kw", [{"rate": 0}, {"duration_s": -1}, {"concurrency": 0},
                                {"rate": 0.1, "duration_s": 1}])
def test_load_config_is_validated(kw: dict[str, float]) -> None:
    args: dict[str, float] = {"rate": 10, "duration_s": 1, **kw}
    with pytest.raises(ConfigError):
        LoadConfig(**args)  # type: ignore[arg-type]


def test_default_bodies() -> None:
    assert len(json.loads(default_body("risk"))["features"]) == 32
    assert json.loads(default_body("calibrated", duration_us=250)) == {"duration_us": 250}
    with pytest.raises(ConfigError):
        default_body("nope")
