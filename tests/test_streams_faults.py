"""A node killed mid-stream (SIGKILL of a `plane node` process): its caller gets exactly one
final message, the router's 503, and nothing after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nats.errors import NoRespondersError

from plane.contract.embedded import EmbeddedNats
from plane.contract.messages import FaultCommand, json_encoder
from plane.contract.streams import Kind
from plane.contract.subjects import Header
from tests.plane_fixtures import NAMES, client, plane, wait_until
from tests.test_streams_node import LONG_PROMPT, Stream, body

PLANE = str(Path(sys.executable).parent / "plane")


async def test_node_killed_mid_stream() -> None:
    async with EmbeddedNats() as srv:
        victim = subprocess.Popen(
            [PLANE, "node", "--nats", srv.url, "--model", "tinylm", "--slots", "1",
             "--backend", "torch", "--node-id", "victim", "--allow-faults",
             "--log-level", "warning"])
        try:
            async with plane(srv.url, models=()) as stack, client(srv.url) as nc:
                router = stack.routers[0]

                def victim_ready() -> bool:
                    ms = router.models.get("tinylm")
                    return ms is not None and ms.healthy_count() == 1

                await wait_until(victim_ready, 30, "the victim's slot")
                # 5 ms a token: 250 tokens would take 1.25 s, so it is surely mid-stream. (The
                # node listens for faults a moment after its slots are advertised: ask again.)
                slow = json_encoder.encode(FaultCommand(k=0, mode="slow", extra_us=5000))

                async def slowed() -> bool:
                    try:
                        return (await nc.request(NAMES.fault("victim"), slow, timeout=1)).data \
                            == b"ok"
                    except NoRespondersError:
                        return False

                await wait_until(slowed, 10, "the victim to take the fault")
                inbox = nc.new_inbox()
                s = Stream(await nc.subscribe(inbox))
                await nc.publish(NAMES.infer("tinylm"), body(LONG_PROMPT, 250), reply=inbox,
                                 headers={Header.STREAM: "1", Header.REQUEST_ID: "doomed",
                                          Header.DEADLINE_MS: "2000",
                                          Header.STREAM_DEADLINE_MS: "20000"})
                assert await s.next() is Kind.START
                assert await s.next() is Kind.TOKEN
                os.kill(victim.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                await s.to_end(timeout_s=5)
                await s.nothing_more(1.0)
        finally:
            if victim.poll() is None:
                victim.kill()
            victim.wait()
    final = s.msgs[-1]
    h = final.headers or {}
    assert s.reader.end is None  # not the node's end: an ordinary reply, the router's
    assert h.get(Header.STREAM) is None
    assert h[Header.STATUS] == "503" and h[Header.REASON] == "unhealthy"
    assert h[Header.NODE] == "victim" and h[Header.REQUEST_ID] == "doomed"
    assert s.at_s[-1] - killed_at < 3.0
    assert sum(1 for m in s.msgs if (m.headers or {}).get(Header.STREAM) != "token") == 2
