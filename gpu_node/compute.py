"""The seam between a node's slot and the compute: a `Backend` makes one `SlotRunner` per slot.

A runner's `run_*` methods and `probe` are blocking and run on that slot's own thread (or on
the event loop while its calls are known short: `Slot._call`). Its `start_*` methods launch
device work without waiting for it; the slot awaits its end on the event loop
(`gpu_node.device_wait`), with no thread hop. Backends:

- `torch`: CPU serving, torch ops into preallocated buffers.
- `triton`: the kernels in kernels/ on a CUDA GPU, one SM partition (green context or stream)
  per slot, results written back through pinned buffers (gpu_node/kernel_backend.py).
- `interpret`: the same kernels in Triton's CPU interpreter, for tests. It needs
  TRITON_INTERPRET=1 in the environment *before triton is imported* (set it where the process
  starts: triton decorates its own library at import).

`auto` picks `triton` when CUDA is available, else `torch`. Asking for `triton` without a GPU
is an error, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gpu_node.device_wait import CALIBRATED, DeviceWork, TimedWork
from gpu_node.partitions import count_slots
from gpu_node.pinned import RowPacker, Staged
from kernels.risk import FEATURES, HIDDEN, RiskWeights, risk_reference, risk_reference_out
from plane.contract.config import BACKENDS
from plane.contract.errors import ConfigError

__all__ = [
    "FEATURES",
    "HIDDEN",
    "Backend",
    "RiskWeights",
    "SlotRunner",
    "TorchBackend",
    "TorchSlot",
    "make_backend",
    "risk_reference",
]



class SlotRunner(Protocol):
    # The kinds of request whose device work `start_*` launches, to be awaited on the loop
    # (`RISK`, `CALIBRATED`); on CUDA only once the warm-up check of them passed.
    launches: frozenset[str]

    def run_risk(self, features: Sequence[float]) -> float: ...

    def run_calibrated(self, duration_us: int) -> None: ...

    def start_calibrated(self, duration_us: int) -> DeviceWork:
        """`run_calibrated`, launched: its end is awaited on the loop (`device_wait`)."""
        ...

    def start_risk(self, features: Sequence[float]) -> DeviceWork:
        """`run_risk`, launched (its score from `risk_score` once done); only where `RISK` is
        in `launches` (elsewhere a risk request is compute on the CPU: `run_risk`)."""
        ...

    def risk_score(self) -> float:
        """The score of the risk request `start_risk` launched, once it is done."""
        ...

    def probe(self) -> bool: ...

    def lane_context(self) -> contextlib.AbstractContextManager[Any]:
        """Where the slot's device work goes (its CUDA stream; nothing on a CPU): a
        generation runs all its steps inside it."""
        ...

    def bind_thread(self) -> None:
        """Run once on the slot's own thread before its first call: a CUDA slot makes its
        stream that thread's current one, so that its calls need not switch to it."""
        ...


class Backend(Protocol):
    name: str  # "torch" | "triton" | "interpret"
    partition: str  # "green-context" | "stream" | "none"

    def default_slots(self) -> int: ...

    def make_slot(self, k: int) -> SlotRunner: ...

    def describe(self, slots: int | None = None) -> str:
        """One line for the start-up log: the device and its partitions, for `slots` slots
        (None: the backend's default count)."""
        ...


class TorchSlot:
    """CPU slot: every tensor is allocated once, here; a request allocates none."""

    launches = frozenset({CALIBRATED})  # its only device work, and a timed one

    def __init__(self, weights: RiskWeights) -> None:
        cpu = torch.device("cpu")
        self._w = weights
        self.x = Staged((1, FEATURES), torch.float32, cpu)  # [1, FEATURES]
        self.y = Staged((1,), torch.float32, cpu)  # [1]
        self._hidden = torch.zeros(1, HIDDEN)  # [1, HIDDEN] workspace
        self._b2 = torch.full((1,), weights.b2)  # [1]: a tensor, so no scalar is wrapped
        self._packer = RowPacker(self.x, FEATURES)

    def buffers(self) -> tuple[Staged, ...]:
        return (self.x, self.y)

    def run_risk(self, features: Sequence[float]) -> float:
        self._packer.pack(features)
        risk_reference_out(self.x.host, self._w, b2=self._b2, hidden=self._hidden, out=self.y.host)
        return float(self.y.host_np[0])

    def run_calibrated(self, duration_us: int) -> None:
        # A timed wait off the event loop, as device work would be: N slots give N x capacity.
        if duration_us > 0:
            time.sleep(duration_us / 1e6)

    def start_calibrated(self, duration_us: int) -> DeviceWork:
        # The same wait, as device work launched: it ends at a time, awaited on the loop.
        return TimedWork(duration_us / 1e6)

    def start_risk(self, features: Sequence[float]) -> DeviceWork:
        # Risk is compute on this CPU, not device work (not in `launches`: the slot calls
        # `run_risk` instead, off the loop). Asked all the same, it computes now and is done.
        self.run_risk(features)
        return TimedWork(0.0)

    def risk_score(self) -> float:
        return float(self.y.host_np[0])

    def probe(self) -> bool:
        return 0.0 <= self.run_risk([0.0] * FEATURES) <= 1.0

    def lane_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def bind_thread(self) -> None:
        pass


class TorchBackend:
    name = "torch"
    partition = "none"

    def __init__(self, seed: int = 0) -> None:
        torch.set_num_threads(1)
        self._weights = RiskWeights.from_seed(seed)

    def describe(self, slots: int | None = None) -> str:
        # Was "2 slots" whatever the node ran (`plane node --slots 1` logged both 1 and 2).
        n = self.default_slots() if slots is None else slots
        return f"torch on cpu: {count_slots(n)}, one thread each"

    def default_slots(self) -> int:
        return 2

    def make_slot(self, k: int) -> SlotRunner:
        return TorchSlot(self._weights)


def make_backend(name: str, *, seed: int = 0, sms_per_slot: int | None = None) -> Backend:
    """Resolve `--backend` (auto | torch | interpret | triton) into a built backend."""
    if name not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if torch.cuda.is_available() else "torch"
    if sms_per_slot is not None and name != "triton":
        # Not an error: one configuration may start nodes with and without a GPU (auto).
        # structlog here only: scripts/gpu_check.py imports this module on a bare GPU box.
        import structlog

        structlog.get_logger("plane.node").warning(
            "--sms-per-slot ignored: it sizes a GPU's SM partitions",
            backend=name, sms_per_slot=sms_per_slot)
    if name == "torch":
        return TorchBackend(seed)

    from gpu_node.kernel_backend import KernelBackend
    from kernels.launch import interpreter_ready, interpreting

    if name == "interpret":
        if not interpreting():
            raise ConfigError(
                "--backend interpret needs TRITON_INTERPRET=1 in the environment before the "
                "process starts (e.g. `TRITON_INTERPRET=1 plane node --backend interpret`)"
            )
        if not interpreter_ready():
            raise ConfigError(
                "--backend interpret: triton was imported before TRITON_INTERPRET=1 was set; "
                "set it in the environment before the process starts"
            )
        return KernelBackend(interpret=True, seed=seed)
    # name == "triton"
    if not torch.cuda.is_available():
        raise ConfigError("--backend triton needs a CUDA GPU; use --backend torch on a CPU")
    if interpreting():
        raise ConfigError("--backend triton compiles for the GPU: unset TRITON_INTERPRET")
    try:
        return KernelBackend(interpret=False, seed=seed, sms_per_slot=sms_per_slot)
    except ValueError as e:  # a partition size that does not fit the device
        raise ConfigError(str(e)) from e
