"""A run's summary for people (a rich table), for programs (one JSON object), and on disk
(raw latencies as CSV; a PNG of latency over time, by percentile, the refusal rate and the
histogram)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from plane.observe.console import console as default_console
from plane.pulse.outcome import TIMEOUT, Outcome
from plane.pulse.series import per_second, percentile_curve
from plane.pulse.summary import Summary


def to_json(summary: Summary) -> str:
    return msgspec.json.encode(summary).decode()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_table(summary: Summary, console: Console | None = None) -> None:
    console = console or default_console()
    s = summary
    t = Table(title=f"pulse: {s.target}  {s.rate:g}/s ({s.arrivals}) for {s.duration_s:g}s",
              show_header=False)
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
        ("made up by the client", "  ".join(f"{k}: {v}" for k, v in
                                            sorted(s.local_causes.items())) or "none"),
        ("within deadline", _pct(s.within_deadline_share) if s.deadline_ms is not None
                            else "- (the server's deadline; --deadline-ms to measure it)"),
        ("refused (first try)", _pct(s.refusal_rate)),
        ("429s with Retry-After", _pct(s.retry_after_share)),
        ("first-retry success", _pct(s.first_retry_success)),
        ("mean retries / refused & retried", _ms(s.mean_retries)),
        ("plateau", f"yes, at {_ms(s.plateau_ms)} ms" if s.plateau else "no"),
        ("accepted p50 by third ms", f"first {_ms(s.p50_first_third_ms)}  "
                                     f"last {_ms(s.p50_last_third_ms)}"),
        ("verdict", f"[bold]{s.verdict}[/bold] ({'; '.join(s.verdict_reasons)})"),
        ("decided by", s.decided_by),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def write_out(out_dir: Path, outcomes: Sequence[Outcome], summary: Summary) -> list[Path]:
    """latencies.csv (one row per request), pulse.png, summary.json; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "latencies.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scheduled_s", "latency_ms", "accepted_ms", "status", "attempts"])
        for o in sorted(outcomes, key=lambda o: o.scheduled_s):
            w.writerow([f"{o.scheduled_s:.6f}", f"{o.latency_us / 1000:.3f}",
                        f"{o.accepted_us / 1000:.3f}", o.attempts.final,
                        len(o.attempts.statuses)])
    png_path = out_dir / "pulse.png"
    _plot(png_path, outcomes, summary)
    json_path = out_dir / "summary.json"
    json_path.write_text(to_json(summary) + "\n")
    return [csv_path, png_path, json_path]


def _plot(path: Path, outcomes: Sequence[Outcome], summary: Summary) -> None:
    """Four panels: latency over time (p50/p99 per second, accepted and refused), the
    percentile plot (log scale), the refusal rate per second, the histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accepted = [o.accepted_us / 1000 for o in outcomes
                if o.attempts.final in ("200", "504", TIMEOUT)]
    seconds = per_second(outcomes)
    ts = [s.t_s + 0.5 for s in seconds]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (over_time, pcts), (refusals, hist) = axes

    for attr, label, style in (
        ("accepted_p50_ms", "accepted p50", "-"), ("accepted_p99_ms", "accepted p99", "-"),
        ("refused_p50_ms", "429 p50", ":"), ("refused_p99_ms", "429 p99", ":"),
    ):
        ys = [getattr(s, attr) for s in seconds]
        if any(y is not None for y in ys):
            over_time.plot(ts, [float("nan") if y is None else y for y in ys], style,
                           marker=".", label=label)
    over_time.set(xlabel="second of the run (scheduled send)", ylabel="latency ms",
                  title="latency over time")
    over_time.legend(fontsize=8)

    curve = percentile_curve(accepted)
    if curve:
        xs = [1 / (1 - p / 100) for p, _ in curve]
        pcts.plot(xs, [ms for _, ms in curve], marker="o", color="#3b6ea5")
        pcts.set_xscale("log")
        ticks = [(p, f"{p:g}") for p in (0.0, 50.0, 90.0, 99.0, 99.9, 99.99, 99.999)
                 if 1 / (1 - p / 100) <= xs[-1] * 1.01]
        pcts.set_xticks([1 / (1 - p / 100) for p, _ in ticks], [t for _, t in ticks])
    pcts.set(xlabel="percentile", ylabel="accepted latency ms",
             title="accepted latency by percentile")
    for ax in (pcts, over_time):
        _log_if_wide(ax)

    rates = [s.refusal_rate for s in seconds]
    refusals.bar(ts, [100 * (r or 0.0) for r in rates], width=0.9, color="#c0392b")
    refusals.set(xlabel="second of the run", ylabel="% refused (first try)", ylim=(0, 100),
                 title="refusal rate")

    if accepted:
        hist.hist(accepted, bins=100, color="#3b6ea5")
        for name, v in (("p50", summary.p50_ms), ("p99", summary.p99_ms)):
            if v is not None:
                hist.axvline(v, linestyle="--", color="#c0392b")
                hist.text(v, hist.get_ylim()[1] * 0.9, f" {name}", color="#c0392b")
        hist.set_yscale("log")
    hist.set(xlabel="accepted latency (ms, from scheduled send)", ylabel="requests",
             title="histogram")

    fig.suptitle(f"{summary.target}: {summary.verdict} (decided by {summary.decided_by})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _log_if_wide(ax: Any) -> None:
    """A log y axis when the data spans more than a decade (ticks at 1, 2, 5 x 10^k, written
    as plain numbers), else linear: a log axis over 20..30 ms shows no tick at all."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    lo, hi = ax.dataLim.y0, ax.dataLim.y1
    if lo > 0 and hi / lo > 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
