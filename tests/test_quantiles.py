"""The nearest-rank quantile that reports and benchmarks share."""

import math

from plane.contract.quantiles import nearest_rank, quantile


def test_nearest_rank_on_sorted_and_unsorted_values() -> None:
    values = list(range(1, 101))  # 1..100
    assert nearest_rank(values, 0.5) == 51 and nearest_rank(values, 0.99) == 100
    assert nearest_rank(values, 0.0) == 1 and nearest_rank(values, 1.0) == 100
    assert quantile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert math.isnan(quantile([], 0.5))
