"""Smoke test of the burst-line benchmark: the plane starts, the load and the burst run, the
burst's holders come back with their tickets, and the JSON comes out. (The real run is 30 s:
BENCHMARKS.md, "Forty-fifth session".)"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def test_burst_line_smoke() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "burst_line.py"),
        "--slots", "2", "--work-us", "20000", "--capacity", "80", "--duration", "3",
        "--burst", "12", "--burst-at", "1", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    data = json.loads(out)
    assert sum(data["burst_answers"].values()) == 12 and data["burst_answers"].get("200")
    assert len(data["refused_first_by_second"]) == 3
    assert all(0.0 <= s <= 1.0 for s in data["refused_first_by_second"])
    assert isinstance(data["line_stood_s"], int) and 0 <= data["line_stood_s"] <= 2
    assert data["figures"]["offered"] > 100 and data["figures"]["accepted_per_s"] > 0
    # Twelve at once on two slots: most were refused with a ticket and came back with it.
    assert data["holders_found"].get("ticket-valid", 0) >= 8, data["holders_found"]
