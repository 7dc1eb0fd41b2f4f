"""Where `plane breathe` gets its samples (an nvidia-smi CSV file, a node's /metrics, NVML
itself), how it reports (text, JSON) and its picture. The diagnosis is `plane.observe.breathe`.

The file format is what `nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv
-lms 100` prints, header and units included:

    timestamp, index, utilization.gpu [%]
    2026/11/30 10:00:00.100, 0, 87 %

(`--format=csv,noheader,nounits` is read too; rows of `[N/A]` are skipped.)
"""

from __future__ import annotations

import csv
import io
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from plane.observe.breathe import Breath

SMI_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
UTIL_METRIC = "plane_gpu_utilization_ratio"


class SamplesError(ValueError):
    """The samples could not be read: the message says what to fix."""


@dataclass
class Trace:
    """One device's samples: seconds from the first sample, utilisation in %."""

    device: str
    times_s: list[float] = field(default_factory=list)
    util_pct: list[float] = field(default_factory=list)

    def add(self, t_s: float, pct: float) -> None:
        self.times_s.append(t_s)
        self.util_pct.append(pct)


def _number(cell: str) -> float | None:
    cell = cell.strip().removesuffix("%").strip()
    try:
        return float(cell)
    except ValueError:
        return None  # [N/A], [Not Supported], an empty cell


def parse_nvidia_smi_csv(text: str) -> dict[str, Trace]:
    """Traces by device index from nvidia-smi's CSV (see the module doc)."""
    rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if r]
    if rows and rows[0] and rows[0][0].strip().lower() == "timestamp":
        header = [h.strip().lower() for h in rows[0]]
        rows = rows[1:]
        try:
            ti, di = header.index("timestamp"), header.index("index")
            ui = next(i for i, h in enumerate(header) if h.startswith("utilization.gpu"))
        except (ValueError, StopIteration):
            raise SamplesError(
                f"CSV header {rows and ','.join(header)!r}: need timestamp, index and "
                "utilization.gpu (nvidia-smi --query-gpu=timestamp,index,utilization.gpu "
                "--format=csv -lms 100)") from None
    else:
        ti, di, ui = 0, 1, 2
    traces: dict[str, Trace] = {}
    t0: datetime | None = None
    for n, row in enumerate(rows, start=2):
        if len(row) <= max(ti, di, ui):
            raise SamplesError(f"line {n}: {len(row)} columns, expected {max(ti, di, ui) + 1}")
        try:
            stamp = datetime.strptime(row[ti].strip(), SMI_TIME_FORMAT)
        except ValueError:
            raise SamplesError(f"line {n}: timestamp {row[ti].strip()!r} is not "
                               "YYYY/MM/DD HH:MM:SS.mmm (nvidia-smi's format)") from None
        pct = _number(row[ui])
        if pct is None:
            continue
        t0 = t0 or stamp
        device = row[di].strip()
        traces.setdefault(device, Trace(device)).add((stamp - t0).total_seconds(), pct)
    if not traces:
        raise SamplesError("no utilisation samples in the file")
    return traces


def utilization_from_metrics(text: str, device: str | None = None) -> dict[str, float]:
    """Utilisation in % by device from a node's /metrics text (`plane_gpu_utilization_ratio`;
    node name and device joined as `node/device` when several nodes share one scrape)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != UTIL_METRIC:
            continue
        for s in fam.samples:
            dev = s.labels.get("device", "")
            if device is None or dev == device:
                out[f"{s.labels.get('node', '')}/{dev}"] = 100 * float(s.value)
    return out


def metrics_reader(url: str, device: str | None, timeout_s: float = 1.0
                   ) -> Callable[[], dict[str, float]]:
    def read() -> dict[str, float]:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return utilization_from_metrics(resp.read().decode(), device)
    return read


def sample(read: Callable[[], dict[str, float]], *, seconds: float, hz: float = 10.0,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> dict[str, Trace]:
    """Call `read` (device -> %) `hz` times a second for `seconds`; traces by device. A read
    that fails is skipped (a gap, not a zero)."""
    period_s = 1 / hz
    traces: dict[str, Trace] = {}
    start = clock()
    i = 0
    while True:
        due = start + i * period_s
        if due - start > seconds:
            break
        wait = due - clock()
        if wait > 0:
            sleep(wait)
        try:
            got = read()
        except OSError:
            got = {}
        now = clock() - start
        for device, pct in got.items():
            traces.setdefault(device, Trace(device)).add(now, pct)
        i += 1
    return traces


def to_json(results: list[Breath]) -> str:
    return msgspec.json.encode(results[0] if len(results) == 1 else results).decode()


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def render(b: Breath) -> str:
    period = ("none" if b.period_s is None
              else f"{b.period_s:.2f} s (autocorrelation {b.period_strength:.2f})")
    mean = "-" if b.mean_pct is None else f"{b.mean_pct:.1f}%"
    std = "-" if b.std_pct is None else f"{b.std_pct:.1f} points"
    lines = [
        f"device {b.device or '?'}: {b.verdict.upper()}",
        f"  samples          {b.samples} over {b.duration_s:.1f} s"
        + ("" if b.sample_period_s is None else f" (every {1000 * b.sample_period_s:.0f} ms)"),
        f"  mean / std       {mean} / {std}",
        f"  dominant period  {period}",
        f"  near the top     {_pct(b.near_top_share)} of the time",
        f"  near zero        {_pct(b.near_zero_share)} of the time",
        *(f"  - {r}" for r in b.reasons),
    ]
    return "\n".join(lines)


def plot(path: Path, traces: list[tuple[Trace, Breath]]) -> None:
    """Utilisation over time, one panel per device, titled with its verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 2.8 * len(traces)), squeeze=False)
    for ax, (tr, b) in zip(axes[:, 0], traces, strict=True):
        ax.plot(tr.times_s, tr.util_pct, color="#3b6ea5", linewidth=1)
        if b.mean_pct is not None:
            ax.axhline(b.mean_pct, color="#888888", linestyle="--", linewidth=0.8)
        ax.set_ylim(-2, 102)
        ax.set_ylabel("GPU util %")
        period = "" if b.period_s is None else f", period {b.period_s:.2f} s"
        ax.set_title(f"device {tr.device}: {b.verdict}{period}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
