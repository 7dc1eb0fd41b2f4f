"""Render the rejection board from a real run, without Grafana: the same panels
(`compose/grafana/dashboards/rejection-board.json`), the same recording rules
(`compose/rules/plane.rules.yml`), queried from a real Prometheus and drawn with matplotlib.

    .venv/bin/python scripts/render_board.py [--out docs/board.png] [--seconds 40]

Starts `plane up` (4 `calibrated` slots, metrics on a free port) and Debian's `prometheus`
(scraping it every second, evaluating the rules every second), both on loopback and stopped
by PID; offers 0.85x the capacity then 2x with `plane pulse --retry`, --seconds each; then
reads every panel's expressions over the run from Prometheus's query API and draws them. A
panel whose metrics this run has none of (no bridge, no GPU here) says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))

from plane.contract.processes import free_port  # noqa: E402

BOARD = REPO / "compose" / "grafana" / "dashboards" / "rejection-board.json"
RULES = REPO / "compose" / "rules" / "plane.rules.yml"
WORK_US = 20_000
SLOTS = 4


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 2})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{q}", timeout=10) as r:
        body = json.load(r)
    return list(body["data"]["result"]) if body.get("status") == "success" else []


def wait_http(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def pulse(url: str, rate: float, seconds: float) -> None:
    subprocess.run([str(BIN / "plane"), "pulse", "--nats", url, "--model", "calibrated",
                    "--rate", f"{rate:.0f}", "--duration", f"{seconds:.0f}", "--retry",
                    "--body", json.dumps({"duration_us": WORK_US})],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def draw(panels: list[dict[str, Any]], data: list[list[tuple[str, list[dict[str, Any]]]]],
         t0: float, switch_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(15, 3.0 * rows), squeeze=False)
    for ax, panel, series in zip(axes.flat, panels, data, strict=False):
        ax.set_title(panel.get("title", ""), fontsize=10)
        drawn = 0
        for expr, results in series:
            for res in results:
                xs = [float(t) - t0 for t, _ in res["values"]]
                ys = [float(v) for _, v in res["values"]]
                label = ",".join(f"{k}={v}" for k, v in res["metric"].items()
                                 if k not in ("__name__", "instance", "job"))
                ax.plot(xs, ys, label=label or expr[:40], linewidth=1.2)
                drawn += 1
        if drawn:
            ax.axvline(switch_s, color="grey", linestyle=":", linewidth=1)
            if drawn <= 6:
                ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data in this run\n(it did not happen, or no bridge/GPU here)",
                    ha="center", va="center", transform=ax.transAxes, fontsize=9,
                    color="grey")
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"rejection board, from Prometheus: {SLOTS} calibrated slots x "
                 f"{WORK_US // 1000} ms, 0.85x then 2x (dotted line) with retries", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "board.png")
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    board = json.loads(BOARD.read_text())
    panels = [p for p in board["panels"] if p.get("targets")]
    metrics_port, prom_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        up = subprocess.Popen(
            [str(BIN / "plane"), "up", "--models", "calibrated", "--slots", str(SLOTS),
             "--metrics-port", str(metrics_port), "--log-level", "warning"],
            stdout=subprocess.PIPE, text=True)
        prom_proc: subprocess.Popen[bytes] | None = None
        try:
            assert up.stdout is not None
            url = ""
            while "Ctrl-C" not in (line := up.stdout.readline()):
                if not line:
                    raise RuntimeError("plane up exited")
                if line.startswith("plane is up: NATS "):
                    url = line.split()[-1]
            conf = Path(tmp) / "prometheus.yml"
            conf.write_text(json.dumps({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [{"job_name": "plane", "static_configs": [
                    {"targets": [f"127.0.0.1:{metrics_port}"]}]}],
            }))
            prom_proc = subprocess.Popen(
                ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={tmp}/tsdb",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            prom = f"http://127.0.0.1:{prom_port}"
            wait_http(f"{prom}/-/ready", 30)
            capacity = SLOTS / (WORK_US / 1e6) * 0.9  # what the slots give, less overhead
            t0 = time.time()
            pulse(url, 0.85 * capacity, args.seconds)
            switch_s = time.time() - t0
            pulse(url, 2.0 * capacity, args.seconds)
            time.sleep(3)  # the last scrapes and rule evaluations
            end = time.time()
            status = subprocess.run([str(BIN / "plane"), "status", "--nats", url],
                                    capture_output=True, text=True, timeout=30)
            data = [[(t["expr"], query_range(prom, t["expr"], t0, end))
                     for t in p["targets"]] for p in panels]
        finally:
            for proc in (prom_proc, up):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=30)
    draw(panels, data, t0, switch_s, args.out)
    with_data = sum(any(r for _, r in series) for series in data)
    print(f"wrote {args.out}: {len(panels)} panels, {with_data} with data")
    print("plane status at the end of the run:")
    print(status.stdout.rstrip())


if __name__ == "__main__":
    main()
