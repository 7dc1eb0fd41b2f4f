"""One prepared check of the plane's GPU path: `python scripts/gpu_check.py` from the repo root.

Needs one CUDA GPU and only torch, triton, numpy and nvidia-ml-py (nothing of the NATS stack).
Takes well under 4 minutes (mostly Triton compiling). Prints, in order:

  1. correctness: risk / probe kernels against their torch references on CUDA (awkward
     shapes, zeros, large magnitudes), the calibrated kernel against the requested time, and
     a triton slot against the torch slot;
  2. latency p50/p99 over 1,000 launches per kernel, with the torch reference alongside
     (synchronised before each clock read, warm-up dropped);
  3. SM partitions: the plan, and the SMs each slot's kernels actually ran on;
  4. slot isolation: slot 0's latency alone, then while every other slot is busy;
  5. the pinned round trip of a 128-token payload (and a pageable one, for scale), and the
     allocations made by 1,000 requests on a slot;
  6. one NVML sample.

Exit status: 0 all checks passed, 1 a check failed (listed at the end), 2 no usable GPU.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Slots on plain streams need more hardware queues than the default 8; read at CUDA init.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import numpy as np
import torch
import triton

from gpu_node.compute import TorchSlot
from gpu_node.kernel_backend import KernelBackend, KernelSlot
from gpu_node.partitions import CudaLane, observe_sms
from gpu_node.pinned import Staged
from kernels.calibrated import calibrated
from kernels.launch import interpreting
from kernels.probe import probe, probe_reference
from kernels.risk import FEATURES, RiskWeights, risk, risk_bytes, risk_reference

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
LAUNCHES = 1000
WARMUP = 50
TOKENS = 128
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        failures.append(what)


def section(title: str) -> None:
    print(f"\n== {title} ==")


def pct(samples_us: np.ndarray) -> str:
    p50, p99 = np.percentile(samples_us, [50, 99])
    return f"p50 {p50:8.1f} us  p99 {p99:8.1f} us"


def time_launches(fn: Callable[[], object], n: int = LAUNCHES) -> tuple[np.ndarray, np.ndarray]:
    """Wall time (launch to synchronised) and device time (CUDA events) per call, in us."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(WARMUP):  # compile, caches, clocks: dropped
        fn()
    torch.cuda.synchronize()
    wall, dev = np.empty(n), np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        wall[i] = (time.perf_counter_ns() - t0) / 1e3
        dev[i] = start.elapsed_time(end) * 1e3
    return wall, dev


# --------------------------------------------------------------------------------------------
# 1. correctness
# --------------------------------------------------------------------------------------------


def _weights(n_features: int, n_hidden: int) -> RiskWeights:
    g = torch.Generator().manual_seed(n_features * 1000 + n_hidden)
    return RiskWeights(
        w1=torch.randn(n_features, n_hidden, generator=g) / n_features**0.5,
        b1=torch.randn(n_hidden, generator=g) * 0.1,
        w2=torch.randn(n_hidden, generator=g) / n_hidden**0.5,
        b2=0.25,
    ).to("cuda")


