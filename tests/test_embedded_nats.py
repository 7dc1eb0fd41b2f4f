"""The embedded nats-server's Go runtime: a lone server gets a quarter of the host's cores
(GOMAXPROCS), a cluster's Go's default, unless the environment or the spec says otherwise;
read back from the server's own /varz (what its runtime runs with, not what we passed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from plane.contract.embedded import (
    STORE_LOCK,
    STORE_PREFIX,
    EmbeddedNats,
    NatsServerSpec,
    embedded_gomaxprocs,
    hold_store,
)
from plane.contract.processes import free_port


def test_the_embedded_server_gets_a_quarter_of_the_cores_and_at_least_one() -> None:
    assert [embedded_gomaxprocs(c) for c in (None, 1, 2, 3, 4, 7, 8, 16, 128)] == [
        1, 1, 1, 1, 1, 1, 2, 4, 32]


async def _gomaxprocs(spec: NatsServerSpec) -> tuple[int, int]:
    """(gomaxprocs, cores) of a server started from `spec`, from its /varz."""
    port = free_port()
    spec.extra_args += ["-m", str(port)]
    async with EmbeddedNats(spec):
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5).read())
    varz = json.loads(body)
    return varz["gomaxprocs"], varz["cores"]


async def test_the_embedded_server_runs_on_its_share_of_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    procs, cores = await _gomaxprocs(NatsServerSpec())
    assert cores == os.cpu_count()
    assert procs == embedded_gomaxprocs(cores)


async def test_a_clustered_server_keeps_gos_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    port = free_port()  # a cluster of one, routed to itself (JetStream needs a route)
    spec = NatsServerSpec(server_name="a", cluster_name="c", cluster_port=port,
                          routes=[f"nats://127.0.0.1:{port}"])
    procs, cores = await _gomaxprocs(spec)
    assert procs == cores


async def test_an_operators_gomaxprocs_is_kept_and_a_specs_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMAXPROCS", "3")
    assert (await _gomaxprocs(NatsServerSpec()))[0] == 3
    assert (await _gomaxprocs(NatsServerSpec(gomaxprocs=2)))[0] == 2


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


async def test_a_killed_processs_store_is_swept_by_the_next_server(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """`plane up` killed (SIGKILL) left its server's JetStream store in the temporary
    directory (found from outside): the next lone server removes the stores of processes that
    no longer run, and only those."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{STORE_PREFIX}{dead.pid}-abc"
    (orphan / "jetstream").mkdir(parents=True)
    (orphan / STORE_LOCK).touch()  # its owner's lock, let go as it died
    # A pid this process cannot see (another PID namespace sharing /tmp), whose owner lives
    # and holds its lock: left alone.
    elsewhere = tmp_path / f"{STORE_PREFIX}{dead.pid}-def"
    elsewhere.mkdir()
    held = hold_store(str(elsewhere))
    mine = tmp_path / f"{STORE_PREFIX}{os.getpid()}-xyz"
    mine.mkdir()
    other = tmp_path / f"{STORE_PREFIX}notapid"
    other.mkdir()
    try:
        async with EmbeddedNats() as srv:
            store = srv.spec.store_dir
            assert store is not None and Path(store).parent == tmp_path
            assert not orphan.exists() and elsewhere.exists()
            assert mine.exists() and other.exists()
        assert not _is_dir(store)  # its own, removed as it stops
    finally:
        os.close(held)
