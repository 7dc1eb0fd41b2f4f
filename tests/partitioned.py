"""A backend that claims what a GPU's would (15 SM partitions) and computes on the CPU: for
the node's choices that depend on a partitioned device, tried without one."""

from __future__ import annotations

from typing import Any

from gpu_node.compute import make_backend
from gpu_node.partitions import GREEN_CONTEXT


class PartitionedBackend:
    partition = GREEN_CONTEXT

    def __init__(self) -> None:
        self._inner = make_backend("torch", seed=0)

    def default_slots(self) -> int:
        return 15

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
