"""A slot's I/O buffers: allocated once when the slot is made, reused by every request.

On CUDA each buffer is a pinned host tensor with a device twin, so both copies are truly
asynchronous on the slot's stream (a pageable copy would stage through a driver buffer and
block). On the CPU backends the host tensor *is* the device tensor and the copies are no-ops.

The request path never allocates a tensor: features are packed straight into the pinned
input through a `struct` view, and the score is read straight out of the pinned output.
Imports only torch, so that scripts/gpu_check.py can use it on a bare GPU box.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np
import torch


class Staged:
    """One host buffer and its device twin (the same tensor off CUDA)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.on_device = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=self.on_device)
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if self.on_device else self.host
        # A numpy view of the host buffer: reads and writes land in the (pinned) memory itself.
        self.host_np: np.ndarray = self.host.numpy()

    def upload_no_sync(self) -> None:
        """Host -> device on the current stream; the host buffer must stay put until it runs."""
        if self.on_device:
            self.dev.copy_(self.host, non_blocking=True)

    def download_no_sync(self) -> None:
        """Device -> host on the current stream; read `host` only after an event says done."""
        if self.on_device:
            self.host.copy_(self.dev, non_blocking=True)

    def data_ptrs(self) -> tuple[int, int]:
        return self.host.data_ptr(), self.dev.data_ptr()


class RowPacker:
    """Writes a row of floats into row 0 of a float32 host buffer without allocating."""

    def __init__(self, buf: Staged, width: int) -> None:
        if buf.host.dtype != torch.float32 or buf.host.shape[-1] != width:
            raise ValueError(f"RowPacker needs a float32 buffer with rows of {width}")
        self.width = width
        self._struct = struct.Struct(f"<{width}f")
        self._view = buf.host_np.data.cast("B")

    def pack(self, values: Sequence[float]) -> None:
        if len(values) != self.width:
            raise ValueError(f"expected {self.width} values, got {len(values)}")
        try:
            self._struct.pack_into(self._view, 0, *values)
        except (struct.error, OverflowError) as e:  # a value beyond float32, or not a number
            raise ValueError(f"features must be float32 numbers: {e}") from e


def count_cpu_allocations(fn: Callable[[], object], calls: int) -> int:
    """How many CPU tensor allocations `calls` calls of `fn` make, counted from the torch
    profiler's memory events. For tests and diagnostics, never on the request path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(calls):
            fn()
    count = 0
    for event in prof.events():
        # An op's own allocations show as its self memory; ones outside any op as "[memory]".
        usage = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        count += usage > 0
    return count
