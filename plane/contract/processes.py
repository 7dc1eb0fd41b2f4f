"""Child processes the project starts itself (nats-server, tansu, redis-server and Celery in
benchmarks): started so that they die with us (the servers in a process group of their own,
out of a terminal's Ctrl-C), their log's tail kept for errors, stopped by PID, politely
first, and their log readers cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self

import structlog

from plane.contract.lifecycle import cancel_and_wait

log = structlog.get_logger("plane.processes")

__all__ = ["ChildProcess", "cancel_and_wait", "die_with_parent", "free_port", "how_it_ended",
           "own_group_dying_with_parent", "stop_by_pid", "stop_with_parent"]

LOG_TAIL_LINES = 200
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def die_with_parent() -> None:
    """A `preexec_fn`: runs in the child before exec and asks Linux to SIGTERM it if we die
    (no orphans, even when the parent is SIGKILLed)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def own_group_dying_with_parent() -> None:
    """A `preexec_fn` for a server we stop ourselves once what uses it has drained
    (nats-server, tansu): a process group of its own, so that a Ctrl-C at a terminal (SIGINT
    to the whole foreground group) reaches only us. In our group, `plane up`'s nats-server
    got it too and exited at once: the plane's drain had no server left, and a request
    running at the Ctrl-C was never answered (found from outside). And SIGTERM if we die
    (`die_with_parent`)."""
    os.setpgid(0, 0)
    die_with_parent()


def stop_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> None:
    """In a process we spawned (a node group's member, `plane up`'s router): a parent
    killed outright (SIGKILL, OOM) must not leave it serving with nobody to stop it. On Linux
    the kernel then sends it `signum` (prctl PR_SET_PDEATHSIG), SIGTERM by default: it
    drains as on any SIGTERM; a parent gone before we asked is answered the same way at
    once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        log.warning("cannot ask to stop with the parent process", errno=ctypes.get_errno())
    if os.getppid() != parent_pid:  # it died before we asked
        os.kill(os.getpid(), signum)


def free_port() -> int:
    """A port free on 127.0.0.1 now (for servers that cannot report one they picked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def stop_by_pid(
    proc: asyncio.subprocess.Process | None, *, kill: bool = False, timeout_s: float = 10.0
) -> None:
    """SIGTERM (SIGKILL when `kill`) and wait; SIGKILL after `timeout_s`. Idempotent."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def how_it_ended(exit_code: int | None) -> str:
    """A process's end in words: "exit code 3", "killed by SIGKILL"."""
    if exit_code is not None and exit_code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exit_code).name}"
    return f"exit code {exit_code}"


class ChildProcess(ABC):
    """A server run as our child: `start()` (the subclass's: how to run it and when it is
    ready), `stop()` by PID, `restart()` on the same address; the last lines of its log are
    kept in `log_tail` for the error that says why it did not start. `lost` is set when it
    exits once ready while nobody asked it to (killed, crashed), `exit_code` says how:
    whoever owns it decides what that means (`plane up` stops whole)."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._log_task: asyncio.Task[None] | None = None
        self.log_tail: list[bytes] = []
        self.lost = asyncio.Event()
        self.exit_code: int | None = None
        self.program = ""  # its executable's name, once started

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @abstractmethod
    async def start(self, timeout_s: float = 15.0) -> None: ...

    async def _spawn(self, *args: str, log_on_stdout: bool,
                     env: dict[str, str] | None = None) -> asyncio.StreamReader:
        """Start the process; return the stream its log comes on (stderr, or stdout and
        stderr together when `log_on_stdout`)."""
        self.lost.clear()
        self.exit_code = None
        self.program = os.path.basename(args[0])
        self._proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if log_on_stdout else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.STDOUT if log_on_stdout else asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=own_group_dying_with_parent,
        )
        stream = self._proc.stdout if log_on_stdout else self._proc.stderr
        assert stream is not None
        return stream

    def _remember(self, line: bytes) -> None:
        self.log_tail.append(line)
        if len(self.log_tail) > LOG_TAIL_LINES:
            del self.log_tail[: LOG_TAIL_LINES // 2]

    def _last_log(self, lines: int = 20) -> str:
        return b"".join(self.log_tail[-lines:]).decode(errors="replace")

    def _keep_reading(self, stream: asyncio.StreamReader) -> None:
        """Read the log for as long as the process runs (a full pipe would block it), and
        tell when it ends on its own (`lost`)."""
        self._log_task = asyncio.create_task(self._read_log(stream, self._proc))

    async def _read_log(self, stream: asyncio.StreamReader,
                        proc: asyncio.subprocess.Process | None) -> None:
        while line := await stream.readline():
            self._remember(line)
        # Its log ended: it exited. Stopped by us, `stop` has let go of it first.
        if proc is None or self._proc is not proc:
            return
        code = await proc.wait()
        if self._proc is proc:
            self.exit_code = code
            # Its last words when it exited by itself (a crash says why); a signal's victim
            # has none worth repeating.
            why = {"last_log": self._last_log(3)} if code >= 0 else {}
            log.error("a child process exited on its own", program=self.program, pid=proc.pid,
                      how=how_it_ended(code), **why)
            self.lost.set()

    async def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        """Stop by PID (SIGTERM, or SIGKILL when `kill`); idempotent."""
        proc, self._proc = self._proc, None
        await stop_by_pid(proc, kill=kill, timeout_s=timeout_s)
        task, self._log_task = self._log_task, None
        await cancel_and_wait(task)

    async def restart(self, *, kill: bool = False) -> None:
        """Stop and start again on the same address."""
        await self.stop(kill=kill)
        await self.start()

    async def close(self) -> None:
        """Stop for good (subclasses also release what outlives restarts)."""
        await self.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
