"""A run's summary for people (a rich table), for programs (one JSON object), and on disk
(raw latencies as CSV, a histogram plot as PNG)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from plane.pulse.outcome import Outcome
from plane.pulse.summary import Summary


def to_json(summary: Summary) -> str:
    return msgspec.json.encode(summary).decode()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_table(summary: Summary, console: Console | None = None) -> None:
    console = console or Console()
    s = summary
    t = Table(title=f"pulse: {s.target}  {s.rate:g}/s for {s.duration_s:g}s", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("accepted latency ms", f"p50 {_ms(s.p50_ms)}  p90 {_ms(s.p90_ms)}  p99 {_ms(s.p99_ms)}"
                                f"  p99.9 {_ms(s.p999_ms)}  max {_ms(s.max_ms)}"),
        ("p99/p50", _ms(s.p99_over_p50)),
        ("end to end ms", f"p50 {_ms(s.e2e_p50_ms)}  p99 {_ms(s.e2e_p99_ms)}"),
        ("p99 by window ms", "  ".join(_ms(v) for v in s.p99_by_window_ms)),
        ("sent / answered / dropped", f"{s.sent} / {s.answered} / {s.dropped}"),
        ("ok per second", f"{s.ok_per_s:.1f}"),
        ("by status", "  ".join(f"{k}: {v}" for k, v in sorted(s.status_counts.items()))),
        ("within deadline", _pct(s.within_deadline_share)),
        ("refused (first try)", _pct(s.refusal_rate)),
        ("429s with Retry-After", _pct(s.retry_after_share)),
        ("first-retry success", _pct(s.first_retry_success)),
        ("mean retries / refused", _ms(s.mean_retries)),
        ("plateau", f"yes, at {_ms(s.plateau_ms)} ms" if s.plateau else "no"),
        ("verdict", f"[bold]{s.verdict}[/bold] ({'; '.join(s.verdict_reasons)})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def write_out(out_dir: Path, outcomes: Sequence[Outcome], summary: Summary) -> list[Path]:
    """latencies.csv (one row per request), histogram.png, summary.json; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "latencies.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scheduled_s", "latency_ms", "accepted_ms", "status", "attempts"])
        for o in sorted(outcomes, key=lambda o: o.scheduled_s):
            w.writerow([f"{o.scheduled_s:.6f}", f"{o.latency_us / 1000:.3f}",
                        f"{o.accepted_us / 1000:.3f}", o.attempts.final,
                        len(o.attempts.statuses)])
    png_path = out_dir / "histogram.png"
    _plot(png_path, [o.accepted_us / 1000 for o in outcomes
                     if o.attempts.final in ("200", "504", "timeout")], summary)
    json_path = out_dir / "summary.json"
    json_path.write_text(to_json(summary) + "\n")
    return [csv_path, png_path, json_path]


def _plot(path: Path, latencies_ms: Sequence[float], summary: Summary) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if latencies_ms:
        ax.hist(latencies_ms, bins=100, color="#3b6ea5")
        for name, v in (("p50", summary.p50_ms), ("p99", summary.p99_ms)):
            if v is not None:
                ax.axvline(v, linestyle="--", color="#c0392b")
                ax.text(v, ax.get_ylim()[1] * 0.9, f" {name}", color="#c0392b")
    ax.set_xlabel("accepted latency (ms, from scheduled send)")
    ax.set_ylabel("requests")
    ax.set_yscale("log")
    ax.set_title(f"{summary.target}: {summary.verdict}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
