"""Faults with a ledger of every request and every answer: a node killed with SIGKILL
mid-request, the nats-server restarted under load. Exactly one answer per request, nothing
lost; callers of a dead node get a result from another node through the SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from plane.client import Client as PlaneClient
from plane.embedded import EmbeddedNats
from plane.subjects import Header
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated, client, plane

PLANE = str(Path(sys.executable).parent / "plane")


async def test_node_killed_mid_request() -> None:
    async with EmbeddedNats() as srv:
        victim = subprocess.Popen(
            [PLANE, "node", "--nats", srv.url, "--model", "calibrated", "--slots", "2",
             "--node-id", "victim", "--log-level", "warning"])
        try:
            async with plane(srv.url, models=("calibrated",), slots=2) as stack, \
                    client(srv.url) as nc:
                router = stack.routers[0]
                t_end = time.monotonic() + 30
                while router.models["calibrated"].healthy_count() < 4:
                    assert time.monotonic() < t_end, "victim never joined"
                    await asyncio.sleep(0.05)
                ledger = await Ledger(nc).start()
                # 4 slots, 8 long requests: 4 run (2 on the victim), 4 are refused with tickets.
                for _ in range(8):
                    await ledger.send(NAMES.infer("calibrated"), calibrated(800_000), 3000)
                await asyncio.sleep(0.3)
                os.kill(victim.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                await ledger.settle(timeout_s=6)
                assert ledger.unanswered() == []
                assert ledger.answered_twice() == []
                counts = ledger.statuses()
                assert set(counts) <= {200, 429, 503}, counts
                dead = [i for i in ledger.answers if ledger.status(i) == 503]
                assert counts == {200: 2, 429: 4, 503: 2}, counts
                for i in dead:
                    h = ledger.answers[i][0][1].headers or {}
                    assert h[Header.NODE] == "victim" and h[Header.REASON] == "unhealthy"
                    # within the request's deadline
                    assert ledger.latency_ms(i) < ledger.deadline_ms[i]
                    assert ledger.answers[i][0][0] - killed_at < 2.0
                # The SDK retries those callers on another node, which answers.
                sdk = PlaneClient(nc)
                for _ in dead:
                    res = await sdk.invoke("calibrated", {"duration_us": 1000}, deadline_ms=2000)
                    assert res.headers[Header.NODE] == "node0-calibrated"
                # The dead node's slots are gone from the router; orphans expired by TTL.
                assert all(v.node != "victim"
                           for v in router.models["calibrated"].slots.values())
                js = nc.jetstream()
                t_end = time.monotonic() + 6
                while True:
                    info = await js.stream_info(NAMES.slots_stream,
                                                subjects_filter=NAMES.node_slots("victim"))
                    if not info.state.subjects:
                        break
                    assert time.monotonic() < t_end, f"orphans left: {info.state.subjects}"
                    await asyncio.sleep(0.2)
        finally:
            if victim.poll() is None:
                victim.kill()
            victim.wait()


async def test_nats_server_restarted_under_load() -> None:
    async with EmbeddedNats() as srv, \
            plane(srv.url, models=("calibrated",), slots=2) as stack:
        sdk_nc_ctx = client(srv.url)
        async with sdk_nc_ctx as nc:
            sdk = PlaneClient(nc)
            outcomes: list[tuple[int, float]] = []

            async def one(i: int) -> None:
                await asyncio.sleep(i * 0.02)
                t0 = time.monotonic()
                res = await sdk.call("calibrated", {"duration_us": 20_000}, deadline_ms=3000)
                outcomes.append((res.status, time.monotonic() - t0))

            load = asyncio.gather(*(one(i) for i in range(100)))
            await asyncio.sleep(0.6)
            await srv.restart()
            await load
            assert len(outcomes) == 100  # every call ended, each with one outcome
            for status, took in outcomes:
                assert status in (200, 429, 503, 504)
                assert took < 3.0 + 0.5  # never past the deadline (plus scheduling slack)
            ok = sum(1 for s, _ in outcomes if s == 200)
            assert ok >= 50, sorted(Counter(s for s, _ in outcomes).items())
            # The plane recovered by itself: new calls succeed.
            t_end = time.monotonic() + 10
            while True:
                res = await sdk.call("calibrated", {"duration_us": 1000}, deadline_ms=1000)
                if res.status == 200:
                    break
                assert time.monotonic() < t_end, res
                await asyncio.sleep(0.1)
        assert stack.routers[0].models["calibrated"].healthy_count() == 2
