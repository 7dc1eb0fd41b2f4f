"""The GIL switch interval of a process that runs nodes (`NodeConfig.gil_switch_us`): set by
the command that owns the process, checked by the config; `plane up` and `plane node` set it
(tests/test_gpu_scripts.py reads it from their "node started" lines)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from plane.contract.config import NodeConfig
from plane.contract.errors import ConfigError
from plane.up import hand_gil_sooner


@pytest.fixture
def python_switch() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_a_node_process_hands_the_gil_on_every_200_us_by_default(python_switch: float) -> None:
    hand_gil_sooner(NodeConfig(model="calibrated", node_id="n0").gil_switch_us)
    assert sys.getswitchinterval() == pytest.approx(200e-6)


def test_zero_leaves_pythons_own_interval(python_switch: float) -> None:
    hand_gil_sooner(0)
    assert sys.getswitchinterval() == python_switch


@pytest.mark.parametrize("us", [-1, 100_001])
def test_an_interval_out_of_range_is_refused_with_its_bounds(us: int) -> None:
    with pytest.raises(ConfigError, match="gil_switch_us must be between 0 and 100,000"):
        NodeConfig(model="calibrated", node_id="n0", gil_switch_us=us)
