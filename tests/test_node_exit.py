"""`plane node` stopped by SIGTERM exits as soon as it has stopped."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

from plane.contract.embedded import EmbeddedNats
from tests.up_process import PLANE

# From the node's "node stopped" line to its exit (ms here; it was 0.8-1.7 s).
EXITS_WITHIN_S = 0.5


def _arrivals(proc: subprocess.Popen[str]) -> list[tuple[float, str]]:
    """Each line of `proc`'s stderr with when it came, until the pipe closes."""
    assert proc.stderr is not None
    return [(time.monotonic(), line) for line in proc.stderr]


async def test_an_idle_node_exits_once_stopped(nats_server: EmbeddedNats) -> None:
    # The node stopped in 7 ms, then the process took a second more to exit: the
    # interpreter's teardown of torch and triton (found from outside, as 1.2 s).
    with subprocess.Popen([PLANE, "node", "--nats", nats_server.url, "--model", "calibrated",
                           "--slots", "1", "--log-level", "info"],
                          stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        started = []
        for line in proc.stderr:
            started.append(line)
            if "node started" in line:
                break
        assert started and "node started" in started[-1], "".join(started)
        reading = asyncio.create_task(asyncio.to_thread(_arrivals, proc))
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        t_exit = time.monotonic()
        lines = await reading
    assert rc == 0, "".join(line for _, line in lines)
    [t_stopped] = [t for t, line in lines if "node stopped" in line]
    assert t_exit - t_stopped < EXITS_WITHIN_S, (
        f"{t_exit - t_stopped:.2f} s from 'node stopped' to the exit")
