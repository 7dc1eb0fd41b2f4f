"""The examples are real files run against a real plane, so the README cannot drift."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

from tests.plane_fixtures import plane

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def test_score_transaction_example_prints_a_score() -> None:
    async with plane(models=("risk",), slots=1) as stack:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLES / "score_transaction.py"), stack.url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert re.match(r"score 0\.\d{4} from node0-risk slot 0 in 1 attempt", out.decode())
