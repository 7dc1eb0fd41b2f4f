"""One prepared check of the plane's GPU path: `python scripts/gpu_check.py` from the repo root.

Needs one CUDA GPU and only torch, triton, numpy and nvidia-ml-py (nothing of the NATS stack).
Takes well under 4 minutes (mostly Triton compiling). Prints, in order:

  1. correctness: risk / probe kernels against their torch references on CUDA (awkward
     shapes, zeros, large magnitudes), the calibrated kernel against the requested time, a
     triton slot against the torch slot, and its risk request as one CUDA graph (timed
     against its launches);
  2. latency p50/p99 over 1,000 launches per kernel, with the torch reference alongside
     (wall: synchronised before each clock read; device: events behind a cover kernel, so
     the host's launch is not counted; warm-up dropped);
  3. SM partitions: the plan (the driver's disjoint groups, one green context each), and the
     SMs each slot's kernels actually ran on;
  4. slot isolation: slot 0's latency alone, then while every other slot is busy;
  5. the pinned round trip of a 128-token payload (and a pageable one, for scale), and the
     allocations made by 1,000 requests on a slot;
  6. one NVML sample;
  7. tinylm: the decode-attention kernel against its reference (awkward shapes), the kernel
     path's bytes against the torch path's on CUDA and on the CPU (greedy and seeded), the
     decode step as one CUDA graph (its bytes against the launches'), and per-token decode
     time p50/p99 over 256-token streams: graph, kernel path's launches, torch path.

Exit status: 0 all checks passed, 1 a check failed (listed at the end), 2 no usable GPU.
"""

from __future__ import annotations

import dataclasses
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
from kernels.decode_attention import (
    TorchAttention,
    decode_attention,
    decode_attention_bytes,
    decode_attention_reference,
)
from kernels.launch import interpreting
from kernels.probe import probe, probe_reference
from kernels.risk import FEATURES, RiskWeights, risk, risk_bytes, risk_reference
from kernels.tinylm import END, GenState, TinyLM, TinyLMWeights

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
    """Wall time (launch to synchronised) and device time (CUDA events) per call, in us.

    The device time is taken in a second loop (DeviceTimer): otherwise the events would also
    time the host's launch."""
    timer = DeviceTimer()
    for _ in range(WARMUP):  # compile, caches, clocks: dropped
        fn()
    torch.cuda.synchronize()
    wall, dev = np.empty(n), np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        wall[i] = (time.perf_counter_ns() - t0) / 1e3
    for i in range(n):
        dev[i] = timer(fn)
    return wall, dev


def wall_us(fn: Callable[[], object], n: int = LAUNCHES) -> np.ndarray:
    """Wall µs of `n` calls of `fn`, each of which returns only once its work is done, after
    WARMUP calls dropped."""
    for _ in range(WARMUP):
        fn()
    samples = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples[i] = (time.perf_counter_ns() - t0) / 1e3
    return samples


