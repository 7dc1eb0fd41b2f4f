"""Pure parts of pulse: the plateau detector on seeded synthetic latency sets, the verdict,
the summary's figures, the schedule and the default bodies."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from click.testing import CliRunner

from plane.client.result import LocalCause, Result
from plane.contract.errors import ConfigError
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
from plane.pulse.cli import pulse
from plane.pulse.series import per_second, percentile_curve
from plane.pulse.summary import (
    ABSENT,
    BY_ERRORS,
    BY_GROWTH,
    BY_HINTS,
    BY_NO_ANSWERS,
    BY_NO_REFUSALS,
    BY_NO_SATURATION,
    BY_PLATEAU,
    BY_RATIO,
    BY_REFUSALS,
    INCONCLUSIVE,
    NOT_SATURATED,
    PRESENT,
    Signals,
)
from plane.pulse.targets import attempts_of

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
def _sig(ratio: float | None, plateau: bool = False, refusals: int = 0,
         hinted: float | None = None, first: float = 10.0, last: float = 10.0,
         dropped: int = 0, timeouts: int = 0, errors: int = 0) -> Signals:
    return Signals(p99_over_p50=ratio, plateau=plateau, refusals=refusals,
                   retry_after_share=hinted, first_third_p50_ms=first, last_third_p50_ms=last,
                   dropped=dropped, timeouts=timeouts, errors=errors, requests=1000)


def test_verdict() -> None:
    assert verdict(_sig(1.2, refusals=10, hinted=1.0))[::2] == (ABSENT, BY_REFUSALS)
    assert verdict(_sig(1.9, refusals=10, hinted=1.0))[::2] == (PRESENT, BY_RATIO)
    assert verdict(_sig(1.2, True, 10, 1.0))[::2] == (PRESENT, BY_PLATEAU)
    assert verdict(_sig(1.2, refusals=10, hinted=0.5))[::2] == (PRESENT, BY_HINTS)
    assert verdict(_sig(None, refusals=10, hinted=1.0))[::2] == (INCONCLUSIVE, BY_NO_ANSWERS)
    # Growth is both saturation and the mark of a queue, refusals or not.
    assert verdict(_sig(1.9, first=10, last=400))[::2] == (PRESENT, BY_GROWTH)
    # Saturated (drops, timeouts) without refusals or a queue's mark: how it sheds is unseen.
    assert verdict(_sig(1.2, dropped=5))[::2] == (INCONCLUSIVE, BY_NO_REFUSALS)
    assert verdict(_sig(1.2, timeouts=20))[::2] == (INCONCLUSIVE, BY_NO_REFUSALS)
    assert verdict(_sig(1.2, timeouts=2))[::2] == (NOT_SATURATED, BY_NO_SATURATION)  # 0.2%
    # The target broke under the run (a plane stopped: what it held timed out, the rest
    # failed to send): its growth is not a queue's.
    v, reasons, by = verdict(_sig(1.0, first=20, last=3000, timeouts=597, errors=21))
    assert (v, by) == (INCONCLUSIVE, BY_ERRORS) and "21 of 1000" in reasons[0]
    assert verdict(_sig(1.9, first=10, last=400, errors=9))[::2] == (PRESENT, BY_GROWTH)  # 0.9%
    v, reasons, by = verdict(_sig(None, errors=1000))  # nothing listening at all
    assert (v, by) == (INCONCLUSIVE, BY_ERRORS) and "none of the 1000" in reasons[0]


def test_no_queue_verdict_without_saturation() -> None:
    """Issue 12's run: 150 of 150 answered 200, no refusal, p99/p50 1.94 on a busy machine.
    No refusals and no growth: not saturated, never "queueing layer present"."""
    v, reasons, by = verdict(_sig(1.94, first=2.0, last=2.1))
    assert (v, by) == (NOT_SATURATED, BY_NO_SATURATION)
    assert "jitter" in reasons[-1] and "1.94" in reasons[-1]
    v, _, _ = verdict(_sig(1.94, plateau=True, first=2.0, last=2.1))
    assert v == NOT_SATURATED
    # Sub-millisecond wobble is not growth.
    assert verdict(_sig(1.5, first=0.2, last=0.5))[0] == NOT_SATURATED


def test_summary_of_a_run_under_capacity_with_jitter() -> None:
    outs = [_o(i / 50, 2.0 if i % 50 else 3.9, (200,)) for i in range(150)]
    s = summarize(outs, target="t", rate=50, duration_s=3.0, concurrency=8, deadline_ms=None,
                  dropped=0)
    assert s.verdict == NOT_SATURATED and s.decided_by == BY_NO_SATURATION
    assert s.within_deadline_share is None and s.deadline_ms is None
    assert s.p50_first_third_ms == pytest.approx(2.0, abs=0.01)


def test_summary_of_a_growing_queue() -> None:
    outs = [_o(i / 100, 10 + 5 * i, (200,)) for i in range(300)]  # each waits longer
    s = summarize(outs, target="t", rate=100, duration_s=3.0, concurrency=512,
                  deadline_ms=None, dropped=0)
    assert s.verdict == PRESENT and s.decided_by == BY_GROWTH
    assert s.p50_last_third_ms is not None and s.p50_first_third_ms is not None
    assert s.p50_last_third_ms > 2 * s.p50_first_third_ms


# -- series ----------------------------------------------------------------------------------
def test_per_second_series() -> None:
    outs = [_o(0.1, 10.0, (200,)), _o(0.2, 20.0, (200,)), _o(0.3, 1.0, (429,), hinted=1),
            _o(1.5, 30.0, (429, 200), hinted=1, last_ms=12.0), _o(2.2, 900.0, (0,))]
    secs = per_second(outs)
    assert [s.t_s for s in secs] == [0, 1, 2]
    assert [s.arrivals for s in secs] == [3, 1, 1]
    assert [s.refused for s in secs] == [1, 1, 0]
    assert secs[0].refusal_rate == pytest.approx(1 / 3)
    assert (secs[0].accepted_p50_ms, secs[0].accepted_p99_ms) == (20.0, 20.0)
    assert secs[0].refused_p50_ms == 1.0
    assert secs[1].accepted_p50_ms == 12.0 and secs[1].refused_p50_ms is None  # retried
    assert secs[2].accepted_p99_ms == 900.0  # a timeout counts at its time
    assert per_second([]) == []


def test_percentile_curve_stops_where_the_data_does() -> None:
    xs = [float(i) for i in range(1, 1001)]
    curve = percentile_curve(xs)
    assert [p for p, _ in curve][:7] == [0.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5]
    assert all(1 / (1 - p / 100) <= 1001 + 1e-6 for p, _ in curve)
    assert curve[-1][1] == 1000.0
    assert [v for _, v in curve] == sorted(v for _, v in curve)
    assert percentile_curve([]) == []


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
    # Over the two that came back: the refusal that was final made no retry to count.
    assert s.mean_retries == pytest.approx((1 + 2) / 2)
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


def _result(statuses: tuple[int, ...], cause: LocalCause | None) -> Result:
    return Result(status=statuses[-1], body=b"", headers={}, request_id="r",
                  statuses=statuses, local=cause is not None, local_cause=cause)


@pytest.mark.parametrize(("statuses", "cause", "final", "counted"), [
    ((200,), None, "200", (200,)),
    ((429, 429), None, "429", (429, 429)),  # the plane's final refusal
    ((504,), None, "504", (504,)),  # the plane's own 504 (the router's, at the deadline)
    ((504,), LocalCause.NO_ANSWER, "timeout", (0,)),  # sent, nothing came back
    ((429, 504), LocalCause.NOT_SENT, "unsent", (429,)),  # its retry never went
    ((504,), LocalCause.NOT_SENT, "timeout", (0,)),  # its deadline gone before the first
    ((504,), LocalCause.DISCONNECTED, "error", (0,)),  # held for the connection, never sent
    ((503,), LocalCause.DISCONNECTED, "error", (0,)),
    ((503,), LocalCause.NO_RESPONDERS, "error", (0,)),
    ((429, 503), LocalCause.DROPPED, "error", (429, 0)),
])
def test_a_call_is_counted_under_what_ended_it(statuses: tuple[int, ...],
                                                cause: LocalCause | None, final: str,
                                                counted: tuple[int, ...]) -> None:
    """The SDK's own statuses by why it made them: only an attempt sent and never answered is
    a timeout (a call never sent, held for a lost connection, was one)."""
    got = attempts_of(_result(statuses, cause))
    assert (got.final, got.statuses, got.local) == (final, counted, cause or "")


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


def test_poisson_arrivals_are_chosen_by_the_load_and_repeat_with_a_seed() -> None:
    even = LoadConfig(rate=200, duration_s=5).offsets_s()
    assert even == arrival_offsets_s(200, 5)
    poisson = LoadConfig(rate=200, duration_s=5, arrivals="poisson", seed=3).offsets_s()
    assert poisson == LoadConfig(rate=200, duration_s=5, arrivals="poisson",
                                 seed=3).offsets_s()
    assert len(poisson) == pytest.approx(1000, rel=0.1) and poisson != even
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert max(gaps) > 0.01 and min(gaps) < 0.0005  # lulls and bursts (evenly: 0.005 each)


@pytest.mark.parametrize("kw", [{"rate": 0}, {"duration_s": -1}, {"concurrency": 0},
                                {"rate": 0.1, "duration_s": 1}, {"arrivals": "burst"}])
def test_load_config_is_validated(kw: dict[str, float | str]) -> None:
    args: dict[str, float | str] = {"rate": 10, "duration_s": 1, **kw}
    with pytest.raises(ConfigError):
        LoadConfig(**args)  # type: ignore[arg-type]


def test_default_bodies() -> None:
    assert len(json.loads(default_body("risk"))["features"]) == 32
    assert json.loads(default_body("calibrated", duration_us=250)) == {"duration_us": 250}
    with pytest.raises(ConfigError):
        default_body("nope")


def test_streams_cannot_be_sent_evenly() -> None:
    """`--stream` always sends at Poisson arrivals: asking for even ones is a usage error that
    says so, before anything connects."""
    result = CliRunner().invoke(pulse, ["--nats", "nats://127.0.0.1:1", "--stream",
                                        "--model", "tinylm", "--arrivals", "even"])
    assert result.exit_code == 2 and "leave out --arrivals even" in result.output
