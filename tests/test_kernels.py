"""Kernels against their torch references, in Triton's CPU interpreter (TRITON_INTERPRET=1).

Triton decorates its own library (`tl.sum`, ...) when it is imported, so the interpreter
needs the variable set before `import triton`. Run on its own, this module sets it first. In a
whole-suite run where something imported triton earlier without it, these tests skip and
tests/test_kernels_subprocess.py re-runs them in a fresh process with the variable set.
"""

from __future__ import annotations

import os
import sys
import time

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: see above

import pytest
import torch

from kernels.calibrated import calibrated, calibrated_reference
from kernels.launch import interpreter_ready
from kernels.probe import probe, probe_reference, sm_ids
from kernels.risk import FEATURES, HIDDEN, RiskWeights, risk, risk_bytes, risk_reference

pytestmark = pytest.mark.skipif(
    not interpreter_ready(),
    reason="triton was imported without TRITON_INTERPRET=1: test_kernels_subprocess runs these",
)

# f32 throughout; the kernel sums in a different order from torch's matmul.
ATOL = 1e-5
RTOL = 1e-5


def _weights(n_features: int, n_hidden: int, seed: int) -> RiskWeights:
    g = torch.Generator().manual_seed(seed)
    return RiskWeights(
        w1=torch.randn(n_features, n_hidden, generator=g) / n_features**0.5,
        b1=torch.randn(n_hidden, generator=g) * 0.1,
        w2=torch.randn(n_hidden, generator=g) / n_hidden**0.5,
        b2=0.25,
    )


# --------------------------------------------------------------------------------------------
# risk
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 7, 13])
def test_risk_matches_reference_on_the_model(batch: int) -> None:
    w = RiskWeights.from_seed(0)
    x = torch.randn(batch, FEATURES, generator=torch.Generator().manual_seed(batch))
    torch.testing.assert_close(risk(x, w), risk_reference(x, w), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("batch", "n_features", "n_hidden"), [(5, 19, 37), (2, 33, 65), (1, 1, 3)])
def test_risk_masks_awkward_shapes(batch: int, n_features: int, n_hidden: int) -> None:
    w = _weights(n_features, n_hidden, seed=n_features)
    x = torch.randn(batch, n_features, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(risk(x, w), risk_reference(x, w), atol=ATOL, rtol=RTOL)


def test_risk_of_zeros_is_sigmoid_of_the_bias_path() -> None:
    w = RiskWeights.from_seed(3)
    x = torch.zeros(3, FEATURES)
    torch.testing.assert_close(risk(x, w), risk_reference(x, w), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scale", [1e3, 1e6, -1e6])
def test_risk_saturates_without_overflow_at_large_magnitudes(scale: float) -> None:
    w = RiskWeights.from_seed(0)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, FEATURES, generator=g) * scale
    got = risk(x, w)
    assert torch.isfinite(got).all()
    assert ((got >= 0) & (got <= 1)).all()
    # Logits here reach ~1e6: the sums differ in the last bits, the scores saturate alike.
    torch.testing.assert_close(got, risk_reference(x, w), atol=1e-4, rtol=1e-4)


def test_risk_scores_only_n_rows_of_a_preallocated_buffer() -> None:
    w = RiskWeights.from_seed(0)
    x = torch.randn(16, FEATURES, generator=torch.Generator().manual_seed(2))
    out = torch.full((16,), -1.0)
    risk(x, w, out=out, n_rows=3)
    torch.testing.assert_close(out[:3], risk_reference(x[:3], w), atol=ATOL, rtol=RTOL)
    assert (out[3:] == -1.0).all()  # the masked tail was not written


def test_risk_reads_rows_by_stride() -> None:
    w = RiskWeights.from_seed(0)
    wide = torch.randn(4, FEATURES + 9, generator=torch.Generator().manual_seed(5))
    x = wide[:, :FEATURES]  # rows FEATURES + 9 apart
    torch.testing.assert_close(risk(x, w), risk_reference(x, w), atol=ATOL, rtol=RTOL)


def test_risk_zero_rows_launches_nothing() -> None:
    out = torch.full((2,), -1.0)
    risk(torch.zeros(2, FEATURES), RiskWeights.from_seed(0), out=out, n_rows=0)
    assert (out == -1.0).all()


@pytest.mark.parametrize(
    ("x", "kwargs", "match"),
    [
        (torch.zeros(2, FEATURES, dtype=torch.float64), {}, "float32"),
        (torch.zeros(FEATURES), {}, "2-d"),
        (torch.zeros(2, FEATURES + 1), {}, "columns"),
        (torch.zeros(FEATURES, 2).t(), {}, "columns"),
        (torch.zeros(2, FEATURES), {"n_rows": 3}, "n_rows"),
        (torch.zeros(2, FEATURES), {"out": torch.zeros(1)}, "out"),
        (torch.zeros(2, FEATURES), {"out": torch.zeros(2, dtype=torch.int32)}, "out"),
    ],
)
def test_risk_wrapper_refuses_bad_arguments(
    x: torch.Tensor, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        risk(x, RiskWeights.from_seed(0), **kwargs)  # type: ignore[arg-type]


def test_risk_bytes_counts_inputs_weights_and_scores() -> None:
    assert risk_bytes(1) == 4 * (FEATURES + FEATURES * HIDDEN + 2 * HIDDEN + 1)


# --------------------------------------------------------------------------------------------
# probe
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "token"), [(1, 1), (37, 12345), (300, -7), (256, 0)])
def test_probe_matches_reference(n: int, token: int) -> None:
    x = torch.arange(n, dtype=torch.int32) * 7919
    out = torch.full((n,), -1, dtype=torch.int32)
    probe(x, token, out=out)
    assert torch.equal(out, probe_reference(x, token))


def test_probe_refuses_bad_arguments() -> None:
    x = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        probe(x.float(), 1, out=x)
    with pytest.raises(ValueError, match="one length"):
        probe(x, 1, out=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="token"):
        probe(x, 2**31, out=torch.zeros(4, dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# calibrated (the spin kernel runs only on a GPU: scripts/gpu_check.py checks it there)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("duration_us", [0, 150, 1000])
def test_calibrated_reference_spins_at_least_the_duration(duration_us: int) -> None:
    t0 = time.perf_counter_ns()
    spun_ns = calibrated_reference(duration_us)
    assert spun_ns >= duration_us * 1000
    assert time.perf_counter_ns() - t0 >= duration_us * 1000


def test_calibrated_kernel_refuses_the_interpreter_plainly() -> None:
    out = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="interpreter"):
        calibrated(100, out=out)
    with pytest.raises(ValueError, match="duration_us"):
        calibrated(-1, out=out)
    with pytest.raises(ValueError, match="programs"):
        calibrated(1, out=out, programs=0)


def test_sm_ids_is_cuda_only() -> None:
    with pytest.raises(ValueError, match="CUDA only"):
        sm_ids(torch.zeros(4, dtype=torch.int32))
