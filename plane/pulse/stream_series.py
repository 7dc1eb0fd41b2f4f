"""A stream run over time: what `--out` draws. Pure functions of the outcomes.

For each second of scheduled arrivals: the accepted streams' TTFT and TPOT p50 and p99, the
arrivals and those refused at their first try; and, by second of arrival time on the run's
clock, the tokens delivered (what the plane streamed that second, whichever stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from plane.contract.quantiles import nearest_rank
from plane.pulse.stream_outcome import StreamOutcome


class StreamSecond(msgspec.Struct, frozen=True, kw_only=True):
    t_s: int  # the second of the scheduled arrivals, from the start
    arrivals: int
    refused: int  # at their first try
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tokens: int  # token messages' tokens that arrived during this second

    @property
    def refusal_rate(self) -> float | None:
        return self.refused / self.arrivals if self.arrivals else None


def _p50_p99_ms(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    xs.sort()
    return 1000 * nearest_rank(xs, 0.5), 1000 * nearest_rank(xs, 0.99)


def stream_seconds(outcomes: Sequence[StreamOutcome]) -> list[StreamSecond]:
    if not outcomes:
        return []
    last = max(int(o.scheduled_s) for o in outcomes)
    last = max([last, *(int(o.token_s[-1]) for o in outcomes if o.token_s)])
    n = last + 1
    ttft: list[list[float]] = [[] for _ in range(n)]
    tpot: list[list[float]] = [[] for _ in range(n)]
    arrivals, refused, tokens = [0] * n, [0] * n, [0] * n
    for o in outcomes:
        i = int(o.scheduled_s)
        arrivals[i] += 1
        refused[i] += o.first_refused
        if o.accepted:
            if (v := o.ttft_s) is not None:
                ttft[i].append(v)
            if (v := o.tpot_s) is not None:
                tpot[i].append(v)
        for t, k in zip(o.token_s, o.token_n, strict=True):
            tokens[max(0, int(t))] += k
    out = []
    for i in range(n):
        f50, f99 = _p50_p99_ms(ttft[i])
        t50, t99 = _p50_p99_ms(tpot[i])
        out.append(StreamSecond(t_s=i, arrivals=arrivals[i], refused=refused[i],
                                ttft_p50_ms=f50, ttft_p99_ms=f99, tpot_p50_ms=t50,
                                tpot_p99_ms=t99, tokens=tokens[i]))
    return out
