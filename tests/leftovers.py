"""Processes left running: what a test, a script or a whole session started and did not stop.

Every process started by a test inherits its environment, so a mark put there (the session's,
`conftest.SESSION_MARK`; a script's `OUT`) finds it later, even once it has been re-parented
to init. Read from /proc (Linux, where the tests run)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def left_running(marker: str, within_s: float = 10.0) -> list[tuple[int, str]]:
    """(pid, command line) of the processes other than this one still alive (zombies do not
    count) whose environment holds `marker` (`NAME=value`), after up to `within_s` for stops
    under way."""
    needle = b"\0" + marker.encode() + b"\0"
    end = time.monotonic() + within_s
    while True:
        alive = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if needle not in b"\0" + (proc / "environ").read_bytes() + b"\0":
                    continue
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if state != "Z":
                alive.append((int(proc.name), cmdline[:160]))
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.2)


def kill_all(processes: list[tuple[int, str]]) -> None:
    for pid, _ in processes:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGKILL)
