"""The seam between a node's slot and the compute: a `Backend` makes one `SlotRunner` per slot.

A runner's methods are blocking and are only ever called from that slot's own executor thread
(never on the event loop). `torch` serves on the CPU; the Triton backends (`triton` on CUDA,
`interpret` under TRITON_INTERPRET=1) live in `kernels/` and plug in here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from plane.errors import ConfigError
from plane.messages import FEATURES

HIDDEN = 64


class SlotRunner(Protocol):
    def run_risk(self, features: Sequence[float]) -> float: ...

    def run_calibrated(self, duration_us: int) -> None: ...

    def probe(self) -> bool: ...


class Backend(Protocol):
    name: str
    partition: str  # "green-context" | "stream" | "none"

    def default_slots(self) -> int: ...

    def make_slot(self, k: int) -> SlotRunner: ...


@dataclass(frozen=True)
class RiskWeights:
    w1: torch.Tensor  # [FEATURES, HIDDEN]
    b1: torch.Tensor  # [HIDDEN]
    w2: torch.Tensor  # [HIDDEN]
    b2: float

    @classmethod
    def from_seed(cls, seed: int) -> RiskWeights:
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(FEATURES, HIDDEN, generator=g) / FEATURES**0.5
        b1 = torch.randn(HIDDEN, generator=g) * 0.1
        w2 = torch.randn(HIDDEN, generator=g) / HIDDEN**0.5
        return cls(w1=w1, b1=b1, w2=w2, b2=0.0)


def risk_reference(x: torch.Tensor, w: RiskWeights) -> torch.Tensor:
    """[B, FEATURES] -> [B]: sigmoid(relu(x @ w1 + b1) @ w2 + b2)."""
    h = torch.relu(x @ w.w1 + w.b1)  # [B, HIDDEN]
    return torch.sigmoid(h @ w.w2 + w.b2)  # [B]


class TorchSlot:
    """CPU slot: the input tensor is allocated once and reused for every request."""

    def __init__(self, weights: RiskWeights) -> None:
        self._w = weights
        self._x = torch.zeros(1, FEATURES)  # [1, FEATURES], reused

    def run_risk(self, features: Sequence[float]) -> float:
        with torch.inference_mode():
            self._x[0] = torch.as_tensor(features, dtype=torch.float32)
            return float(risk_reference(self._x, self._w)[0])

    def run_calibrated(self, duration_us: int) -> None:
        # A timed wait off the event loop, as device work would be: N slots give N x capacity.
        if duration_us > 0:
            time.sleep(duration_us / 1e6)

    def probe(self) -> bool:
        return self.run_risk([0.0] * FEATURES) >= 0.0


class TorchBackend:
    name = "torch"
    partition = "none"

    def __init__(self, seed: int = 0) -> None:
        torch.set_num_threads(1)
        self._weights = RiskWeights.from_seed(seed)

    def default_slots(self) -> int:
        return 2

    def make_slot(self, k: int) -> SlotRunner:
        return TorchSlot(self._weights)


def make_backend(name: str, *, seed: int = 0, sms_per_slot: int | None = None) -> Backend:
    """Resolve `--backend` (auto | torch | interpret | triton). Asking for `triton` without a
    GPU is an error, never a silent fallback."""
    if name in ("auto", "torch"):
        if name == "auto" and torch.cuda.is_available():
            name = "triton"
        else:
            return TorchBackend(seed)
    if name == "triton" and not torch.cuda.is_available():
        raise ConfigError("--backend triton needs a CUDA GPU; use --backend torch on a CPU")
    raise ConfigError(f"backend {name!r} is not available in this build")
