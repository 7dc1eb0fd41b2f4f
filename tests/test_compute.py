"""The compute seam on the CPU: backend choice, the torch slot, pinned buffers, partition
planning, and scripts/gpu_check.py's refusal without a GPU."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from gpu_node.compute import FEATURES, RiskWeights, TorchSlot, make_backend, risk_reference
from gpu_node.node import Node
from gpu_node.partitions import (
    GREEN_CONTEXT,
    STREAM,
    HostLane,
    green_partitions,
    partition_granularity,
    plan_partitions,
)
from gpu_node.pinned import RowPacker, Staged, count_cpu_allocations
from plane.contract import messages
from plane.contract.config import ConnectOptions, NodeConfig
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import ConfigError
from plane.contract.natsconn import close, connect

REPO = Path(__file__).resolve().parents[1]
# Scores of the seeded model before kernels/ existed: the weights must not drift.
GOLDEN = {
    0: (0.5189365148544312, 0.7540954947471619),
    1: (0.44549989700317383, 0.11059587448835373),
}
RAMP = [i / 10 for i in range(FEATURES)]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_kernel_features_match_the_wire_contract() -> None:
    assert FEATURES == messages.FEATURES


# --------------------------------------------------------------------------------------------
# torch backend
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", sorted(GOLDEN))
def test_torch_slot_keeps_the_seeded_scores(seed: int) -> None:
    slot = make_backend("torch", seed=seed).make_slot(0)
    zeros, ramp = GOLDEN[seed]
    assert slot.run_risk([0.0] * FEATURES) == pytest.approx(zeros, abs=1e-6)
    assert slot.run_risk(RAMP) == pytest.approx(ramp, abs=1e-6)


def test_torch_slot_matches_the_reference() -> None:
    w = RiskWeights.from_seed(4)
    slot = TorchSlot(w)
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        x = torch.randn(1, FEATURES, generator=g) * 3
        assert slot.run_risk(x[0].tolist()) == pytest.approx(
            float(risk_reference(x, w)[0]), abs=1e-6
        )


def test_torch_slot_calibrated_waits_and_probe_passes() -> None:
    slot = make_backend("torch").make_slot(0)
    t0 = time.perf_counter()
    slot.run_calibrated(20_000)
    assert time.perf_counter() - t0 >= 0.019
    assert slot.probe() is True


def test_torch_slot_refuses_features_it_cannot_score() -> None:
    slot = make_backend("torch").make_slot(0)
    with pytest.raises(ValueError, match="expected 32"):
        slot.run_risk([0.0] * 31)
    with pytest.raises(ValueError, match="float32"):
        slot.run_risk([1e39] + [0.0] * 31)


def test_torch_slot_allocates_nothing_per_request() -> None:
    slot = TorchSlot(RiskWeights.from_seed(0))
    features = RAMP
    slot.run_risk(features)  # warm up
    ptrs = [b.data_ptrs() for b in slot.buffers()]
    assert count_cpu_allocations(lambda: slot.run_risk(features), calls=1000) == 0
    tracemalloc.start()
    try:
        gc.collect()  # count what is kept, not cycles awaiting collection
        before = tracemalloc.take_snapshot()
        for _ in range(1000):
            slot.run_risk(features)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert growth < 16 * 1024, f"{growth} bytes kept after 1,000 requests"
    assert [b.data_ptrs() for b in slot.buffers()] == ptrs


def test_the_allocation_counter_sees_per_request_tensors() -> None:
    # The test above can fail: the counter catches the old path, which made tensors per call.
    w = RiskWeights.from_seed(0)

    def allocating() -> float:
        x = torch.as_tensor(RAMP, dtype=torch.float32)[None, :]
        return float(risk_reference(x, w)[0])

    assert count_cpu_allocations(allocating, calls=10) >= 10


# --------------------------------------------------------------------------------------------
# make_backend
# --------------------------------------------------------------------------------------------


@no_gpu
def test_auto_is_torch_without_a_gpu() -> None:
    backend = make_backend("auto")
    assert (backend.name, backend.partition, backend.default_slots()) == ("torch", "none", 2)
    assert "torch" in backend.describe()


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--backend must be one of"):
        make_backend("cuda")


@no_gpu
def test_triton_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        make_backend("triton")


def test_interpret_without_the_variable_says_to_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        make_backend("interpret")


def test_interpret_after_triton_was_imported_without_it_says_why() -> None:
    code = (
        "import os, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from gpu_node.compute import make_backend\n"
        "from plane.contract.errors import ConfigError\n"
        "try:\n    make_backend('interpret')\n"
        "except ConfigError as e:\n    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert "refused:" in done.stdout and "imported before" in done.stdout, done.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# Pinned buffers and lanes on the CPU
# --------------------------------------------------------------------------------------------


def test_staged_buffers_are_one_tensor_off_cuda() -> None:
    buf = Staged((2, 3), torch.float32, torch.device("cpu"))
    assert buf.host is buf.dev and not buf.host.is_pinned()
    buf.host_np[1, 2] = 5.0  # the numpy view writes the tensor's own memory
    buf.upload_no_sync()
    buf.download_no_sync()
    assert float(buf.dev[1, 2]) == 5.0


def test_row_packer_writes_row_zero_in_place() -> None:
    buf = Staged((4, 3), torch.float32, torch.device("cpu"))
    ptr = buf.host.data_ptr()
    RowPacker(buf, 3).pack([1, 2.5, -3])
    assert buf.host[0].tolist() == [1.0, 2.5, -3.0] and buf.host[1:].abs().sum() == 0
    assert buf.host.data_ptr() == ptr
    with pytest.raises(ValueError, match="not a float"):
        RowPacker(buf, 3).pack(["x", 1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="rows of 5"):
        RowPacker(buf, 5)


def test_host_lane_is_synchronous() -> None:
    lane = HostLane()
    with lane.stream_context():
        lane.record_done()
    lane.wait()
    assert lane.kind == "none"


# --------------------------------------------------------------------------------------------
# Partition planning (pure)
# --------------------------------------------------------------------------------------------


def test_h200_defaults_to_sixteen_slots_of_eight_sms() -> None:
    plan = plan_partitions(sm_count=132, cc_major=9, sms_per_slot=None, green=True, note="ok")
    assert (plan.kind, plan.sms_per_slot, plan.slots) == (GREEN_CONTEXT, 8, 16)
    assert plan.describe().startswith("16 slots x 8 of 132 SMs, green-context")


def test_a_plan_describes_the_slots_a_node_runs_not_only_its_default() -> None:
    plan = plan_partitions(sm_count=132, cc_major=9, sms_per_slot=None, green=True, note="ok")
    assert plan.describe(16) == plan.describe()
    assert plan.describe(1).startswith(
        "1 slot (the device's default: 16) x 8 of 132 SMs, green-context")


def test_the_torch_backend_describes_the_slots_a_node_runs() -> None:
    """Was "torch on cpu: 2 slots, one thread each" whatever the node ran."""
    backend = make_backend("torch")
    assert backend.describe() == "torch on cpu: 2 slots, one thread each"
    assert backend.describe(1) == "torch on cpu: 1 slot, one thread each"
    assert backend.describe(5) == "torch on cpu: 5 slots, one thread each"


@pytest.mark.parametrize(("model", "slots"), [("calibrated", 1), ("tinylm", None)])
async def test_a_nodes_start_up_log_says_one_slot_count(
        nats_server: EmbeddedNats, model: str, slots: int | None) -> None:
    """`plane node --slots 1` (and tinylm's one slot on a CPU, its default) logged
    `"slots": 1` beside `"choice": "torch on cpu: 2 slots, one thread each"`."""
    nc = await connect(ConnectOptions(url=nats_server.url, name="describe-test"))
    node = Node(nc, NodeConfig(model=model, node_id="n-describe", slots=slots,
                               backend="torch"))
    try:
        with capture_logs() as logs:
            await node.start()
        [started] = [e for e in logs if e["event"] == "node started"]
        assert started["slots"] == 1
        assert started["choice"] == "torch on cpu: 1 slot, one thread each"
    finally:
        await node.stop()
        await close(nc)


@pytest.mark.parametrize(
    ("cc_major", "asked", "size", "slots"),
    [
        (9, 12, 16, 8),
        (9, 3, 8, 16),
        (9, 132, 136, None),
        (8, 3, 4, 27),
        (8, 7, 8, 13),
        (7, 1, 2, 54),
    ],
)
def test_sms_per_slot_rounds_up_to_the_hardware_granularity(
    cc_major: int, asked: int, size: int, slots: int | None
) -> None:
    sm_count = 132 if cc_major == 9 else 108
    if slots is None:
        with pytest.raises(ValueError, match="more than the GPU's"):
            plan_partitions(
                sm_count=sm_count, cc_major=cc_major, sms_per_slot=asked, green=False, note=""
            )
        return
    plan = plan_partitions(
        sm_count=sm_count, cc_major=cc_major, sms_per_slot=asked, green=False, note="streams"
    )
    assert (plan.kind, plan.sms_per_slot, plan.slots) == (STREAM, size, slots)
    assert ("rounded up" in plan.note) == (size != asked)


def test_partition_granularity_follows_the_driver_guideline() -> None:
    assert [partition_granularity(m) for m in (6, 7, 8, 9, 10, 12)] == [
        (2, 2),
        (2, 2),
        (4, 2),
        (8, 8),
        (8, 8),
        (8, 8),
    ]
    with pytest.raises(ValueError, match="at least 1"):
        plan_partitions(sm_count=132, cc_major=9, sms_per_slot=0, green=False, note="")


def test_sms_per_slot_off_a_gpu_is_said_to_be_ignored() -> None:
    with capture_logs() as logs:
        backend = make_backend("torch", sms_per_slot=16)
    assert backend.name == "torch"
    assert [(e["event"], e["backend"], e["sms_per_slot"]) for e in logs] == [
        ("--sms-per-slot ignored: it sizes a GPU's SM partitions", "torch", 16)]
    with capture_logs() as logs:
        make_backend("torch")
    assert logs == []


def test_green_partitions_without_a_gpu_say_why_and_leave_plain_streams() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.py checks the split itself")
    parts, why = green_partitions(0, 8, 16, 132)
    assert parts is None
    assert why.startswith("green contexts failed (") and why.endswith("; plain streams"), why


CUDA_H = sorted(Path("/usr/local").glob("cuda*/include/cuda.h"))


@pytest.mark.skipif(not CUDA_H or not shutil.which("cc"), reason="no cuda.h or C compiler here")
def test_the_ctypes_sm_resource_matches_cuda_h(tmp_path: Path) -> None:
    # The one thing ctypes cannot check at run time: CUdevResource's size (the stride of the
    # split's result array) and where its SM count lies. Compiled against the toolkit's header.
    import ctypes

    from gpu_node import sm_split

    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n"
        "int main(void) { printf(\"%zu %zu %d %d\", sizeof(CUdevResource),"
        " offsetof(CUdevResource, sm.smCount), CU_DEV_RESOURCE_TYPE_SM,"
        " CU_GREEN_CTX_DEFAULT_STREAM); return 0; }\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(["cc", f"-I{CUDA_H[-1].parent}", str(src), "-o", str(exe)], check=True)
    size, offset, sm_type, default_stream = map(int, subprocess.check_output([str(exe)]).split())
    assert size == sm_split.RESOURCE_BYTES == ctypes.sizeof(sm_split._SmResource)
    assert offset == sm_split._SmResource.sm_count.offset
    assert (sm_type, default_stream) == (
        sm_split.CU_DEV_RESOURCE_TYPE_SM, sm_split.CU_GREEN_CTX_DEFAULT_STREAM)


# --------------------------------------------------------------------------------------------
# scripts/gpu_check.py without a GPU
# --------------------------------------------------------------------------------------------


@no_gpu
def test_gpu_check_imports_without_the_plane_stack_and_refuses_without_cuda() -> None:
    # msgspec, nats and structlog are made unimportable: the check must not need them.
    code = (
        "import runpy, sys\n"
        "for name in ('msgspec', 'nats', 'structlog'):\n    sys.modules[name] = None\n"
        "sys.argv = ['scripts/gpu_check.py']\n"
        "runpy.run_path('scripts/gpu_check.py', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "no CUDA device" in done.stdout + done.stderr
