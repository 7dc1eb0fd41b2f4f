"""Service-time estimates: the budget model shared by routers (admission, tickets) and nodes
(withdraw a slot whose p99 no longer fits its model's budget).

A request's predicted service time is its requested device work (`work_us`, 0 for models
whose work does not depend on the input) plus the slot's measured *overhead*. The window keeps
the last `size` overheads, in arrival order and also sorted (a C-level insort and delete per
sample), so every percentile is current and read in O(1); sorting the window every eighth
sample instead cost a placement ~3 µs of the router's CPU on average (docs/perf).

A window may also age its samples (`max_age_s`): the router's does, so that an estimate
polluted by a burst (its own loop behind, cycles measured in seconds) heals by itself within
that age even when nothing is placed meanwhile (refused requests add no samples). Emptied by
age, the window falls back to its prior and fresh placements measure the slot again.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field

import msgspec

LEARNED_PRIOR_MIN = 5  # samples a window must hold for its median to become its prior


@dataclass(slots=True)
class ServiceWindow:
    size: int = 256
    prior_us: int = 1000  # what we assume before the first sample
    max_age_s: float | None = None  # samples older than this are dropped by `expire`
    # As samples age out, the window's prior becomes the median of what it held (while it
    # held LEARNED_PRIOR_MIN at least, so that one outlier is not it): emptied, it is that,
    # and a model's learned rate outlives a quiet spell, where the configured prior may be
    # far off (the token rates).
    learn_prior: bool = False
    _samples: deque[int] = field(init=False)  # in arrival order
    _sorted: list[int] = field(init=False, default_factory=list)  # the same, sorted
    _times: deque[float] = field(init=False)  # monotonic time of each sample, when aging
    _sum: int = field(default=0, init=False)
    _p50: int = field(default=0, init=False)
    _p90: int = field(default=0, init=False)
    _p99: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._samples = deque(maxlen=self.size)
        self._times = deque(maxlen=self.size)
        self._p50 = self._p90 = self._p99 = self.prior_us

    def add(self, overhead_us: int, now_s: float = 0.0) -> None:
        """One sample; `now_s` (monotonic) only matters to a window that ages."""
        v = max(0, int(overhead_us))
        samples = self._samples
        if len(samples) == samples.maxlen:
            self._drop(samples[0])  # the deque lets it go as `v` comes in
        samples.append(v)
        insort(self._sorted, v)
        if self.max_age_s is not None:
            self._times.append(now_s)
        self._sum += v
        self._read()

    def _drop(self, v: int) -> None:
        self._sum -= v
        del self._sorted[bisect_left(self._sorted, v)]

    def expire(self, now_s: float) -> int:
        """Drop the samples older than `max_age_s`; how many went."""
        if self.max_age_s is None:
            return 0
        cutoff, gone = now_s - self.max_age_s, 0
        if (self.learn_prior and self._times and self._times[0] < cutoff
                and len(self._sorted) >= LEARNED_PRIOR_MIN):
            self.prior_us = self._p50  # samples go: their median stays, should all go
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
            self._drop(self._samples.popleft())
            gone += 1
        if gone:
            self._read()
        return gone

    def _read(self) -> None:
        """The percentiles, read off the sorted samples (read per decision: kept, not made)."""
        s = self._sorted
        n = len(s)
        if not n:
            self._p50 = self._p90 = self._p99 = self.prior_us
            return
        self._p50 = s[(n - 1) // 2]
        self._p90 = s[min(n - 1, (90 * n) // 100)]
        self._p99 = s[min(n - 1, (99 * n) // 100)]

    @property
    def count(self) -> int:
        return len(self._samples)

    @property
    def oldest_s(self) -> float | None:
        """When its oldest sample came (a window that ages; None: empty or not aging)."""
        return self._times[0] if self._times else None

    @property
    def mean_us(self) -> int:
        """The mean: what promises are spaced by (a skewed tail makes the p50 drift)."""
        return self._sum // len(self._samples) if self._samples else self.prior_us

    @property
    def p50_us(self) -> int:
        return self._p50

    @property
    def p90_us(self) -> int:
        return self._p90

    @property
    def p99_us(self) -> int:
        return self._p99

    def clear(self) -> None:
        self._samples.clear()
        self._sorted.clear()
        self._times.clear()
        self._sum = 0
        self._read()


class Prediction(msgspec.Struct, frozen=True):
    p50_us: int
    p99_us: int
    mean_us: int = -1  # -1: same as the p50
    p90_us: int = -1  # -1: same as the expected time

    @property
    def expected_us(self) -> int:
        return self.p50_us if self.mean_us < 0 else self.mean_us

    @property
    def likely_us(self) -> int:
        """Long enough nine times in ten."""
        return self.expected_us if self.p90_us < 0 else max(self.p90_us, self.expected_us)


def predict(window: ServiceWindow, work_us: int) -> Prediction:
    return Prediction(work_us + window.p50_us, work_us + window.p99_us,
                      work_us + window.mean_us, work_us + window.p90_us)


def fits(p99_us: int, remaining_us: int) -> bool:
    """Admit only when the predicted p99 fits the remaining deadline."""
    return p99_us <= remaining_us


# What a generation costs before the router has seen one (CPU `tinylm`, measured by
# benchmarks/tinylm_tokens.py: ~230-310 µs a decode step; the prefill is one batched pass).
PRIOR_DECODE_NS = 300_000
PRIOR_PREFILL_NS = 40_000
FULL = 1000  # a stream that produced all its max_tokens, in per mille
# A generation's rates age out after this long (`ServiceWindow.max_age_s`), as the router's
# cycle does: with a sample per stream, one slow stream (a device's hiccup, a slowed node)
# was the p99 of a small window until 128 newer streams pushed it out, and every stream
# whose deadline it did not fit was refused `deadline` (final) meanwhile, so none came to
# teach a newer rate: the model refused long streams for good. Longer than the cycle's
# (2 s): one sample a stream, not one a request. Emptied, a window keeps the median of what
# it held as its prior (`ServiceWindow.learn_prior`): a quiet spell does not send a slow
# device back to a prior four times too fast.
RATES_MAX_AGE_S = 10.0


@dataclass(slots=True)
class TokenRates:
    """A generating model's per-token costs, learned online from done-events: per stream, its
    prefill time per prompt token and its decode time per token produced (nanoseconds, so
    that a fast device keeps its precision), each in a window with p50 and p99 like the
    overhead, and the share of max_tokens produced. A stream's device work is predicted as
    `prompt x prefill + max_tokens x share x decode`, each at its quantile; its first token
    as `prompt x prefill + one step`. Each sample ages out after RATES_MAX_AGE_S (`expire`).
    """

    prefill: ServiceWindow = field(default_factory=lambda: ServiceWindow(
        size=128, prior_us=PRIOR_PREFILL_NS, max_age_s=RATES_MAX_AGE_S, learn_prior=True))
    decode: ServiceWindow = field(default_factory=lambda: ServiceWindow(
        size=128, prior_us=PRIOR_DECODE_NS, max_age_s=RATES_MAX_AGE_S, learn_prior=True))
    # How much of max_tokens streams produce (per mille): a model that often ends early
    # (END sampled, callers that cancel) frees its slot early, and promises are spaced by
    # what streams take, not by what they may take.
    fill: ServiceWindow = field(default_factory=lambda: ServiceWindow(
        size=128, prior_us=FULL, max_age_s=RATES_MAX_AGE_S))
    # The same of the streams that ran to their own end (END sampled, or max_tokens): its
    # p99 bounds deadlines. A stream cut short (cancelled, its caller gone, its deadline)
    # says nothing of how far the next one goes: learnt from those, a run of streams
    # cancelled at their first token had the router admit long streams to deadlines only
    # their first token fitted (each then ended 504). Neither window learns its prior: with
    # nothing recent the router assumes max_tokens (found from outside: the median kept
    # after a quiet spell was the p99 of the next admission).
    reach: ServiceWindow = field(default_factory=lambda: ServiceWindow(
        size=128, prior_us=FULL, max_age_s=RATES_MAX_AGE_S))

    def learn(self, prompt_tokens: int, tokens: int, prefill_us: int, decode_us: int,
              max_tokens: int = 0, now_s: float = 0.0, cut: bool = False) -> None:
        """One generation's done-event, at monotonic `now_s` (for its age); `cut`: it was
        ended before its own end (`DoneEvent.cut`)."""
        if prompt_tokens > 0 and prefill_us > 0:
            self.prefill.add(prefill_us * 1000 // prompt_tokens, now_s)
        if tokens > 0 and decode_us > 0:
            self.decode.add(decode_us * 1000 // tokens, now_s)
        if max_tokens > 0:
            share = min(FULL, tokens * FULL // max_tokens)
            self.fill.add(share, now_s)
            if not cut:
                self.reach.add(share, now_s)

    def expire(self, now_s: float) -> None:
        """Drop the samples older than RATES_MAX_AGE_S (an emptied window is its prior)."""
        self.prefill.expire(now_s)
        self.decode.expire(now_s)
        self.fill.expire(now_s)
        self.reach.expire(now_s)

    def predict(self, overhead: ServiceWindow, prompt_tokens: int,
                max_tokens: int) -> tuple[Prediction, int, int]:
        """(the whole stream's prediction, its first token's p99 µs, its expected device work
        µs) for a prompt of `prompt_tokens` asking for up to `max_tokens`. Bounded by
        max_tokens: a stream that ends early frees its slot early, at its done-event."""
        pre, dec, fill = self.prefill, self.decode, self.fill

        def work(pre_ns: int, dec_ns: int, fill_pm: int) -> int:
            steps = max(1, -(-max_tokens * fill_pm // FULL))  # at least one, rounded up
            return (prompt_tokens * pre_ns + steps * dec_ns) // 1000

        whole = Prediction(
            overhead.p50_us + work(pre.p50_us, dec.p50_us, fill.p50_us),
            overhead.p99_us + work(pre.p99_us, dec.p99_us, self.reach.p99_us),
            overhead.mean_us + work(pre.mean_us, dec.mean_us, fill.mean_us),
            overhead.p90_us + work(pre.p90_us, dec.p90_us, fill.p90_us))
        first_p99 = overhead.p99_us + work(pre.p99_us, dec.p99_us, 0)
        return whole, first_p99, work(pre.mean_us, dec.mean_us, fill.mean_us)
