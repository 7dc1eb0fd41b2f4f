"""GPU telemetry of a node: NVML readings exported as Prometheus gauges, labelled by node and
device, and the partition size that turns a slot's busy time into SM-seconds.

A node that runs on a CUDA device (`triton`) reads NVML every `period_s` (utilisation, SM
clock, memory used, power, temperature, throttle reasons, uncorrected ECC errors, XID errors)
off the event loop (`asyncio.to_thread`: NVML calls block). Without NVML (no `nvidia-ml-py`,
no driver, a CPU node) the node says so once and exports nothing: the metric names are
declared (`plane.contract.metrics`) but carry no sample, never a made-up zero. A reading a
device does not support is left out alone; a read that fails removes the device's series
until one works.

The seam: `GpuReader` (one blocking `read()`), so tests replay recorded readings, and
`NvmlReader` takes the `pynvml` module as an argument, so tests drive the real mapping with a
fake module. `pynvml` itself is imported lazily, in `open_nvml`, and only there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from plane.contract.lifecycle import cancel_and_wait
from plane.contract.metrics import PlaneMetrics

log = structlog.get_logger("plane.telemetry")

DEFAULT_PERIOD_S = 1.0
MIN_PERIOD_S = 0.05

# NVML's clock-throttle reason bits (nvml.h, `nvmlClocksEventReason*`); stable since NVML 5.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal"),
    (0x040, "hw_thermal"),
    (0x080, "hw_power_brake"),
    (0x100, "display_clocks"),
)
XID_CRITICAL_EVENT = 0x0000000000000008  # nvmlEventTypeXidCriticalError


@dataclass(frozen=True, kw_only=True)
class GpuSample:
    """One reading of one device. None: the device does not report it (left out)."""

    utilization_pct: float | None = None  # time a kernel ran, over NVML's own sample period
    sm_clock_mhz: float | None = None
    memory_used_bytes: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    throttle_reasons: int | None = None  # NVML bitmask, see THROTTLE_REASONS
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors since driver load
    xids: tuple[int, ...] = ()  # XID errors reported since the previous reading


class GpuReader(Protocol):
    def read(self) -> GpuSample: ...  # blocking: call it off the event loop

    def close(self) -> None: ...


class NvmlReader:
    """One device through NVML. `nvml` is the `pynvml` module (a fake one in tests)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._h = nvml, handle
        self._events: Any = None
        with contextlib.suppress(Exception):  # XID events: not on every device or driver
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_EVENT, events)
            self._events = events

    def _get(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except self._nvml.NVMLError_NotSupported:
            return None

    def read(self) -> GpuSample:
        n, h = self._nvml, self._h
        util = self._get(lambda: n.nvmlDeviceGetUtilizationRates(h))
        mem = self._get(lambda: n.nvmlDeviceGetMemoryInfo(h))
        power_mw = self._get(lambda: n.nvmlDeviceGetPowerUsage(h))
        return GpuSample(
            utilization_pct=None if util is None else float(util.gpu),
            sm_clock_mhz=self._get(lambda: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
            memory_used_bytes=None if mem is None else int(mem.used),
            power_w=None if power_mw is None else power_mw / 1000,
            temperature_c=self._get(
                lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
            throttle_reasons=self._get(lambda: int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h))),
            ecc_uncorrected=self._get(lambda: int(n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC))),
            xids=self._xids(),
        )

    def _xids(self) -> tuple[int, ...]:
        if self._events is None:
            return ()
        seen: list[int] = []
        for _ in range(64):  # what piled up since the last reading, bounded
            try:
                ev = self._nvml.nvmlEventSetWait_v2(self._events, 0)
            except self._nvml.NVMLError_Timeout:
                break
            seen.append(int(ev.eventData))
        return tuple(seen)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def open_nvml(cuda_index: int, uuid: str | None = None) -> NvmlReader | str:
    """A reader of the device CUDA calls `cuda_index` (found by UUID when torch gave one: NVML
    numbers devices regardless of CUDA_VISIBLE_DEVICES), else why there is none."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"NVML did not start ({exc})"
    try:
        handle = None
        if uuid:
            with contextlib.suppress(pynvml.NVMLError):
                handle = pynvml.nvmlDeviceGetHandleByUUID(
                    uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    except pynvml.NVMLError as exc:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
        return f"NVML has no device {cuda_index} ({exc})"
    return NvmlReader(pynvml, handle)


def cuda_device_of(backend: object) -> tuple[int, str | None] | None:
    """(CUDA index, UUID) of the device a backend computes on; None on a CPU."""
    device = getattr(backend, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    index = int(getattr(device, "index", 0) or 0)
    uuid = None
    with contextlib.suppress(Exception):
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    return index, uuid


def partition_sms(backend: object) -> int:
    """SMs of one slot's partition: what a slot's busy time is multiplied by for SM-seconds.
    A green context confines a slot to them; plain streams do not (the plan's share is then
    nominal). 0 on a CPU: no SM-seconds are exported there."""
    plan = getattr(backend, "plan", None)
    return int(getattr(plan, "sms_per_slot", 0) or 0)


class GpuTelemetry:
    """Samples one device every `period_s` into `metrics` while started (async context
    manager, idempotent start and stop)."""

    def __init__(self, reader: GpuReader, metrics: PlaneMetrics, *, node: str, device: str,
                 period_s: float = DEFAULT_PERIOD_S) -> None:
        if period_s < MIN_PERIOD_S:
            raise ValueError(f"GPU sample period must be at least {MIN_PERIOD_S * 1000:g} ms")
        self.reader, self.metrics, self.period_s = reader, metrics, period_s
        self.labels = (node, device)
        self.samples = 0
        self.last: GpuSample | None = None  # the latest reading (None while reads fail)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def __aenter__(self) -> GpuTelemetry:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="gpu-telemetry")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        await cancel_and_wait(task)
        await asyncio.to_thread(self.reader.close)

    async def _loop(self) -> None:
        while True:
            try:
                sample = await asyncio.to_thread(self.reader.read)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failing:
                    log.warning("NVML read failed: GPU series withdrawn until it works",
                                node=self.labels[0], device=self.labels[1], error=repr(exc))
                self._failing = True
                self.forget()
            else:
                if self._failing:
                    log.info("NVML reads again", node=self.labels[0], device=self.labels[1])
                self._failing = False
                self.export(sample)
            await asyncio.sleep(self.period_s)

    def export(self, s: GpuSample) -> None:
        m, lb = self.metrics, self.labels
        for gauge, value in (
            (m.gpu_utilization, None if s.utilization_pct is None else s.utilization_pct / 100),
            (m.gpu_sm_clock, None if s.sm_clock_mhz is None else s.sm_clock_mhz * 1e6),
            (m.gpu_memory_used, s.memory_used_bytes),
            (m.gpu_power, s.power_w),
            (m.gpu_temperature, s.temperature_c),
            (m.gpu_ecc_uncorrected, s.ecc_uncorrected),
        ):
            if value is not None:
                gauge.labels(*lb).set(value)
        if s.throttle_reasons is not None:
            for bit, reason in THROTTLE_REASONS:
                m.gpu_throttle.labels(*lb, reason).set(1 if s.throttle_reasons & bit else 0)
        xid = m.gpu_xid_errors.labels(*lb)  # present (0) once NVML answered: a true count
        if s.xids:
            xid.inc(len(s.xids))
            log.error("GPU XID error", node=lb[0], device=lb[1], xids=list(s.xids))
        self.samples += 1
        self.last = s

    def forget(self) -> None:
        """Remove this device's series: a value NVML no longer confirms is not exported."""
        self.last = None
        m, lb = self.metrics, self.labels
        for gauge in (m.gpu_utilization, m.gpu_sm_clock, m.gpu_memory_used, m.gpu_power,
                      m.gpu_temperature, m.gpu_ecc_uncorrected):
            with contextlib.suppress(KeyError):
                gauge.remove(*lb)
        for _, reason in THROTTLE_REASONS:
            with contextlib.suppress(KeyError):
                m.gpu_throttle.remove(*lb, reason)


def start_args(backend: object) -> tuple[int, str | None] | str:
    """What telemetry needs from the node's backend, or why it is off."""
    found = cuda_device_of(backend)
    if found is None:
        return f"the {getattr(backend, 'name', '?')} backend runs on the CPU"
    return found


def make_telemetry(backend: object, metrics: PlaneMetrics, *, node: str,
                   period_s: float) -> GpuTelemetry | None:
    """The node's telemetry, or None after saying once (one log line) why there is none."""
    found = start_args(backend)
    reader: NvmlReader | str = found if isinstance(found, str) else open_nvml(*found)
    if isinstance(reader, str):
        log.info("no NVML: GPU telemetry off, no GPU metrics exported", node=node, why=reader)
        return None
    assert not isinstance(found, str)
    log.info("GPU telemetry on", node=node, device=found[0], period_s=period_s)
    return GpuTelemetry(reader, metrics, node=node, device=str(found[0]), period_s=period_s)