def correctness(backend: KernelBackend) -> None:
    section("1. correctness on CUDA (kernel vs torch reference)")
    g = torch.Generator().manual_seed(0)
    model = RiskWeights.from_seed(0).to("cuda")
    cases = [
        (f"risk batch {b}", model, torch.randn(b, FEATURES, generator=g), 1e-5)
        for b in (1, 3, 7, 13, 16, 100)
    ]
    cases += [
        ("risk 5x19->37 (masked tails)", _weights(19, 37), torch.randn(5, 19, generator=g), 1e-5),
        ("risk 2x33->65 (masked tails)", _weights(33, 65), torch.randn(2, 33, generator=g), 1e-5),
        ("risk zeros", model, torch.zeros(4, FEATURES), 1e-5),
        ("risk x1e3", model, torch.randn(6, FEATURES, generator=g) * 1e3, 1e-4),
        ("risk x-1e6", model, torch.randn(6, FEATURES, generator=g) * -1e6, 1e-4),
    ]
    for name, w, x_cpu, tol in cases:
        x = x_cpu.to("cuda")
        got, want = risk(x, w), risk_reference(x, w)
        torch.cuda.synchronize()
        err = float((got - want).abs().max())
        check(bool(torch.isfinite(got).all()) and err <= tol, f"{name}: max |err| {err:.2e}")
    for n, token in ((1, 1), (37, 12345), (1000, -7)):
        x = torch.arange(n, dtype=torch.int32, device="cuda") * 7919
        out = torch.empty_like(x)
        probe(x, token, out=out)
        check(torch.equal(out, probe_reference(x, token)), f"probe n={n} token={token}")

    out = torch.zeros(8, dtype=torch.int64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calibrated(0, out=out, programs=8)  # compile outside the timing
    for duration_us in (0, 50, 200, 1000, 5000):
        start.record()
        calibrated(duration_us, out=out, programs=8)
        end.record()
        torch.cuda.synchronize()
        spun_us = int(out.min()) / 1e3
        event_us = start.elapsed_time(end) * 1e3
        ok = spun_us >= duration_us and event_us <= duration_us * 1.1 + 50
        check(
            ok,
            f"calibrated {duration_us:5d} us: spun >= {spun_us:8.1f} us, events {event_us:8.1f} us",
        )

    slot, ref = backend.make_slot(0), TorchSlot(RiskWeights.from_seed(0))
    vectors = [[0.0] * FEATURES, [i / 10 for i in range(FEATURES)]]
    vectors += [torch.randn(FEATURES, generator=g).tolist() for _ in range(8)]
    err = max(abs(slot.run_risk(v) - ref.run_risk(v)) for v in vectors)
    check(err <= 1e-5, f"triton slot vs torch slot (10 requests): max |err| {err:.2e}")
    check(all(slot.probe() for _ in range(5)), "triton slot probe x5")


# --------------------------------------------------------------------------------------------
# 2. latency
# --------------------------------------------------------------------------------------------


def latency() -> None:
    section(f"2. latency over {LAUNCHES} launches (wall: launch to synchronised; device: events)")
    w = RiskWeights.from_seed(0).to("cuda")
    x1, x16 = torch.randn(1, FEATURES, device="cuda"), torch.randn(16, FEATURES, device="cuda")
    out = torch.empty(16, device="cuda")
    p_in = torch.arange(256, dtype=torch.int32, device="cuda")
    p_out = torch.empty_like(p_in)
    spun = torch.zeros(8, dtype=torch.int64, device="cuda")
    rows: list[tuple[str, Callable[[], object], int]] = [
        ("risk triton  b=1 ", lambda: risk(x1, w, out=out), risk_bytes(1)),
        ("risk torch   b=1 ", lambda: risk_reference(x1, w), risk_bytes(1)),
        ("risk triton  b=16", lambda: risk(x16, w, out=out), risk_bytes(16)),
        ("risk torch   b=16", lambda: risk_reference(x16, w), risk_bytes(16)),
        ("probe triton n=256", lambda: probe(p_in, 3, out=p_out), 8 * 256),
        ("probe torch  n=256", lambda: probe_reference(p_in, 3), 8 * 256),
        ("calibrated 0 us  ", lambda: calibrated(0, out=spun, programs=8), 64),
        ("calibrated 100 us", lambda: calibrated(100, out=spun, programs=8), 64),
    ]
    for name, fn, nbytes in rows:
        wall, dev = time_launches(fn)
        gbps = nbytes / (np.percentile(dev, 50) * 1e3)
        print(f"  {name}  wall {pct(wall)}  | device {pct(dev)}  {gbps:6.2f} GB/s")


# --------------------------------------------------------------------------------------------
# 3 and 4. partitions and slot isolation
# --------------------------------------------------------------------------------------------


def partitions(backend: KernelBackend, slots: list[KernelSlot]) -> None:
    section("3. SM partitions")
    print(f"  {backend.describe()}")
    sm_count = backend.plan.sm_count
    seen: list[set[int]] = []
    for k, slot in enumerate(slots):
        lane = slot.lane
        assert isinstance(lane, CudaLane)
        seen.append(observe_sms(lane, programs=4 * sm_count))
        print(
            f"  slot {k:2d} ({lane.kind}): kernels ran on {len(seen[-1]):3d} SMs "
            f"{sorted(seen[-1])[:12]}{' ...' if len(seen[-1]) > 12 else ''}"
        )
    shared = sum(len(a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    print(f"  SMs shared between slot pairs: {shared}")
    if backend.partition == "green-context":
        check(shared == 0, "green-context slots run on disjoint SM sets")
        check(
            all(len(s) <= backend.plan.sms_per_slot for s in seen),
            f"each slot stays within its {backend.plan.sms_per_slot} SMs",
        )


def isolation(slots: list[KernelSlot], busy_us: int = 5000, probe_us: int = 200) -> None:
    section(f"4. slot isolation (slot 0 alone, then with {len(slots) - 1} others busy)")
    if len(slots) < 2:
        print("  one slot only: nothing to isolate from")
        return
    features = [i / 10 for i in range(FEATURES)]

    def measure() -> tuple[np.ndarray, np.ndarray, float]:
        cal, rsk = np.empty(300), np.empty(300)
        spun = 0
        for i in range(300):
            t0 = time.perf_counter_ns()
            slots[0].run_calibrated(probe_us)
            cal[i] = (time.perf_counter_ns() - t0) / 1e3
            spun = max(spun, slots[0].spun_ns())
            t0 = time.perf_counter_ns()
            slots[0].run_risk(features)
            rsk[i] = (time.perf_counter_ns() - t0) / 1e3
        return cal[20:], rsk[20:], spun / 1e3

    alone = measure()
    stop = threading.Event()

    def keep_busy(slot: KernelSlot) -> None:
        while not stop.is_set():
            slot.run_calibrated(busy_us)

    threads = [threading.Thread(target=keep_busy, args=(s,), daemon=True) for s in slots[1:]]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        busy = measure()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    for label, (cal, rsk, spun) in (("alone", alone), ("busy ", busy)):
        print(f"  {label}: calibrated {probe_us} us {pct(cal)} (max spun {spun:.1f} us)")
        print(f"  {label}: risk b=1          {pct(rsk)}")
    ratio = np.percentile(busy[0], 50) / np.percentile(alone[0], 50)
    print(f"  calibrated p50 busy/alone: {ratio:.2f}x")


# --------------------------------------------------------------------------------------------
# 5. pinned round trip and allocations
# --------------------------------------------------------------------------------------------


def pinned(slot: KernelSlot) -> None:
    section(f"5. pinned round trip of a {TOKENS}-token payload (int32, {TOKENS * 4} B each way)")
    buf = Staged((TOKENS,), torch.int32, torch.device("cuda"))
    stream, done = torch.cuda.Stream(), torch.cuda.Event()
    tokens = np.arange(TOKENS, dtype=np.int32)

    def pinned_trip() -> None:
        buf.host_np[:] = tokens
        with torch.cuda.stream(stream):
            buf.upload_no_sync()
            buf.download_no_sync()
            done.record(stream)
        done.synchronize()

    pageable = torch.arange(TOKENS, dtype=torch.int32)

    def pageable_trip() -> None:
        pageable.to("cuda").cpu()

    for name, fn in (("pinned  ", pinned_trip), ("pageable", pageable_trip)):
        for _ in range(WARMUP):
            fn()
        samples = np.empty(LAUNCHES)
        for i in range(LAUNCHES):
            t0 = time.perf_counter_ns()
            fn()
            samples[i] = (time.perf_counter_ns() - t0) / 1e3
        print(f"  {name} host->device->host  {pct(samples)}")
    check(bool((buf.host_np == tokens).all()), "pinned payload came back intact")

    features = [i / 10 for i in range(FEATURES)]
    ptrs = [b.data_ptrs() for b in slot.buffers()]
    slot.run_risk(features)
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    for _ in range(1000):
        slot.run_risk(features)
    allocated = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before
    check(allocated == 0, f"1,000 requests on a slot: {allocated} device allocations")
    check([b.data_ptrs() for b in slot.buffers()] == ptrs, "slot buffers unchanged (data_ptr)")


# --------------------------------------------------------------------------------------------
# 6. NVML
# --------------------------------------------------------------------------------------------


def nvml_sample(device: torch.device) -> None:
    section("6. NVML sample")
    try:
        import pynvml
    except ImportError:
        print("  nvidia-ml-py is not installed: no sample")
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        print(f"  NVML did not start: {e}")
        return
    try:
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        try:
            h = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid else None
        except pynvml.NVMLError:
            h = None
        h = h or pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        print(f"  {pynvml.nvmlDeviceGetName(h)}  driver {pynvml.nvmlSystemGetDriverVersion()}")
        print(f"  utilisation gpu {util.gpu}%  memory {util.memory}%")
        print(f"  memory used {mem.used / 2**30:.2f} of {mem.total / 2**30:.2f} GiB")
        for label, read in (
            (
                "temperature C",
                lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            ),
            ("power W", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000),
            ("SM clock MHz", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
        ):
            try:
                print(f"  {label} {read()}")
            except pynvml.NVMLError as e:
                print(f"  {label}: not available ({e})")
    finally:
        pynvml.nvmlShutdown()


# --------------------------------------------------------------------------------------------


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device: this check needs one NVIDIA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    if interpreting():
        print(
            "gpu_check: TRITON_INTERPRET is set: unset it to compile for the GPU", file=sys.stderr
        )
        return EXIT_NO_GPU
    t_start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    print(
        f"{props.name}: {props.multi_processor_count} SMs, compute {props.major}.{props.minor}, "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}"
    )
    backend = KernelBackend(interpret=False, seed=0)
    correctness(backend)
    latency()
    slots = [backend.make_slot(k) for k in range(backend.default_slots())]
    partitions(backend, slots)
    isolation(slots)
    pinned(slots[0])
    nvml_sample(device)
    print(f"\ngpu_check: {time.perf_counter() - t_start:.0f} s, ", end="")
    if failures:
        print(f"{len(failures)} FAILED:\n  " + "\n  ".join(failures))
        return EXIT_FAILED
    print("all checks passed")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
