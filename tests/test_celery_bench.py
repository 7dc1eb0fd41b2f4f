"""Smoke test of the Celery side-by-side: both systems start, are measured and stopped, and
the table comes out. (The real run is 60 s per load: see BENCHMARKS.md.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


async def test_side_by_side_smoke(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed: run scripts/setup-system.sh")
        pytest.skip("redis-server is not installed (scripts/setup-system.sh installs it)")
    out_json, out_md = tmp_path / "rows.json", tmp_path / "celery.md"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "celery_side_by_side.py"),
        "--duration", "2", "--capacity-s", "1", "--slots", "2", "--duration-us", "10000",
        "--json", str(out_json), "--md", str(out_md),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    data = json.loads(out_json.read_text())
    assert set(data["capacities"]) == {"plane", "celery"}
    assert all(c > 0 for c in data["capacities"].values())
    rows = data["rows"]
    assert [(r["system"], r["load"]) for r in rows] == [
        (s, x) for s in ("plane", "celery") for x in (0.5, 0.9, 1.5)]
    for r in rows:
        assert r["ok_per_s"] > 0 and r["p50_ms"] >= 10
    by = {(r["system"], r["load"]): r for r in rows}
    # Overloaded, the plane refuses, and every refusal says when to come back ...
    assert by["plane", 1.5]["refusal_rate"] > 0, by["plane", 1.5]
    for r in rows:
        if r["system"] == "plane":
            want = None if r["refusal_rate"] == 0 else 1.0  # (no 429s: no share to speak of)
            assert r["retry_after_share"] == want, r
    # ... while Celery never refuses: it queues.
    assert all(by["celery", x]["refusal_rate"] == 0 for x in (0.5, 0.9, 1.5)), rows
    assert "| celery | 1.5x |" in out_md.read_text() and "| plane | 0.5x |" in out.decode()
