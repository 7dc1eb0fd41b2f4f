"""A process that computes (`plane node`, `plane up`) serves with the heap its imports brought
out of the cyclic collector's reach (`plane.contract.lifecycle.freeze_startup_heap`).

The node's modules (torch and triton) are imported lazily, after `run` froze the heap, so
that the commands that do not compute start fast: a node served with ~155k objects of torch's
in the collected heap (25k of 180k frozen), and a full collection, whenever one came, walked
them: 150-240 ms of a stopped event loop on this host (`gc.collect()` timed in such a
process). In the tests' own process, which runs routers and nodes on one loop, one stopped a
Node.js caller's first request for 340 ms: a 504 (`tests/conftest.py` freezes it now)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from plane.contract.embedded import EmbeddedNats

# The CLI run in-process, with a SIGUSR1 handler that says how the heap stands.
SCRIPT = """
import gc, json, signal, sys
def report(*_):
    heap = {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}
    print("HEAP " + json.dumps(heap), flush=True)
signal.signal(signal.SIGUSR1, report)
from plane.app import main
main(sys.argv[1:], prog_name="plane")
"""


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    lines = []
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return line
    raise AssertionError(f"no {marker!r} in the output:\n{''.join(lines)}")


def _heap_when_serving(args: list[str], ready: str) -> dict[str, Any]:
    with subprocess.Popen([sys.executable, "-c", SCRIPT, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        try:
            _read_until(proc, ready, 60)
            proc.send_signal(signal.SIGUSR1)
            heap: dict[str, Any] = json.loads(_read_until(proc, "HEAP ", 10).split("HEAP ")[1])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            return heap
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("command", ["node", "up"])
async def test_a_computing_process_serves_with_its_imports_frozen(command: str) -> None:
    if command == "node":
        async with EmbeddedNats() as srv:
            heap = _heap_when_serving(
                ["node", "--nats", srv.url, "--model", "risk", "--slots", "1",
                 "--backend", "torch", "--log-level", "info"], "node started")
    else:
        heap = _heap_when_serving(["up", "--one-process", "--log-level", "warning"],
                                  "Ctrl-C")
    # torch alone is ~155k objects: frozen, the collector's walks are over what came since.
    assert heap["frozen"] > 100_000, heap
    assert heap["tracked"] < heap["frozen"] / 3, heap
