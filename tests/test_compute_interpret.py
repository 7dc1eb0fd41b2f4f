"""The `interpret` backend: the Triton kernels in the CPU interpreter, through a slot's
preallocated buffers, as the node drives them.

Needs TRITON_INTERPRET=1 before triton is imported (see tests/test_kernels.py); in a
whole-suite run that imported triton earlier, tests/test_kernels_subprocess.py runs this file.
"""

from __future__ import annotations

import os
import sys
import threading
import time

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from gpu_node import kernel_backend
from gpu_node.compute import FEATURES, RiskWeights, TorchSlot, make_backend
from gpu_node.kernel_backend import KernelBackend, KernelSlot
from gpu_node.pinned import count_cpu_allocations
from kernels.launch import interpreter_ready

pytestmark = pytest.mark.skipif(
    not interpreter_ready(),
    reason="triton was imported without TRITON_INTERPRET=1: test_kernels_subprocess runs these",
)

RAMP = [i / 10 for i in range(FEATURES)]


@pytest.fixture
def backend() -> KernelBackend:
    made = make_backend("interpret", seed=0)
    assert isinstance(made, KernelBackend)
    return made


def test_interpret_backend_describes_itself(backend: KernelBackend) -> None:
    assert (backend.name, backend.partition, backend.default_slots()) == ("interpret", "none", 2)
    assert backend.describe().startswith("interpret on cpu")


def test_interpret_slot_scores_like_the_torch_slot(backend: KernelBackend) -> None:
    slot = backend.make_slot(0)
    torch_slot = TorchSlot(RiskWeights.from_seed(0))
    g = torch.Generator().manual_seed(9)
    vectors = [[0.0] * FEATURES, RAMP] + [
        torch.randn(FEATURES, generator=g).tolist() for _ in range(5)
    ]
    for features in vectors:
        assert slot.run_risk(features) == pytest.approx(torch_slot.run_risk(features), abs=1e-5)
    assert slot.run_risk([0.0] * FEATURES) == pytest.approx(0.5189365148544312, abs=1e-5)


def test_interpret_slot_probe_passes_with_fresh_tokens(backend: KernelBackend) -> None:
    slot = backend.make_slot(0)
    assert all(slot.probe() for _ in range(3))


def test_probe_fails_when_the_kernel_does_not_run(
    backend: KernelBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = backend.make_slot(0)
    assert slot.probe()
    monkeypatch.setattr(kernel_backend, "probe", lambda x, token, *, out: out)  # launches nothing
    assert slot.probe() is False  # the old output carries the old token


def test_interpret_calibrated_is_a_timed_wait(backend: KernelBackend) -> None:
    slot = backend.make_slot(0)
    t0 = time.perf_counter()
    slot.run_calibrated(30_000)
    assert time.perf_counter() - t0 >= 0.029


def test_two_slots_interpret_from_their_own_threads(backend: KernelBackend) -> None:
    slots = [backend.make_slot(k) for k in range(2)]
    expected = TorchSlot(RiskWeights.from_seed(0)).run_risk(RAMP)
    results: list[list[float]] = [[], []]

    def serve(k: int) -> None:
        for _ in range(5):
            results[k].append(slots[k].run_risk(RAMP))
            assert slots[k].probe()

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [len(r) for r in results] == [5, 5]
    assert all(r == pytest.approx(expected, abs=1e-5) for rs in results for r in rs)


def test_interpret_slot_keeps_its_buffers_and_allocates_nothing(backend: KernelBackend) -> None:
    slot = backend.make_slot(0)
    assert isinstance(slot, KernelSlot)
    slot.run_risk(RAMP)  # warm up: the interpreter rewrites the kernel once
    ptrs = [b.data_ptrs() for b in slot.buffers()]
    # 100, not 1,000: an interpreted launch costs ~25 ms under the profiler. The torch backend's
    # test (tests/test_compute.py) serves the full 1,000 and also checks for Python leaks.
    assert count_cpu_allocations(lambda: slot.run_risk(RAMP), calls=100) == 0
    assert [b.data_ptrs() for b in slot.buffers()] == ptrs
