"""Nodes of one process sharing a partitioned device (`plane up` on a GPU): with no --slots,
each takes its share of the backend's partitions (`NodeConfig.device_share`), so that every
SM partition runs at most one request; on a CPU backend the count is unchanged."""

from __future__ import annotations

import pytest

from gpu_node.node import Node
from plane.contract.config import ConnectOptions, NodeConfig
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import ConfigError
from plane.contract.natsconn import close, connect
from tests.partitioned import PartitionedBackend
from tests.plane_fixtures import plane


@pytest.mark.parametrize(("share", "slots"), [(1, 15), (3, 5), (2, 7), (20, 1)])
async def test_a_node_takes_its_share_of_the_partitions(share: int, slots: int) -> None:
    async with EmbeddedNats() as srv:
        nc = await connect(ConnectOptions(url=srv.url, name="share-test"))
        try:
            node = Node(nc, NodeConfig(model="calibrated", node_id="n0", device_share=share),
                        backend=PartitionedBackend())  # type: ignore[arg-type]
            assert node.default_slots() == slots
            pinned = Node(nc, NodeConfig(model="calibrated", node_id="n1", slots=9,
                                         device_share=share),
                          backend=PartitionedBackend())  # type: ignore[arg-type]
            assert pinned.target_slots == 9  # --slots given: taken as it is
        finally:
            await close(nc)


async def test_plane_up_shares_the_device_among_its_models_and_a_cpu_keeps_its_count() -> None:
    async with plane(models=("risk", "calibrated"), backend="torch") as stack:
        assert [n.cfg.device_share for n in stack.nodes] == [2, 2]
        # The CPU backend does not partition: each node keeps its two slots.
        assert [len(n.slots) for n in stack.nodes] == [2, 2]


def test_a_share_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="device_share must be at least 1"):
        NodeConfig(model="calibrated", node_id="n0", device_share=0)
