"""Is the GPU breathing? A verdict on a trace of GPU utilisation samples, with its evidence.

A service that starts each request when it arrives keeps its GPU about as busy as its load,
give or take the arrivals' own noise. One with a hidden queue or a batcher *breathes*: the
GPU is busy while a backlog drains, then idles while the next one fills (or the batcher
waits), over and over, so utilisation swings with a period. This module tells the cases apart
from a trace of `(time_s, utilisation %)`, as `nvidia-smi --query-gpu=timestamp,index,
utilization.gpu --format=csv -lms 100` prints it (or NVML, or a node's /metrics, at 10 Hz):

- `inconclusive`: too few samples, or too short a trace, to say;
- `idle`: nearly always near zero;
- `saturated`: a flat top, nearly always near 100% (more load only waits somewhere);
- `breathing`: strong periodic swings (autocorrelation peak at the dominant period, at least
  three periods in the trace, swings of more than `MIN_SWING_PCT`);
- `bursty`: big swings without a period (the arrivals themselves vary);
- `steady`: small swings around the mean.

Pure: numpy on the samples given, no clock or I/O (the readers and the plot are elsewhere:
`plane.observe.breathe_io`). Thresholds are module constants, named by unit.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

MIN_SAMPLES = 30
MIN_TRACE_S = 3.0
NEAR_TOP_PCT = 90.0
NEAR_ZERO_PCT = 5.0
SATURATED_SHARE = 0.8  # of the time near the top: a flat top
IDLE_SHARE = 0.9  # of the time near zero
MIN_SWING_PCT = 10.0  # standard deviation below this: steady whatever the shape
MIN_PERIOD_STRENGTH = 0.5  # autocorrelation at the dominant period
MIN_PERIODS = 3.0  # a period must repeat this often in the trace to count

STEADY, BREATHING, SATURATED, IDLE, BURSTY, INCONCLUSIVE = (
    "steady", "breathing", "saturated", "idle", "bursty", "inconclusive")


class Breath(msgspec.Struct, frozen=True, kw_only=True):
    verdict: str
    reasons: list[str]
    samples: int
    duration_s: float
    sample_period_s: float | None
    mean_pct: float | None
    std_pct: float | None
    near_top_share: float | None  # of samples >= NEAR_TOP_PCT
    near_zero_share: float | None  # of samples <= NEAR_ZERO_PCT
    period_s: float | None  # dominant period (autocorrelation peak), when there is one
    period_strength: float | None  # autocorrelation at that period, in [-1, 1]
    device: str = ""


def resample(times_s: npt.ArrayLike, util_pct: npt.ArrayLike
             ) -> tuple[npt.NDArray[np.float64], float]:
    """Samples on a uniform grid at the median sample period (nvidia-smi's -lms drifts a few
    ms a sample), by linear interpolation; (values, period_s)."""
    t = np.asarray(times_s, dtype=np.float64)
    u = np.asarray(util_pct, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t, u = t[order], u[order]
    dt = float(np.median(np.diff(t)))
    if dt <= 0:
        raise ValueError("samples need increasing times")
    grid = np.arange(t[0], t[-1] + dt / 2, dt)
    return np.interp(grid, t, u), dt


def dominant_period(values: npt.NDArray[np.float64], dt_s: float
                    ) -> tuple[float | None, float | None]:
    """(period_s, strength): the highest autocorrelation peak after the first zero crossing
    of the mean-removed series (lag 0 and its shoulder are the signal's own smoothness, not a
    period). None when the series never decorrelates or is flat."""
    x = values - values.mean()
    n = len(x)
    power = float(np.dot(x, x))
    if n < 4 or power == 0.0:
        return None, None
    # Autocorrelation through the spectrum (zero-padded: no wrap-around), normalised so that
    # lag k compares the n - k overlapping pairs fairly.
    spec = np.fft.rfft(x, 2 * n)
    acf = np.fft.irfft(spec * np.conj(spec))[:n]
    acf = acf / (power * (n - np.arange(n)) / n)
    below = np.nonzero(acf[1:] < 0)[0]
    if len(below) == 0:
        return None, None
    start = int(below[0]) + 1
    stop = max(start + 1, int(n / MIN_PERIODS) + 1)  # at least MIN_PERIODS in the trace
    window = acf[start:stop]
    if len(window) == 0:
        return None, None
    # Local maxima inside the window; of those, the shortest lag within 20% of the highest
    # (a period's multiples peak about as high: 2 s, 4 s, 6 s ... the period is 2 s).
    inner = np.nonzero((window[1:-1] >= window[:-2]) & (window[1:-1] >= window[2:]))[0] + 1
    if len(inner) == 0:
        return None, None
    best = float(window[inner].max())
    k = start + int(inner[np.nonzero(window[inner] >= best - 0.2 * abs(best))[0][0]])
    # A parabola through the peak and its neighbours: the period between two lags.
    y0, y1, y2 = acf[k - 1], acf[k], acf[k + 1] if k + 1 < n else acf[k]
    bend = y0 - 2 * y1 + y2
    shift = 0.5 * (y0 - y2) / bend if bend < 0 else 0.0
    return (k + float(np.clip(shift, -0.5, 0.5))) * dt_s, float(acf[k])


def diagnose(times_s: npt.ArrayLike, util_pct: npt.ArrayLike, *, device: str = "") -> Breath:
    """The verdict on one device's trace (see the module doc for what each verdict means)."""
    t = np.asarray(times_s, dtype=np.float64)
    u = np.asarray(util_pct, dtype=np.float64)
    n = len(t)
    duration_s = float(t.max() - t.min()) if n else 0.0
    if n < MIN_SAMPLES or duration_s < MIN_TRACE_S:
        return Breath(
            verdict=INCONCLUSIVE, device=device, samples=n, duration_s=duration_s,
            reasons=[f"{n} samples over {duration_s:.1f} s: need at least {MIN_SAMPLES} "
                     f"over {MIN_TRACE_S:g} s (10 Hz for 30 s is a good trace)"],
            sample_period_s=None, mean_pct=None, std_pct=None, near_top_share=None,
            near_zero_share=None, period_s=None, period_strength=None)
    grid, dt = resample(t, u)
    mean, std = float(u.mean()), float(u.std())
    top = float(np.mean(u >= NEAR_TOP_PCT))
    zero = float(np.mean(u <= NEAR_ZERO_PCT))
    period, strength = dominant_period(grid, dt)
    evidence = (f"mean {mean:.1f}%, std {std:.1f} points, {100 * top:.0f}% of the time "
                f">= {NEAR_TOP_PCT:g}%, {100 * zero:.0f}% <= {NEAR_ZERO_PCT:g}%")
    periodic = (period is not None and strength is not None
                and strength >= MIN_PERIOD_STRENGTH and std >= MIN_SWING_PCT)
    if zero >= IDLE_SHARE:
        verdict, why = IDLE, "nearly always near zero: nothing runs"
    elif top >= SATURATED_SHARE:
        verdict, why = SATURATED, ("a flat top: busy nearly all the time, so more load can "
                                   "only wait (look for a queue in front of it)")
    elif periodic:
        assert period is not None and strength is not None
        verdict, why = BREATHING, (
            f"swings with a period of {period:.2f} s (autocorrelation {strength:.2f}): a "
            "hidden queue that fills and drains, or a batcher that waits")
    elif std >= MIN_SWING_PCT:
        verdict, why = BURSTY, ("big swings without a period"
                                + ("" if period is None else
                                   f" (best {period:.2f} s at autocorrelation {strength:.2f})")
                                + ": the load itself varies")
    else:
        verdict, why = STEADY, f"swings under {MIN_SWING_PCT:g} points around the mean"
    return Breath(
        verdict=verdict, reasons=[why, evidence], device=device, samples=n,
        duration_s=duration_s, sample_period_s=dt, mean_pct=mean, std_pct=std,
        near_top_share=top, near_zero_share=zero, period_s=period, period_strength=strength)
