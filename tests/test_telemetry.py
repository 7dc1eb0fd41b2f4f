"""GPU telemetry without a GPU: NVML's answers recorded in a fake `pynvml` module drive the real
reader (`NvmlReader`), the exporter writes exactly what was read (a reading the device does not
support is left out, a failing device withdrawn), a CPU node says "no NVML" once and exports no
GPU sample, and a slot's busy time becomes SM-seconds by its partition's SMs."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from gpu_node.telemetry import (
    THROTTLE_REASONS,
    GpuSample,
    GpuTelemetry,
    NvmlReader,
    cuda_device_of,
    make_telemetry,
    partition_sms,
)
from plane.contract.metrics import PlaneMetrics
from plane.contract.subjects import Header
from tests.plane_fixtures import calibrated, client, plane, status

NODE = "gpu-1"


class NVMLError(Exception):
    pass


class NotSupported(NVMLError):
    pass


class Timeout(NVMLError):
    pass


def fake_pynvml(*, power_supported: bool = True, xids: tuple[int, ...] = ()) -> Any:
    """What an H100's NVML answered (recorded with nvidia-smi -q, rounded), as a module."""
    pending = list(xids)

    def power(h: object) -> int:
        if not power_supported:
            raise NotSupported("power")
        return 312_500  # mW

    def wait(events: object, timeout_ms: int) -> Any:
        if not pending:
            raise Timeout("none")
        return types.SimpleNamespace(eventData=pending.pop(0))

    return types.SimpleNamespace(
        NVMLError=NVMLError, NVMLError_NotSupported=NotSupported, NVMLError_Timeout=Timeout,
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87, memory=41),
        nvmlDeviceGetClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=7 * 2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetTemperature=lambda h, kind: 61,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x004 | 0x040,  # power cap, hw therm
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 0,
        nvmlEventSetCreate=lambda: "events",
        nvmlDeviceRegisterEvents=lambda h, mask, events: None,
        nvmlEventSetWait_v2=wait,
        nvmlEventSetFree=lambda events: None,
        nvmlShutdown=lambda: None,
    )


def samples(metrics: PlaneMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in metrics.registry.collect():
        if fam.name.startswith("plane_gpu"):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_reader_maps_every_nvml_answer() -> None:
    s = NvmlReader(fake_pynvml(xids=(79,)), handle="h").read()
    assert s == GpuSample(utilization_pct=87.0, sm_clock_mhz=1980.0,
                          memory_used_bytes=7 * 2**30, power_w=312.5, temperature_c=61.0,
                          throttle_reasons=0x044, ecc_uncorrected=0, xids=(79,))


def test_a_reading_the_device_does_not_support_is_left_out() -> None:
    reader = NvmlReader(fake_pynvml(power_supported=False), handle="h")
    metrics = PlaneMetrics()
    GpuTelemetry(reader, metrics, node=NODE, device="0").export(reader.read())
    got = samples(metrics)
    lb = (("device", "0"), ("node", NODE))
    assert got[("plane_gpu_utilization_ratio", lb)] == pytest.approx(0.87)
    assert got[("plane_gpu_sm_clock_hertz", lb)] == 1.98e9
    assert got[("plane_gpu_memory_used_bytes", lb)] == 7 * 2**30
    assert got[("plane_gpu_temperature_celsius", lb)] == 61
    assert ("plane_gpu_power_watts", lb) not in got  # never a made-up zero
    throttled = {dict(k[1])["reason"]: v for k, v in got.items()
                 if k[0] == "plane_gpu_throttle"}
    assert throttled == {r: (1.0 if r in ("sw_power_cap", "hw_thermal") else 0.0)
                         for _, r in THROTTLE_REASONS}


class Replay:
    """Recorded readings, one per read; an exception in the list is raised."""

    def __init__(self, readings: list[GpuSample | Exception]) -> None:
        self.readings = readings
        self.closed = False

    def read(self) -> GpuSample:
        r = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        if isinstance(r, Exception):
            raise r
        return r

    def close(self) -> None:
        self.closed = True


async def test_sampling_follows_the_device_and_withdraws_a_failing_one() -> None:
    metrics = PlaneMetrics()
    reader = Replay([GpuSample(utilization_pct=50.0, xids=(48,)),
                     GpuSample(utilization_pct=90.0), RuntimeError("GPU is lost")])
    lb = (("device", "1"), ("node", NODE))
    async with GpuTelemetry(reader, metrics, node=NODE, device="1", period_s=0.05) as tel:
        for _ in range(200):
            if tel.samples >= 2 and ("plane_gpu_utilization_ratio", lb) not in samples(metrics):
                break
            await asyncio.sleep(0.01)
    got = samples(metrics)
    assert tel.samples == 2
    assert ("plane_gpu_utilization_ratio", lb) not in got  # withdrawn once reads fail
    assert got[("plane_gpu_xid_errors_total", lb)] == 1
    assert reader.closed


def test_no_nvml_on_a_cpu_node_is_said_once_and_exports_nothing() -> None:
    metrics = PlaneMetrics()
    backend = types.SimpleNamespace(name="torch", device=types.SimpleNamespace(type="cpu"))
    with capture_logs() as logs:
        assert make_telemetry(backend, metrics, node=NODE, period_s=1.0) is None
    said = [e for e in logs if e["event"].startswith("no NVML")]
    assert len(said) == 1 and "CPU" in said[0]["why"]
    assert samples(metrics) == {}
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE plane_gpu_utilization_ratio gauge" in text  # declared, no sample
    assert "plane_gpu_utilization_ratio{" not in text


def test_no_nvml_on_a_cuda_node_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import fails
    backend = types.SimpleNamespace(name="triton", device=types.SimpleNamespace(type="cuda",
                                                                                index=0))
    with capture_logs() as logs:
        assert make_telemetry(backend, PlaneMetrics(), node=NODE, period_s=1.0) is None
    said = [e for e in logs if e["event"].startswith("no NVML")]
    assert len(said) == 1 and "nvidia-ml-py" in said[0]["why"]


def test_partition_size_and_device_of_a_backend() -> None:
    assert partition_sms(types.SimpleNamespace(plan=types.SimpleNamespace(sms_per_slot=8))) == 8
    assert partition_sms(types.SimpleNamespace(name="torch")) == 0
    assert cuda_device_of(types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))) is None


