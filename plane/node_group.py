"""`plane node --processes N`: one node's slots served by N processes.

One Python process places at most ~1,500 requests a second (BENCHMARKS.md "CPU per request":
its cost is per NATS message and per loop turn, not the work), fewer than a GPU's slots can
take with short work. A group splits `--slots` as evenly as it can over N member processes;
member i is an ordinary node named `<node-id>-p<i>` with its share of the slots (its own
subjects, consumers, heartbeats and adverts), and its metrics on `--metrics-port` + i. The
routers need nothing new: they see N nodes of one model and keep one budget per model, so
the slot time they learn and promise is the group's.

The parent only supervises: it starts the members (spawned, not forked: a forked copy of a
loop or a CUDA context is not safe), passes SIGTERM and SIGINT on so that each drains as a
lone node does, and returns when they have all exited; killed outright, its members get
SIGTERM from the kernel (Linux). A member that dies while the group is
not stopping stops the whole group with a non-zero exit, so that whatever restarts a node
(systemd, Kubernetes) restarts it whole, never a group short of slots that nobody notices.

On CUDA the members share the device as separate processes: without NVIDIA MPS their kernels
time-slice rather than run side by side. Each member makes its own green contexts, and member
i's slots take the partitions after member i-1's (`NodeConfig.first_partition`), so that with
MPS no two members' slots share SMs. Run MPS with `--processes` on a GPU (each member warns when
it finds none). On an H200, three members under MPS were the best shape measured, and
without it the slot's time past its work doubled (BENCHMARKS.md, "GPU", second session).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Mapping
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

import structlog

from freshness.config import GuardConfig
from plane.contract.config import NodeConfig
from plane.contract.errors import ConfigError
from plane.contract.processes import stop_with_parent
from plane.contract.subjects import InvalidToken, check_token
from plane.serve import ServeSpec

MAX_PORT = 65535

log = structlog.get_logger("plane.node_group")

# How long a member may take to drain after SIGTERM, past the node's own drain, before the
# group kills it (its in-flight requests are then the routers' to answer 503).
STOP_GRACE_S = 10.0
DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def shares(slots: int, processes: int) -> list[int]:
    """`slots` over `processes` members as evenly as possible, the larger shares first."""
    if processes < 1:
        raise ConfigError("--processes must be at least 1")
    if slots < processes:
        raise ConfigError(f"--processes {processes} needs at least as many --slots (got "
                          f"{slots}): each process serves one slot or more")
    base, extra = divmod(slots, processes)
    return [base + (i < extra) for i in range(processes)]


def member_configs(cfg: NodeConfig, spec: ServeSpec, processes: int
                   ) -> list[tuple[NodeConfig, ServeSpec]]:
    """Each member's node configuration and serving spec: its id, slots and metrics port."""
    if cfg.slots is None:
        raise ConfigError("--processes needs --slots: the group's slots, split over them")
    if spec.metrics_port and spec.metrics_port + processes - 1 > MAX_PORT:
        raise ConfigError(f"--metrics-port {spec.metrics_port} leaves no port for member "
                          f"{processes - 1} (member i serves on --metrics-port + i, at most "
                          f"{MAX_PORT}): give a lower --metrics-port, or 0 for free ports")
    out, first = [], cfg.first_partition
    for i, n in enumerate(shares(cfg.slots, processes)):
        member_id = f"{cfg.node_id}-p{i}"
        try:
            check_token("node", member_id)
        except InvalidToken as exc:
            raise ConfigError(f"--node-id is too long for a group's member names "
                              f"({member_id}): {exc}") from None
        port = spec.metrics_port + i if spec.metrics_port else spec.metrics_port
        connect = replace(spec.connect, name=f"plane-node-{member_id}")
        out.append((replace(cfg, node_id=member_id, slots=n, first_partition=first),
                    replace(spec, metrics_port=port, connect=connect)))
        first += n
    return out


def run_group(spec: ServeSpec, cfg: NodeConfig, processes: int, *,
              guard: GuardConfig | None, log_level: str) -> int:
    """Serve `cfg` over `processes` member processes until SIGTERM/SIGINT; the exit code:
    0 when all drained on a signal, 1 when a member died on its own."""
    members = member_configs(cfg, spec, processes)
    spawn = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = []
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for member_cfg, member_spec in members:
            member = spawn.Process(target=_member, name=member_cfg.node_id,
                                   args=(member_spec, member_cfg, guard, log_level,
                                         os.getpid()))
            member.start()
            procs.append(member)
        log.info("node group started", node=cfg.node_id, processes=processes,
                 slots=[m.slots for m, _ in members], pids=[p.pid for p in procs])
        failed = False
        live = list(procs)
        while live:
            for sentinel in wait([p.sentinel for p in live]):
                ended = next(q for q in live if q.sentinel == sentinel)
                ended.join()
                live.remove(ended)
                if not stopping:
                    failed = True
                    log.error("a member of the node group exited: stopping the group",
                              member=ended.name, exit_code=ended.exitcode)
                    stop(signal.SIGTERM, None)
        return 1 if failed else 0
    finally:
        for p in procs:
            p.join(timeout=STOP_GRACE_S)
            if p.is_alive():
                log.error("a member did not stop: killed", member=p.name)
                p.kill()
                p.join()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _member(spec: ServeSpec, cfg: NodeConfig, guard: GuardConfig | None, log_level: str,
            parent_pid: int) -> None:
    """One member: a lone node, in its own spawned process (its own loop, its own imports)."""
    stop_with_parent(parent_pid)
    from plane.contract.lifecycle import exit_now, run
    from plane.contract.logs import configure as configure_logs
    from plane.up import run_node  # the node: torch and triton

    configure_logs(log_level)
    _warn_without_mps(cfg)
    # Its group waits for it: not for the teardown of its torch (`exit_now`).
    exit_now(run(run_node(spec, cfg, guard=guard)))


def mps_running(env: Mapping[str, str] = os.environ) -> bool:
    """Whether an NVIDIA MPS control daemon is up for this process: its pipe directory
    (`CUDA_MPS_PIPE_DIRECTORY`, by default /tmp/nvidia-mps) holds its `control` pipe."""
    return (Path(env.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_MPS_PIPE_DIRECTORY))
            / "control").exists()


def _warn_without_mps(cfg: NodeConfig) -> None:
    """On a GPU, members without MPS take turns on the device instead of sharing it."""
    if cfg.backend == "interpret" or mps_running():
        return
    import torch

    if torch.cuda.is_available():
        log.warning("a node group on a GPU without NVIDIA MPS: its processes' kernels take "
                    "turns on the device (start nvidia-cuda-mps-control -d first)",
                    node=cfg.node_id)
