"""`plane node --processes N`: one node's slots over N member processes, each an ordinary
node named `<node-id>-p<i>`; the group stops whole (on SIGTERM, or when a member dies)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from plane.contract.config import ConnectOptions, NodeConfig
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import ConfigError
from plane.contract.subjects import Header
from plane.node_group import member_configs, mps_running, shares
from plane.serve import ServeSpec
from plane.stack import PlaneStack
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated, client, plane, wait_until

PLANE = str(Path(sys.executable).parent / "plane")


def healthy(stack: PlaneStack) -> int:
    """The calibrated slots the router knows healthy (none before a node's first advert)."""
    ms = stack.routers[0].models.get("calibrated")
    return ms.healthy_count() if ms is not None else 0


def test_slots_are_split_evenly_and_each_member_has_its_name_slots_and_port() -> None:
    assert shares(5, 2) == [3, 2] and shares(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="at least as many --slots"):
        shares(2, 3)
    spec = ServeSpec(ConnectOptions(url="nats://127.0.0.1:4222"), metrics_port=9465)
    members = member_configs(NodeConfig(model="calibrated", node_id="gpu0", slots=5), spec, 2)
    assert [(c.node_id, c.slots, s.metrics_port, s.connect.name) for c, s in members] == [
        ("gpu0-p0", 3, 9465, "plane-node-gpu0-p0"), ("gpu0-p1", 2, 9466, "plane-node-gpu0-p1")]
    # On a GPU, member 1's slots take the SM partitions after member 0's three.
    assert [c.first_partition for c, _ in members] == [0, 3]
    with pytest.raises(ConfigError, match="needs --slots"):
        member_configs(NodeConfig(model="calibrated", node_id="gpu0"), spec, 2)


def test_mps_is_found_by_its_control_pipe(tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_running(env)
    (tmp_path / "control").touch()  # what nvidia-cuda-mps-control -d makes there
    assert mps_running(env)


def test_the_cli_says_what_is_wrong_with_a_group() -> None:
    out = subprocess.run([PLANE, "node", "--nats", "nats://127.0.0.1:1", "--model",
                          "calibrated", "--processes", "2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--processes needs --slots" in out.stderr, out.stderr


@dataclass
class Group:
    """A `plane node --processes 2` subprocess, a plane (a router) in this process that has
    seen all its slots, and the members' PIDs."""

    proc: subprocess.Popen[bytes]
    stack: PlaneStack
    members: list[int]


@asynccontextmanager
async def running_group(slots: int) -> AsyncIterator[Group]:
    async with EmbeddedNats() as srv:
        proc = subprocess.Popen(
            [PLANE, "node", "--nats", srv.url, "--model", "calibrated", "--slots", str(slots),
             "--processes", "2", "--node-id", "grp", "--backend", "torch",
             "--log-level", "warning"])
        members: list[int] = []
        try:
            async with plane(srv.url, models=("calibrated",), nodes_per_model=0) as stack:
                await wait_until(lambda: healthy(stack) == slots, 60, "the group's slots")
                # The members (not multiprocessing's resource tracker, also a child).
                found = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "spawn_main"],
                                       capture_output=True, text=True, check=True).stdout
                members = [int(p) for p in found.split()]
                assert len(members) == 2, found
                yield Group(proc, stack, members)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for p in members:
                if alive(p):
                    os.kill(p, signal.SIGKILL)


async def test_a_node_over_two_processes_serves_every_slot_and_stops_whole() -> None:
    async with running_group(slots=3) as group, client(group.stack.url) as nc:
        ms = group.stack.routers[0].models["calibrated"]
        assert Counter(v.node for v in ms.slots.values()) == {"grp-p0": 2, "grp-p1": 1}
        # Three long requests at once: one on each slot, both processes busy.
        ledger = await Ledger(nc).start()
        for _ in range(3):
            await ledger.send(NAMES.infer("calibrated"), calibrated(300_000), 3000)
        await ledger.settle(timeout_s=10)
        served = [a[0] for a in ledger.answers.values() if a[0].status == 200]
        assert len(served) == 3, ledger.statuses()
        assert {a.headers.get(Header.NODE) for a in served} == {"grp-p0", "grp-p1"}
        # SIGTERM to the parent drains both members and the group exits 0.
        group.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(group.proc.wait, 30) == 0
        await wait_until(lambda: ms.healthy_count() == 0, 10, "the slots withdrawn")


async def test_a_member_that_dies_stops_the_group_with_an_error() -> None:
    async with running_group(slots=2) as group:
        os.kill(group.members[0], signal.SIGKILL)
        assert await asyncio.to_thread(group.proc.wait, 30) == 1
        await wait_until(lambda: healthy(group.stack) == 0, 10, "the slots gone")


async def test_members_stop_when_the_group_is_killed_outright() -> None:
    """SIGKILL to the parent (no chance to pass anything on): the kernel tells each member
    (PR_SET_PDEATHSIG), and each drains and withdraws its slots as on SIGTERM."""
    async with running_group(slots=2) as group:
        group.proc.kill()
        group.proc.wait()
        await wait_until(lambda: healthy(group.stack) == 0, 15, "the members' slots gone")
        await wait_until(lambda: not any(alive(p) for p in group.members), 15,
                         "the members to exit")


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (an exited member not yet reaped is a zombie: not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
