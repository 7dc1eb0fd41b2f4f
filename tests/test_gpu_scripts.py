"""scripts/gpu_plane.sh on the CPU (`BACKEND=torch`): the script a session lent a GPU runs in
its one device call must not be what fails there. Every part of it runs here: `plane up`, the
pulses, the floor, `plane status`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.leftovers import left_running

REPO = Path(__file__).resolve().parent.parent


def test_gpu_plane_script_runs_the_plane_pulses_and_floor_on_the_cpu(tmp_path: Path) -> None:
    # `python3` there is this interpreter (the project's venv), as on a GPU box with the
    # NATS stack installed or carried as wheels.
    env = {**os.environ, "BACKEND": "torch", "SECONDS_EACH": "1", "STREAM_CALLERS": "1",
           "OUT": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([str(REPO / "scripts" / "gpu_plane.sh")], capture_output=True,
                          text=True, env=env, timeout=300, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    assert re.search(r"plane up ready in [\d.]+ s at nats://127\.0\.0\.1:\d+", out), out
    assert out.count('"event": "node started"') == 3, out  # calibrated, risk, tinylm
    # on a CPU `plane up` leaves Python's GIL switch interval (NodeConfig.gil_switch_us)
    assert out.count('"gil_switch_us": 5000') == 3, out
    pulses = re.findall(r"^== (.+)\n  rate=.*sent=(\d+), answered=(\d+)", out, re.M)
    assert [name for name, _, _ in pulses] == [
        "calibrated 2 ms, 1000/s", "calibrated 2 ms, 3000/s", "calibrated 200 us, 3000/s",
        "risk, 2000/s"], out
    assert all(int(sent) > 0 and sent == answered for _, sent, answered in pulses), out
    streams = re.findall(r"^== (tinylm streams .+)\n  capacity=\{[^}]*'streams_per_s': "
                         r"([\d.]+), .*ttft=\{'n': \d+, 'p50_ms'", out, re.M)
    assert [name for name, _ in streams] == [
        "tinylm streams of 64 tokens, 0.9x the capacity",
        "tinylm streams of 64 tokens, 2x the capacity"], out
    assert all(float(capacity) > 0 for _, capacity in streams), out
    assert re.search(r"\| plane, calibrated 0 us \| [\d.]+ \| [\d.]+ \| [\d.]+x", out), out
    assert "backend: torch" in out and "healthy" in out, out
    assert (tmp_path / "plane_up.log").stat().st_size > 0
    assert left_running(f"OUT={tmp_path}") == [], "the script left processes running"


def test_gpu_shapes_script_runs_its_shapes_on_the_cpu(tmp_path: Path) -> None:
    """scripts/gpu_shapes.py, two of its shapes, briefly: each pulse is answered, the slot's
    time past the work is read from the node's lines, and each process's CPU is counted."""
    env = {**os.environ, "BACKEND": "torch", "SLOTS": "2", "RATES": "200", "PULSE_S": "2",
           "SHAPES": "up,split-5ms", "OUT": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_shapes.py")],
                          capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    pulses = re.findall(r"^== (\S+) 200/s: ok/s (\d+),", out, re.M)
    assert [name for name, _ in pulses] == ["up", "split-5ms"], out
    assert all(int(ok) > 100 for _, ok in pulses), out
    past = re.findall(r"slot time past the work \(us, (\d+) sampled\): p50 (\d+)", out)
    assert len(past) == 2 and all(int(n) > 0 for n, _ in past), out
    assert re.search(r"CPU s over the pulse: .*router [\d.]+", out), out  # split's router
    # Each shape's router, from its /metrics over the pulse: nothing refused or behind at
    # this rate, and its decisions' time from receipt.
    routers = re.findall(r"router 0: refusals (\d+)/s, refused unread \(behind\) (\d+)/s, "
                         r"decision from receipt p50/p99 ([\d.]+)/([\d.]+) ms", out)
    assert len(routers) == 2 and all(u == "0" for _, u, _, _ in routers), out
    assert '"gil_switch_us": 5000' in (tmp_path / "split-5ms" / "node.log").read_text()
    assert left_running(f"OUT={tmp_path}") == [], "the script left processes running"
