"""A router in its own process beside the nodes: how `plane up` runs its router.

One process for the whole plane puts the router's decisions and the nodes' slots on one event
loop and one GIL: under load each delays the other (the router's refusals hold back the
node's done-events and answers; the slots' work holds back the router's reading). On an H200
the router in a process of its own answered 2-3x more at 3,000/s of 2 ms work (BENCHMARKS.md,
"GPU", second session: 1,603-2,927/s against 707-891/s). On this project's 2-core CPU host,
where the load generator, the broker and the plane share two cores, it is level or a little
better (BENCHMARKS.md, "Forty-first session"), for ~0.5 s more start-up and ~50 MB more memory.

`RouterChild` starts `plane router`'s work (`plane.serve.run_router`) in a process of its own
(`python -P -m plane.router_child` on our `sys.path`: a fresh interpreter, never a fork of
this one, whose loop and CUDA context a copy would share), with the stack's connection, names
and router settings given to it whole on its stdin (credentials never on a command line).
The child:
- is in its own process group, so a Ctrl-C at a terminal reaches only `plane up`, which
  stops the router first and the nodes after it, as in one process;
- gets PARENT_DIED (SIGHUP) from the kernel if `plane up` is killed outright (no router
  left serving): it stops as on SIGTERM, and knows that the nodes `plane up` ran
  (`parent_nodes`) died with it, so what it placed on them is taken and answered 503 at
  once (`Router.nodes_gone`); it used to stop as on any SIGTERM, and nobody answered those.
  With `plane up`'s own server gone too (`parent_server`), it waits for nothing;
- serves its metrics on a loopback port of its own, which `plane up`'s /metrics merges into
  one exposition (`plane.contract.metrics.MergedMetrics`), so a scrape sees one plane.

`start` returns once the process runs; `wait_ready` once the router sees every healthy slot
the stack's nodes advertise (its status on NATS, `<prefix>.router.<id>.status`). `lost` is
set when the child exits while nobody asked it to, so that `plane up` stops whole (and exits
1) rather than serve a plane with no router.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import sys
import threading
from functools import partial
from types import FrameType

import structlog
from nats.aio.client import Client

from plane.contract.config import RouterConfig
from plane.contract.errors import PlaneError, Unavailable
from plane.contract.lifecycle import Lifecycle
from plane.contract.processes import (
    cancel_and_wait,
    free_port,
    stop_by_pid,
    stop_with_parent,
)
from plane.serve import ServeSpec

log = structlog.get_logger("plane.router_child")

# The signal the kernel sends us when `plane up` dies (PR_SET_PDEATHSIG): not SIGTERM, which
# a live `plane up` sends for its orderly stop.
PARENT_DIED = signal.SIGHUP
STOP_GRACE_S = 15.0  # past the router's own drain (5 s) before it is killed
READY_POLL_S = 0.05


class RouterChild(Lifecycle):
    """`async with RouterChild(spec, cfg, log_level, metrics=True) as r:` a router process
    connecting with `spec`'s options; `r.metrics_url` its /metrics, on a loopback port of its
    own (None without metrics)."""

    def __init__(self, spec: ServeSpec, cfg: RouterConfig, log_level: str,
                 metrics: bool, parent_nodes: tuple[str, ...] = (),
                 parent_server: bool = False) -> None:
        port = free_port() if metrics else None
        self.spec = ServeSpec(spec.connect, port, "127.0.0.1", spec.replicas)
        self.cfg = cfg
        self.log_level = log_level
        self.parent_nodes = parent_nodes  # the nodes in our process: they die with it
        self.parent_server = parent_server  # our embedded nats-server: it dies with us too
        self.metrics_url = f"http://127.0.0.1:{port}/metrics" if port is not None else None
        self.lost = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        if self._proc is not None:
            return
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "plane.router_child", stdin=asyncio.subprocess.PIPE,
            env=child_env(),
            # Its own process group (uvloop takes no `process_group`); it asks for PARENT_DIED
            # at our death itself (`main`), checking that we are still there.
            preexec_fn=partial(os.setpgid, 0, 0))
        self._proc = proc
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((self.spec, self.cfg, self.log_level, os.getpid(),
                                       self.parent_nodes, self.parent_server)))
        await proc.stdin.drain()
        proc.stdin.close()
        self._watch = asyncio.create_task(self._watch_exit(proc))

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if not self._stopping:
            # Exit 0 is a drain on a signal sent to it, not by us (a supervisor that signals
            # every process of the service at once, as systemd does): `plane up` stops too,
            # every model's plane with it, which is worth a warning (at info, one model's
            # router signalled alone took the whole plane down without one).
            (log.warning if code == 0 else log.error)(
                "the router's process exited on its own: the plane stops",
                router=self.cfg.router_id, exit_code=code)
            self.lost.set()

    async def wait_ready(self, nc: Client, want: dict[str, int], timeout_s: float) -> None:
        """Until the router says it sees at least `want[model]` healthy slots of each model it
        serves. Raises `Unavailable` when its process exits first, or after `timeout_s`."""
        subject = self.cfg.names.router_status(self.cfg.router_id)
        served = {m: n for m, n in want.items() if self.cfg.serves(m)}
        try:
            async with asyncio.timeout(timeout_s):
                while True:  # polled: the answer is in another process
                    if await self._sees(nc, subject, served):
                        return
                    await asyncio.sleep(READY_POLL_S)
        except TimeoutError:
            raise Unavailable(f"router {self.cfg.router_id} did not see the nodes' slots "
                              f"({served}) within {timeout_s:g} s: its log above says why"
                              ) from None

    async def _sees(self, nc: Client, subject: str, served: dict[str, int]) -> bool:
        if self._proc is None or self._proc.returncode is not None:
            raise Unavailable(
                f"router {self.cfg.router_id}'s process exited while starting (exit code "
                f"{self._proc.returncode if self._proc else None}): its log above says why")
        try:
            reply = await nc.request(subject, b"", timeout=0.5)
        except Exception:  # not subscribed yet (no responders), or no answer yet
            return False
        models = json.loads(reply.data).get("models", {})
        return all(models.get(m, {}).get("healthy", 0) >= n for m, n in served.items())

    async def stop(self) -> None:
        """SIGTERM: the router drains as on any SIGTERM; killed after STOP_GRACE_S."""
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None:
            log.info("stopping the router's process", router=self.cfg.router_id,
                     pid=self._proc.pid)
        await stop_by_pid(self._proc, timeout_s=STOP_GRACE_S)
        await cancel_and_wait(self._watch)


def child_env() -> dict[str, str]:
    """The child's environment: ours, with our `sys.path` as its PYTHONPATH, so that it
    imports the very modules we run (as multiprocessing's spawn does). With `-m` alone Python
    puts the working directory first on the child's path (`-P` keeps it off), and a `plane/`
    folder there (a checkout of another version, a benchmark's worktree) was imported in the
    place of ours: another router than the one `plane up` was started with, or none."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def main() -> None:
    """The child: a lone router (`plane router`'s work), given its settings on stdin."""
    spec, cfg, log_level, parent_pid, parent_nodes, parent_server = pickle.load(
        sys.stdin.buffer)
    orphaned = threading.Event()

    def parent_died(signum: int, frame: FrameType | None) -> None:
        # The kernel's word (PARENT_DIED), apart from a live `plane up`'s SIGTERM (its
        # orderly stop, whose nodes drain themselves): then a stop as on SIGTERM, which also
        # answers what ran on the parent's nodes. The parent's thread that started us is
        # gone by then; `getppid()` may still name the parent, whose other threads end.
        orphaned.set()
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(PARENT_DIED, parent_died)
    stop_with_parent(parent_pid, PARENT_DIED)
    from plane.contract.lifecycle import exit_now, run
    from plane.contract.logs import configure as configure_logs
    from plane.serve import Gone, run_router

    def gone_at_stop() -> Gone | None:
        if not orphaned.is_set():
            return None
        log.warning("plane up's process is gone, and its nodes with it: stopping",
                    router=cfg.router_id, parent_pid=parent_pid, nodes=parent_nodes)
        return Gone(parent_nodes, f"plane up's process {parent_pid} died", parent_server)

    configure_logs(log_level)
    try:
        code = run(run_router(spec, cfg, gone_at_stop))
    except PlaneError as exc:
        # A log line, not a traceback: the error is a setting's (`--replicas 3` against a lone
        # server), `plane up` meets it too and says it once, as `error: ...`.
        log.error("the router's process cannot start", router=cfg.router_id, error=str(exc))
        code = 2
    exit_now(code)  # `plane up` waits for us: not for the interpreter's teardown too


if __name__ == "__main__":
    main()