class DeviceTimer:
    """The device time of what a call launches, in us, host launch time excluded: a cover
    kernel keeps the GPU busy while the host launches, so the events time the work alone."""

    COVER_US = 300  # longer than any host launch

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.cover = torch.zeros(1, dtype=torch.int64, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        calibrated(self.COVER_US, out=self.cover, programs=1)
        self.start.record()
        fn()
        self.end.record()
        torch.cuda.synchronize()
        return float(self.start.elapsed_time(self.end) * 1e3)


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
    timer = DeviceTimer()
    calibrated(0, out=out, programs=8)  # compile outside the timing
    for duration_us in (0, 50, 200, 1000, 5000):
        # The median of 5, each timed by DeviceTimer: the kernel's own time.
        spun, events = [], []
        for _ in range(5):
            events.append(timer(lambda d=duration_us: calibrated(d, out=out, programs=8)))
            spun.append(int(out.min()) / 1e3)
        spun_us, event_us = min(spun), float(np.median(events))
        ok = spun_us >= duration_us and event_us <= duration_us * 1.05 + 20
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
    check(slot.risk_graph is not None, f"a slot runs a risk request as one CUDA graph "
                                       f"({slot.risk_path})")  # fmt: skip
    check(slot.calibrated_graph is not None, f"a slot runs a calibrated request as one CUDA "
                                             f"graph ({slot.calibrated_path})")  # fmt: skip
    spun_ok = True
    for duration_us in (0, 30, 300, 3000):
        slot.run_calibrated(duration_us)
        spun_ok &= duration_us * 1000 <= slot.spun_ns() < duration_us * 1000 + 1_000_000
    check(spun_ok, "the calibrated graph spins for each duration it is given (0-3000 us)")
    features = [i / 10 for i in range(FEATURES)]
    risk_graph, cal_graph = slot.risk_graph, slot.calibrated_graph
    for what, run in (("risk", lambda: slot.run_risk(features)),
                      ("calibrated 0 us", lambda: slot.run_calibrated(0))):  # fmt: skip
        for label, graphs in (("graph", (risk_graph, cal_graph)), ("launches", (None, None))):
            slot.risk_graph, slot.calibrated_graph = graphs
            print(f"  slot {what} request, {label:8s}: wall {pct(wall_us(run))} "
                  "(in, run, wait, out)")  # fmt: skip
    slot.risk_graph, slot.calibrated_graph = risk_graph, cal_graph


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
    check(backend.partition == "green-context",
          "slots have SMs of their own (green contexts; the plan above says why not)")
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

    def measure() -> tuple[np.ndarray, np.ndarray, float, float]:
        cal, rsk = np.empty(300), np.empty(300)
        spun = 0
        cpu0 = time.process_time()
        for i in range(300):
            t0 = time.perf_counter_ns()
            slots[0].run_calibrated(probe_us)
            cal[i] = (time.perf_counter_ns() - t0) / 1e3
            spun = max(spun, slots[0].spun_ns())
            t0 = time.perf_counter_ns()
            slots[0].run_risk(features)
            rsk[i] = (time.perf_counter_ns() - t0) / 1e3
        # The whole process's CPU over the run (the busy slots' threads too), per 2 requests.
        cpu_ms = (time.process_time() - cpu0) * 1e3
        return cal[20:], rsk[20:], spun / 1e3, cpu_ms

    def alone_then_busy() -> list[tuple[str, tuple[np.ndarray, np.ndarray, float, float]]]:
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
        return [("alone", alone), ("busy ", busy)]

    lanes = [s.lane for s in slots if isinstance(s.lane, CudaLane)]
    for blocking in (True, False):  # the node's waits sleep; spinning for comparison
        for lane in lanes:
            lane.blocking = blocking
        print(f"  waits {'sleep (the node)' if blocking else 'spin (for comparison)'}:")
        runs = alone_then_busy()
        for label, (cal, rsk, spun, cpu_ms) in runs:
            print(f"    {label}: calibrated {probe_us} us {pct(cal)} (max spun {spun:.1f} us); "
                  f"process CPU {cpu_ms:.0f} ms")  # fmt: skip
            print(f"    {label}: risk b=1          {pct(rsk)}")
        ratio = np.percentile(runs[1][1][0], 50) / np.percentile(runs[0][1][0], 50)
        print(f"    calibrated p50 busy/alone: {ratio:.2f}x")
    for lane in lanes:
        lane.blocking = True


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
        print(f"  {name} host->device->host  {pct(wall_us(fn))}")
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
# 7. tinylm
# --------------------------------------------------------------------------------------------

# (heads, context, head_dim, pos): the model's shape at the first, second, a middle and the last
# position, then head dims that are not powers of two and caches that are not a multiple of
# the kernel's block of rows (as tests/test_tinylm.py, there in the interpreter).
TINYLM_ATTENTION_SHAPES = [
    (4, 256, 32, 0), (4, 256, 32, 1), (4, 256, 32, 37), (4, 256, 32, 255),
    (3, 50, 24, 49), (1, 7, 5, 6), (2, 70, 64, 33),
]  # fmt: skip
TINYLM_PROMPTS = [b"", b"a", b"The plane streams tokens.", bytes(range(0, 256, 7)), b"x" * 200]
TINYLM_STREAM_TOKENS = 256  # timed tokens per path: one stream of 16 + 240, then more


def _generate(lm: TinyLM, prompt: bytes, max_tokens: int, temperature: float, seed: int,
              state: GenState | None = None) -> bytes:  # fmt: skip
    s = lm.start(prompt, max_tokens, temperature, seed, state=state)
    return bytes(iter(lambda: lm.step(s), None))


def _per_token_us(lm: TinyLM, tokens: int, sync: Callable[[], None],
                  state: GenState | None = None) -> np.ndarray:  # fmt: skip
    """Wall µs of `tokens` steps that decode (a stream's last step does not), after one
    dropped warm-up stream; `step` itself returns only once its logits are on the host."""
    state, stream = state or lm.new_state(), 0
    samples: list[float] = []
    while len(samples) < tokens:
        lm.start(b"abcdefghijklmnop", 240, 0.8, seed=stream, state=state)
        sync()
        while True:
            t0 = time.perf_counter_ns()
            lm.step(state)
            sync()
            if state.finish is not None:
                break
            if stream:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
        stream += 1
    return np.array(samples[:tokens])


def tinylm_section(device: torch.device) -> None:
    section("7. tinylm: decode attention, bytes across paths and devices, per-token time")
    for n_heads, context, head_dim, pos in TINYLM_ATTENTION_SHAPES:
        g = torch.Generator().manual_seed(pos)
        qkv = torch.randn(3 * n_heads * head_dim, generator=g).to(device)
        k_cache = torch.randn(n_heads, context, head_dim, generator=g).to(device)
        v_cache = torch.randn(n_heads, context, head_dim, generator=g).to(device)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        want = decode_attention_reference(qkv, k_ref, v_ref, pos)
        got = decode_attention(qkv, k_cache, v_cache, pos, out=torch.empty_like(want))
        err = float((got - want).abs().max())
        same_cache = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        check(
            err <= 1e-5 and same_cache,
            f"decode attention H={n_heads} T={context} HD={head_dim} pos={pos}: "
            f"max |err| {err:.2e}, cache {'as the reference' if same_cache else 'DIFFERS'}",
        )

    # END masked so that every stream runs its full length (and the timed ones too).
    w = TinyLMWeights.from_seed(0)
    no_end = dataclasses.replace(w, head_bias=w.head_bias.index_fill(0, torch.tensor(END), -1e9))
    kernel = TinyLM(no_end, device, use_kernel=True)
    torch_path = TinyLM(no_end, device, use_kernel=False)
    cpu = TinyLM(no_end, torch.device("cpu"), use_kernel=False)
    for prompt in TINYLM_PROMPTS:
        ref_s, ker_s = torch_path.start(prompt, 48), kernel.start(prompt, 48)
        err, same = 0.0, True
        while (token := torch_path.step(ref_s)) is not None:
            same &= kernel.step(ker_s) == token
            if ref_s.finish is None:
                err = max(err, float((ker_s.logits - ref_s.logits).abs().max()))
        as_cpu = _generate(kernel, prompt, 48, 0.0, 0) == _generate(cpu, prompt, 48, 0.0, 0)
        check(
            same and as_cpu and err <= 1e-4,
            f"tinylm greedy, {len(prompt):3d}-byte prompt: kernel path's 48 bytes "
            f"{'==' if same else '!='} torch path's, {'==' if as_cpu else '!='} the CPU's; "
            f"max |logits err| {err:.2e}",
        )
    for temperature, seed in ((0.7, 1), (1.0, 2), (1.5, 3)):
        streams = {
            _generate(lm, b"Once upon a time", 64, temperature, seed)
            for lm in (kernel, torch_path, cpu)
        }
        check(
            len(streams) == 1,
            f"tinylm T={temperature} seed={seed}: the same 64 bytes on kernel, torch and CPU",
        )

    on_cuda = device.type == "cuda"
    paths: list[tuple[str, TinyLM, GenState | None]] = [
        ("kernel path  ", kernel, None), ("torch path   ", torch_path, None)]  # fmt: skip
    if on_cuda:
        graphed = kernel.new_state()
        with torch.cuda.stream(torch.cuda.Stream()):  # as a slot does: on its own stream
            how = kernel.capture(graphed)
        check(graphed.graph is not None, f"tinylm kernel path: a decode step is one CUDA graph "
                                         f"({how})")  # fmt: skip
        for prompt in TINYLM_PROMPTS[1:3]:
            for temperature, seed in ((0.0, 0), (0.9, 5)):
                eager = _generate(kernel, prompt, 64, temperature, seed)
                replayed = _generate(kernel, prompt, 64, temperature, seed, state=graphed)
                check(eager == replayed, f"tinylm graph, {len(prompt)}-byte prompt, "
                                         f"T={temperature}: the launches' 64 bytes")  # fmt: skip
        paths.insert(0, ("kernel, graph", kernel, graphed))
    sync: Callable[[], None] = torch.cuda.synchronize if on_cuda else (lambda: None)
    print(f"  per-token decode, {TINYLM_STREAM_TOKENS} tokens (wall: step to logits on host):")
    for name, lm, state in paths:
        print(f"  tinylm {name}  {pct(_per_token_us(lm, TINYLM_STREAM_TOKENS, sync, state))}")
    if not on_cuda:
        return
    for name, lm in (("kernel path", kernel), ("torch path", torch_path)):
        state = lm.start(b"alloc", 240, 0.8, seed=1)
        lm.step(state)
        before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        for _ in range(200):
            lm.step(state)
        allocated = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before
        what = f"tinylm {name}: 200 steps, {allocated} device allocations"
        if lm is kernel:  # the serving path on CUDA; the torch path's count is for scale
            check(allocated == 0, what)
        else:
            print(f"  {what}")
    c, state, pos = kernel.config, kernel.new_state(), 200
    qkv = torch.randn(3 * c.d_model, device=device)
    k_cache, v_cache, att = state.k_cache[0], state.v_cache[0], state.att
    twin = TorchAttention(c.n_heads, c.context, device)
    nbytes = decode_attention_bytes(pos, c.n_heads, c.head_dim)
    for name, fn in (
        ("triton", lambda: decode_attention(qkv, k_cache, v_cache, pos, out=att)),
        ("torch ", lambda: twin(qkv, k_cache, v_cache, pos, out=att)),
    ):
        wall, dev = time_launches(fn)
        gbps = nbytes / (np.percentile(dev, 50) * 1e3)
        print(
            f"  attention {name} pos {pos}  wall {pct(wall)}  | device {pct(dev)}  {gbps:6.2f} GB/s"
        )


# --------------------------------------------------------------------------------------------


def device_waits(slot: KernelSlot, n: int = 200, duration_us: int = 2000) -> None:
    """Requests launched and awaited on an event loop (`gpu_node.device_wait`), as a node's
    slot serves them by default, against the slot thread's way (launch and synchronise)."""
    import asyncio

    from gpu_node.device_wait import CALIBRATED, RISK, LoopTimer, finished

    section(f"8. device work awaited on the event loop ({n} calibrated {duration_us} us, "
            f"{n} risk)")
    print(f"  slot 0: {slot.request_paths()}")
    check(slot.launches == {RISK, CALIBRATED},
          "the warm-up check of launched work passed (awaited on the loop)")
    if slot.launches != {RISK, CALIBRATED}:
        return
    row = [((i * 29) % 17 - 8) / 6 for i in range(FEATURES)]
    want = slot.run_risk(row)
    thread_us = wall_us(lambda: slot.run_calibrated(duration_us), n)

    async def on_loop() -> tuple[np.ndarray, list[float]]:
        timer = LoopTimer()
        took, scores = [], []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                await finished(slot.start_calibrated(duration_us), timer)
                took.append((time.perf_counter() - t0) * 1e6)
                await finished(slot.start_risk(row), timer)
                scores.append(slot.risk_score())
        finally:
            timer.close()
        return np.array(took), scores

    loop_us, scores = asyncio.run(on_loop())
    print(f"  calibrated, launch to done: slot's way {pct(thread_us)}; on the loop "
          f"{pct(loop_us)}")
    check(all(x == want for x in scores), "risk launched and awaited on the loop scores as "
          "run_risk does, every time")
    check(float(np.min(loop_us)) >= duration_us, "no loop wait ends before its work")


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
    tinylm_section(device)
    device_waits(slots[0])
    print(f"\ngpu_check: {time.perf_counter() - t_start:.0f} s, ", end="")
    if failures:
        print(f"{len(failures)} FAILED:\n  " + "\n  ".join(failures))
        return EXIT_FAILED
    print("all checks passed")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
