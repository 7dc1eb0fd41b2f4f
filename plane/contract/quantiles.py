"""The nearest-rank quantile, for reports and benchmarks over a run's samples (the hot path
keeps its own windows: `plane.contract.budget`; pulse's summaries use HDR histograms)."""

from __future__ import annotations

from collections.abc import Sequence


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The value at quantile `q` (0..1) of values already sorted (not empty)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def quantile(values: Sequence[float], q: float) -> float:
    """The value at quantile `q` (0..1) of `values` in any order; NaN when there are none."""
    return nearest_rank(sorted(values), q) if values else float("nan")
