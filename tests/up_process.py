"""`plane up` as a process of its own, as a user runs it: started, read up to its banner,
its children found and checked gone. Shared by the tests of how it starts and how it stops."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PLANE = str(Path(sys.executable).parent / "plane")


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@contextlib.contextmanager
def plane_up(*args: str, **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """`plane up ARGS`, its output and errors on one pipe; killed at the end if it still
    runs (`with`: the pipes are closed, whatever happened)."""
    with subprocess.Popen([PLANE, "up", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **popen) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def left_none(pids: list[int]) -> None:
    for pid in pids:
        assert not alive(pid), f"orphan process {pid} left running"


def router_processes(pid: int) -> list[int]:
    """The children of `pid` that run `plane up`'s routers (`python -m plane.router_child`)."""
    routers = []
    for child in children(pid):
        with contextlib.suppress(OSError):
            if b"plane.router_child" in Path(f"/proc/{child}/cmdline").read_bytes():
                routers.append(child)
    return routers


def router_process(pid: int) -> int | None:
    """The one child of `pid` that runs `plane up`'s router."""
    routers = router_processes(pid)
    assert len(routers) <= 1, routers
    return routers[0] if routers else None


def until_up(proc: subprocess.Popen[str]) -> list[str]:
    """What `plane up` printed up to its "Ctrl-C" line (it must get there)."""
    assert proc.stdout is not None
    lines: list[str] = []
    while "Ctrl-C" not in (line := proc.stdout.readline()):
        assert line, "".join(lines)
        lines.append(line)
    return lines


def url_of(lines: list[str]) -> str:
    """The NATS URL in `plane up`'s banner."""
    return next(m.group(1) for line in lines
                if (m := re.match(r"plane is up: NATS (\S+)", line)))


def nats_server_process(pid: int) -> int:
    """The one child of `pid` that runs its embedded nats-server."""
    [server] = [c for c in children(pid)
                if b"nats-server" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return server
