"""The GIL switch interval of a process that runs nodes (`NodeConfig.gil_switch_us`): per
backend when not given (200 us on a partitioned device, Python's own on a CPU), set as the
node starts, checked by the config. tests/test_gpu_scripts.py reads it back from `plane
up`'s and `plane node`'s start lines."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from gpu_node.compute import make_backend
from gpu_node.node import Node, hand_gil_on
from plane.contract.config import GPU_GIL_SWITCH_US, ConnectOptions, NodeConfig
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import ConfigError
from plane.contract.natsconn import close, connect
from tests.partitioned import PartitionedBackend


@pytest.fixture
def python_switch() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


async def test_the_interval_is_the_backends_unless_given() -> None:
    async with EmbeddedNats() as srv:
        nc = await connect(ConnectOptions(url=srv.url, name="gil-test"))
        try:
            def node(backend: object, **kw: int) -> Node:
                return Node(nc, NodeConfig(model="calibrated", node_id="n0", **kw),
                            backend=backend)  # type: ignore[arg-type]

            assert node(PartitionedBackend()).gil_switch_us() == GPU_GIL_SWITCH_US == 200
            assert node(make_backend("torch", seed=0)).gil_switch_us() == 0  # Python's own
            assert node(make_backend("torch", seed=0), gil_switch_us=50).gil_switch_us() == 50
            assert node(PartitionedBackend(), gil_switch_us=0).gil_switch_us() == 0
        finally:
            await close(nc)


def test_a_node_process_hands_the_gil_on_at_the_interval_asked(python_switch: float) -> None:
    hand_gil_on(200)
    assert sys.getswitchinterval() == pytest.approx(200e-6)


def test_zero_leaves_pythons_own_interval(python_switch: float) -> None:
    hand_gil_on(0)
    assert sys.getswitchinterval() == python_switch


@pytest.mark.parametrize("us", [-1, 100_001])
def test_an_interval_out_of_range_is_refused_with_its_bounds(us: int) -> None:
    with pytest.raises(ConfigError, match="gil_switch_us must be between 0 and 100,000"):
        NodeConfig(model="calibrated", node_id="n0", gil_switch_us=us)
