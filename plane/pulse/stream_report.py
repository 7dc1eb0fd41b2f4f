"""A stream run's summary for people (a rich table), for programs (one JSON object) and on
disk (`--out`: streams.csv, one row per stream; streams.png, TTFT and TPOT over time, tokens/s
and refusals over time, the TTFT and TPOT histograms; summary.json). Plotting needs the
`plots` extra, as pulse's own picture does."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from plane.observe.console import console as default_console
from plane.pulse.stream_outcome import StreamOutcome
from plane.pulse.stream_runner import Capacity
from plane.pulse.stream_series import stream_seconds
from plane.pulse.stream_summary import Percentiles, StreamSummary, describe


def to_json(summary: StreamSummary, capacity: Capacity | None = None) -> str:
    if capacity is None:
        return msgspec.json.encode(summary).decode()
    return msgspec.json.encode({
        "capacity": {**msgspec.to_builtins(capacity), "streams_per_s": capacity.streams_per_s,
                     "tokens_per_s": capacity.tokens_per_s},
        **msgspec.to_builtins(summary)}).decode()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _p(p: Percentiles) -> str:
    return (f"p50 {_ms(p.p50_ms)}  p90 {_ms(p.p90_ms)}  p99 {_ms(p.p99_ms)}  "
            f"p99.9 {_ms(p.p999_ms)}  max {_ms(p.max_ms)}  (n {p.n})")


def _counts(d: dict[str, int]) -> str:
    return "  ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "-"


def print_stream_table(s: StreamSummary, capacity: Capacity | None = None,
                       console: Console | None = None) -> None:
    console = console or default_console()
    t = Table(title=f"pulse streams: {s.target}  {s.rate:g}/s (Poisson) for {s.duration_s:g}s",
              show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = []
    if capacity is not None:
        rows.append(("capacity (closed loop)",
                     f"{capacity.streams_per_s:.2f} streams/s, {capacity.tokens_per_s:.0f} "
                     f"tokens/s ({capacity.callers} callers, {capacity.seconds:.1f} s)"))
    rows += [
        ("accepted TTFT ms", _p(s.ttft)),
        ("TTFT p99/p50", _ms(s.ttft_p99_over_p50)),
        ("TTFT from arrival ms", f"p50 {_ms(s.e2e_ttft.p50_ms)}  p99 {_ms(s.e2e_ttft.p99_ms)}"),
        ("TPOT ms (per stream)", _p(s.tpot)),
        ("TPOT p99/p50", _ms(s.tpot_p99_over_p50)),
        ("token message gaps ms", f"p50 {_ms(s.gaps.p50_ms)}  p99 {_ms(s.gaps.p99_ms)}  "
                          f"max {_ms(s.gaps.max_ms)}"),
        ("tokens / tokens per s", f"{s.tokens} / {s.tokens_per_s:.1f}"),
        ("sent / accepted / started / dropped",
         f"{s.sent} / {s.accepted} / {s.started} / {s.dropped}"),
        ("streams ok per s", f"{s.ok_per_s:.2f}"),
        ("final status", _counts(s.status_counts)),
        ("finish", _counts(s.finish_counts)),
        ("refused at first try", f"{s.refused_first} ({_pct(s.refusal_rate)}): "
                                 f"{_counts(s.refused_by_reason)}"),
        ("refused in the end", _counts(s.refused_final_by_reason)),
        ("429s with Retry-After-Ms", _pct(s.retry_after_share)),
        ("first-retry success", _pct(s.first_retry_success)),
        ("mean retries / refused & retried", _ms(s.mean_retries)),
        ("accepted within deadline", f"{s.within_deadline} ({_pct(s.within_deadline_share)})"),
        ("messages after a final", str(s.after_final)),
        ("verdict", f"[bold]{s.verdict}[/bold]"),
    ]
    rows += [("", describe(c)) for c in s.checks]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def write_stream_out(out_dir: Path, outcomes: Sequence[StreamOutcome], summary: StreamSummary,
                     capacity: Capacity | None = None) -> list[Path]:
    """streams.csv, streams.png, summary.json; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "streams.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scheduled_s", "sent_s", "final", "finish", "attempts", "tokens",
                    "ttft_ms", "e2e_ttft_ms", "tpot_ms", "start_s", "end_s",
                    "within_deadline"])
        for o in sorted(outcomes, key=lambda o: o.scheduled_s):
            w.writerow([f"{o.scheduled_s:.6f}", f"{o.sent_s:.6f}", o.final, o.finish,
                        o.attempts, o.tokens, _num(o.ttft_s), _num(o.e2e_ttft_s),
                        _num(o.tpot_s), _at(o.start_s), _at(o.end_s),
                        int(o.within_deadline)])
    png_path = out_dir / "streams.png"
    _plot(png_path, outcomes, summary)
    json_path = out_dir / "summary.json"
    json_path.write_text(to_json(summary, capacity) + "\n")
    return [csv_path, png_path, json_path]


