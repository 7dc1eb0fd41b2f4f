"""Any language: the official Node.js NATS client calls the plane with a plain request."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from tests.plane_fixtures import plane

JS_DIR = Path(__file__).parent / "js"


@pytest.fixture
def node_client() -> Path:
    if shutil.which("node") is None or not (JS_DIR / "node_modules" / "@nats-io").exists():
        pytest.fail("Node.js client missing: run `make test` (it runs npm ci in tests/js)")
    return JS_DIR / "call_plane.mjs"


async def test_nodejs_client_gets_a_score_and_a_refusal(node_client: Path) -> None:
    async with plane(models=("risk", "calibrated"), slots=2) as stack:
        proc = await asyncio.create_subprocess_exec(
            "node", str(node_client), stack.url, "2", cwd=JS_DIR,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        risk = next(x for x in lines if x["kind"] == "risk")
        assert risk["status"] == "200" and 0.0 <= risk["body"]["score"] <= 1.0
        assert risk["node"] == "node0-risk"
        extra = next(x for x in lines if x["kind"] == "extra")
        assert extra["status"] == "429" and extra["reason"] == "busy"
        assert int(extra["retryAfterMs"]) > 0
        assert extra["ms"] < 200  # refused at once, not queued behind 1.5 s of work
        longs = [x for x in lines if x["kind"] == "long"]
        assert [x["status"] for x in longs] == ["200", "200"]
