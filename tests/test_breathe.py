"""`plane breathe`: verdicts on generated traces with known answers (seeded), the dominant
period found to within a sample, nvidia-smi's exact CSV (header, units, `[N/A]`), a node's
/metrics text, the 10 Hz sampler on a fake clock, and the command end to end on a sample file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plane.observe.breathe import (
    BREATHING,
    BURSTY,
    IDLE,
    INCONCLUSIVE,
    SATURATED,
    STEADY,
    diagnose,
)
from plane.observe.breathe_io import (
    SamplesError,
    parse_nvidia_smi_csv,
    sample,
    utilization_from_metrics,
)

DATA = Path(__file__).parent / "data" / "nvidia-smi-utilization.csv"
PLANE = str(Path(sys.executable).parent / "plane")
T = np.arange(0, 30, 0.1)  # 30 s at 10 Hz


@pytest.fixture
def gen() -> np.random.Generator:
    return np.random.default_rng(20261130)


def square(period_s: float, duty: float, hi: float, lo: float) -> np.ndarray:
    return np.where((T % period_s) < duty * period_s, hi, lo)


@pytest.mark.parametrize("period_s", [0.8, 2.0, 3.3, 7.5])
def test_a_queue_that_fills_and_drains_breathes_at_its_period(
        gen: np.random.Generator, period_s: float) -> None:
    u = np.clip(square(period_s, 0.6, 95, 8) + gen.normal(0, 4, len(T)), 0, 100)
    b = diagnose(T, u)
    assert b.verdict == BREATHING, b
    assert b.period_s == pytest.approx(period_s, abs=0.1)
    assert b.period_strength is not None and b.period_strength > 0.7


def test_a_sawtooth_batcher_breathes(gen: np.random.Generator) -> None:
    b = diagnose(T, 100 * ((T % 1.5) / 1.5))
    assert b.verdict == BREATHING and b.period_s == pytest.approx(1.5, abs=0.1)


def test_steady_load(gen: np.random.Generator) -> None:
    b = diagnose(T, 60 + gen.normal(0, 3, len(T)))
    assert b.verdict == STEADY, b
    assert b.mean_pct == pytest.approx(60, abs=1) and b.std_pct == pytest.approx(3, abs=0.6)


def test_big_swings_without_a_period_are_bursty_not_breathing(gen: np.random.Generator) -> None:
    """Random arrivals (an AR(1) load, 50 seeds of it): never a period."""
    for seed in range(50):
        r = np.random.default_rng(seed)
        x = np.zeros(len(T))
        for i in range(1, len(T)):
            x[i] = 0.8 * x[i - 1] + r.normal(0, 10)
        b = diagnose(T, np.clip(50 + x, 0, 100))
        assert b.verdict == BURSTY, (seed, b)


def test_flat_top_is_saturated(gen: np.random.Generator) -> None:
    b = diagnose(T, np.clip(99 + gen.normal(0, 1.5, len(T)), 0, 100))
    assert b.verdict == SATURATED and b.near_top_share is not None and b.near_top_share > 0.9


def test_idle(gen: np.random.Generator) -> None:
    b = diagnose(T, np.clip(gen.normal(0, 1, len(T)), 0, 100))
    assert b.verdict == IDLE and b.near_zero_share == 1.0


def test_too_few_samples_is_inconclusive() -> None:
    b = diagnose(T[:20], np.full(20, 50.0))
    assert b.verdict == INCONCLUSIVE and b.mean_pct is None and "20 samples" in b.reasons[0]


def test_the_sample_file_in_nvidia_smis_format() -> None:
    text = DATA.read_text()
    assert text.splitlines()[0] == "timestamp, index, utilization.gpu [%]"
    assert text.splitlines()[1].endswith(" %")
    traces = parse_nvidia_smi_csv(text)
    assert sorted(traces) == ["0", "1"]
    assert len(traces["0"].times_s) == 250 and traces["0"].times_s[0] == 0.0
    b0 = diagnose(traces["0"].times_s, traces["0"].util_pct, device="0")
    b1 = diagnose(traces["1"].times_s, traces["1"].util_pct, device="1")
    assert b0.verdict == BREATHING and b0.period_s == pytest.approx(2.0, abs=0.1)
    assert b1.verdict == STEADY


def test_csv_without_header_or_units_and_with_na_rows() -> None:
    text = ("2026/11/30 10:00:00.100, 0, 87\n"
            "2026/11/30 10:00:00.200, 0, [N/A]\n"
            "2026/11/30 10:00:00.300, 0, 12\n")
    tr = parse_nvidia_smi_csv(text)["0"]
    assert tr.util_pct == [87.0, 12.0] and tr.times_s == pytest.approx([0.0, 0.2])


def test_a_bad_timestamp_names_its_line() -> None:
    with pytest.raises(SamplesError, match="line 3"):
        parse_nvidia_smi_csv("timestamp, index, utilization.gpu [%]\n"
                             "2026/11/30 10:00:00.100, 0, 5 %\n10:00, 0, 5 %\n")


def test_utilisation_from_a_nodes_metrics() -> None:
    text = ("# HELP plane_gpu_utilization_ratio x\n# TYPE plane_gpu_utilization_ratio gauge\n"
            'plane_gpu_utilization_ratio{device="0",node="gpu-1"} 0.87\n'
            'plane_gpu_utilization_ratio{device="1",node="gpu-1"} 0.1\n')
    assert utilization_from_metrics(text) == pytest.approx({"gpu-1/0": 87.0, "gpu-1/1": 10.0})
    assert list(utilization_from_metrics(text, device="1")) == ["gpu-1/1"]
    assert utilization_from_metrics("# TYPE plane_gpu_utilization_ratio gauge\n") == {}


def test_the_sampler_reads_at_10_hz_and_skips_failed_reads() -> None:
    now = [0.0]
    calls = [0]

    def read() -> dict[str, float]:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("scrape failed")
        return {"0": float(calls[0])}

    def sleep(s: float) -> None:
        now[0] += s

    traces = sample(read, seconds=1.0, clock=lambda: now[0], sleep=sleep)
    assert calls[0] == 11  # t = 0, 0.1, ... 1.0
    assert traces["0"].times_s == pytest.approx([0.1 * i for i in range(11) if i != 2])


def test_the_command_on_the_sample_file(tmp_path: Path) -> None:
    png = tmp_path / "breathe.png"
    out = subprocess.run([PLANE, "breathe", "--file", str(DATA), "--json", "--out", str(png)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = {b["device"]: b for b in json.loads(out.stdout)}
    assert got["0"]["verdict"] == BREATHING and got["1"]["verdict"] == STEADY
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = subprocess.run([PLANE, "breathe", "--file", str(DATA), "--device", "0"],
                          capture_output=True, text=True, timeout=60).stdout
    assert "BREATHING" in text and "dominant period  2.0" in text and "device 1" not in text


def test_the_command_needs_one_source() -> None:
    out = subprocess.run([PLANE, "breathe"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "one of --file, --metrics, --nvml" in out.stderr


def test_the_command_polls_a_nodes_metrics() -> None:
    """`--metrics`: a /metrics whose GPU swings every second (a node sampling NVML at 10 Hz,
    replayed here: no GPU on this machine)."""
    import http.server
    import threading
    import time

    started = time.monotonic()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            busy = (time.monotonic() - started) % 1.0 < 0.5
            body = ("# TYPE plane_gpu_utilization_ratio gauge\n"
                    f'plane_gpu_utilization_ratio{{device="0",node="gpu-1"}} '
                    f"{0.95 if busy else 0.03}\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        out = subprocess.run([PLANE, "breathe", "--metrics", url, "--seconds", "4", "--json"],
                             capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    b = json.loads(out.stdout)
    assert b["device"] == "gpu-1/0" and b["samples"] >= 30
    assert b["verdict"] == BREATHING and b["period_s"] == pytest.approx(1.0, abs=0.15)


def test_live_nvml_goes_through_the_telemetry_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """--nvml: the node's own NVML reader (gpu_node.telemetry), here a recorded one."""
    from gpu_node.telemetry import GpuSample
    from plane.observe.breathe_cli import read_traces

    readings = iter([87.0, 12.0, None, 90.0, 11.0, 88.0])

    class Recorded:
        closed = False

        def read(self) -> GpuSample:
            return GpuSample(utilization_pct=next(readings, 50.0))

        def close(self) -> None:
            Recorded.closed = True

    monkeypatch.setattr("gpu_node.telemetry.open_nvml", lambda index: Recorded())
    traces = read_traces(path=None, metrics_url=None, nvml=True, device="0", seconds=0.45)
    assert traces["0"].util_pct == [87.0, 12.0, 90.0, 11.0]  # no reading: a gap, not a zero
    assert Recorded.closed
    monkeypatch.setattr("gpu_node.telemetry.open_nvml", lambda index: "NVML did not start")
    with pytest.raises(SamplesError, match="no NVML: NVML did not start"):
        read_traces(path=None, metrics_url=None, nvml=True, device=None, seconds=1)