def _at(t_s: float | None) -> str:
    return "" if t_s is None else f"{t_s:.6f}"


def _num(v_s: float | None) -> str:
    return "" if v_s is None else f"{1000 * v_s:.3f}"


def _plot(path: Path, outcomes: Sequence[StreamOutcome], summary: StreamSummary) -> None:
    """Six panels. Over time: accepted TTFT and TPOT (p50/p99 per second of arrivals), tokens
    delivered and streams refused per second. Histograms: TTFT, TPOT, token gaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    seconds = stream_seconds(outcomes)
    ts = [s.t_s + 0.5 for s in seconds]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    (ttft_ax, tpot_ax, rate_ax), (ttft_hist, tpot_hist, gap_hist) = axes

    def over_time(ax: Any, attrs: tuple[str, str], what: str) -> None:
        for attr, style in zip(attrs, ("-", "--"), strict=True):
            ys = [getattr(s, attr) for s in seconds]
            if any(y is not None for y in ys):
                ax.plot(ts, [float("nan") if y is None else y for y in ys], style,
                        marker=".", label=attr.removesuffix("_ms").replace("_", " "))
        ax.set(xlabel="second of the run (arrival)", ylabel=f"{what} ms",
               title=f"accepted {what} over time")
        ax.legend(fontsize=8)

    over_time(ttft_ax, ("ttft_p50_ms", "ttft_p99_ms"), "TTFT")
    over_time(tpot_ax, ("tpot_p50_ms", "tpot_p99_ms"), "TPOT")

    rate_ax.plot(ts, [s.tokens for s in seconds], color="#3b6ea5", label="tokens delivered")
    rate_ax.set(xlabel="second of the run", ylabel="tokens / s", title="tokens and refusals")
    refused_ax = rate_ax.twinx()
    refused_ax.bar(ts, [s.refused for s in seconds], width=0.9, color="#c0392b", alpha=0.4,
                   label="refused at first try")
    refused_ax.set(ylabel="streams refused / s")
    rate_ax.legend(loc="upper left", fontsize=8)
    refused_ax.legend(loc="upper right", fontsize=8)

    accepted = [o for o in outcomes if o.accepted]
    for ax, values, what, p in (
        (ttft_hist, [o.ttft_s for o in accepted], "TTFT", summary.ttft),
        (tpot_hist, [o.tpot_s for o in accepted], "TPOT (per stream)", summary.tpot),
        (gap_hist, [g for o in accepted for g in o.gaps_s], "gaps between token messages",
         summary.gaps),
    ):
        ms = [1000 * v for v in values if v is not None]
        if ms:
            ax.hist(ms, bins=100, color="#3b6ea5")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
            for name, v in (("p50", p.p50_ms), ("p99", p.p99_ms)):
                if v is not None:
                    ax.axvline(v, linestyle="--", color="#c0392b")
                    ax.text(v, ax.get_ylim()[1] * 0.5, f" {name}", color="#c0392b")
        ax.set(xlabel=f"{what} ms", ylabel="count", title=f"{what} (accepted)")

    fig.suptitle(f"{summary.target}: {summary.verdict}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