@pytest.fixture
def four_sm_partitions(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The node's backend says each slot has 4 SMs (as a green-context plan would)."""
    monkeypatch.setattr("gpu_node.node.partition_sms", lambda backend: 4)
    yield


async def test_slot_busy_time_and_sm_seconds(four_sm_partitions: None) -> None:
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        for _ in range(5):
            m = await nc.request("plane.infer.calibrated", calibrated(20_000), timeout=5)
            assert status(m) == 200
        reg = stack.metrics.registry
        labels = {"model": "calibrated", "node": "node0-calibrated", "slot": "0"}
        busy = reg.get_sample_value("plane_slot_busy_seconds_total", labels)
        sm = reg.get_sample_value("plane_slot_sm_seconds_total", labels)
    assert busy is not None and 0.1 <= busy < 1.0  # 5 x 20 ms, plus the slot's overhead
    assert sm == pytest.approx(4 * busy)


async def test_two_nodes_of_one_model_export_their_slot_0_apart() -> None:
    """Two nodes of one model (a `--processes` group's members, here in one process and one
    registry) both have a slot 0: each one's series carry its node id, so neither hides the
    other's (nor does a scrape that holds both, `plane up`'s, add them up)."""
    async with plane(models=("calibrated",), slots=1, nodes_per_model=2) as stack, \
            client(stack.url) as nc:
        served: set[str] = set()
        for _ in range(10):  # two at once on two slots: each node runs one
            replies = await asyncio.gather(*(
                nc.request("plane.infer.calibrated", calibrated(20_000), timeout=5)
                for _ in range(2)))
            served |= {(m.headers or {})[Header.NODE] for m in replies if status(m) == 200}
            if len(served) == 2:
                break
        reg = stack.metrics.registry
        nodes = [node.cfg.node_id for node in stack.nodes]
        for node in nodes:
            labels = {"model": "calibrated", "node": node, "slot": "0"}
            assert reg.get_sample_value("plane_slot_healthy", labels) == 1.0, node
            busy = reg.get_sample_value("plane_slot_busy_seconds_total", labels)
            assert busy is not None and busy > 0, node
            count = reg.get_sample_value("plane_slot_service_seconds_count",
                                         {"model": "calibrated", "node": node})
            assert count is not None and count >= 1, node
    assert served == set(nodes)
