"""Shared fixtures: every test gets its own real nats-server on a free loopback port, stopped
by PID afterwards. Fixtures are factories that clean up after themselves."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it is imported (its own library is decorated then), so it
# must be set before anything imports triton: the `interpret` backend's tests run in-process.
# On a CPU machine the `auto` backend is torch either way.
os.environ.setdefault("TRITON_INTERPRET", "1")


import contextlib
import faulthandler
import gc
import random
import sys
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import TextIO

import nats
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.embedded import EmbeddedNats
from plane.contract.lifecycle import freeze_startup_heap
from plane.contract.replies import ok_headers
from plane.contract.subjects import Header, Names
from tests.leftovers import kill_all, left_running


def pytest_report_header() -> str:
    return f"seed: {_seed()} (set PLANE_TEST_SEED to repeat)"


def _seed() -> int:
    return int(os.environ.get("PLANE_TEST_SEED", "20261129"))


# Past pytest-timeout's own limit (pyproject: 180 s), a last guard that needs no GIL. Its
# timer is a Python thread: a clean clone's run once hung 10 minutes in a Kafka bridge test
# with it silent (a C call holding the GIL, most likely librdkafka's), until CI's own limit.
# faulthandler's watchdog is a C thread: it prints every thread's stack and ends the run.
HARD_TIMEOUT_S = 300


_real_stderr: TextIO = sys.__stderr__ or sys.stderr


def pytest_configure(config: pytest.Config) -> None:
    """The run's real stderr, for the hard timeout's dump: pytest captures fd 2 by then (a
    dump there would be lost with the process), so take a copy while its capture is off."""
    global _real_stderr
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture()
    try:
        _real_stderr = os.fdopen(os.dup(2), "w")
    finally:
        if capman is not None:
            capman.resume_global_capture()


# Every process a test starts inherits this mark (set in the session's environment at its
# start): one still running when the session ends was left behind, a test that did not stop
# what it started. `scripts/gpu_plane.sh` left a serving `plane up` on every run unnoticed
# until a session's note found two. Such a session fails, naming them (they are killed).
SESSION_MARK = "PLANE_TEST_SESSION"


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[SESSION_MARK] = uuid.uuid4().hex


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the commands that compute do before they serve (`plane.contract.lifecycle`):
    the imports' heap (torch's ~155k objects) frozen out of the cyclic collector's reach.
    This process runs routers and nodes on its loop; without it every full collection walked
    that heap for 100-500 ms on a busy host, and one stopped a Node.js caller's first
    request past its 200 ms deadline (`test_any_language`: a 504 in two clean clones)."""
    import gpu_node.node  # noqa: F401  (torch, triton: the node's, imported by its tests anyway)

    freeze_startup_heap()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    mark = os.environ.get(SESSION_MARK)
    if not mark:
        return
    left = left_running(f"{SESSION_MARK}={mark}")
    if not left:
        return
    kill_all(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) that tests started were still running at the end "
             "(killed now): stop what a test starts",
             *(f"  {pid}: {cmd}" for pid, cmd in left)]
    if reporter is not None:
        reporter.ensure_newline()
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)
    if session.exitstatus == 0:
        session.exitstatus = 1


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()  # as `lifecycle.run` does: native extensions check for leaks at exit
    if _real_stderr is not sys.__stderr__:
        _real_stderr.close()


# The test running now, by id: the hard timeout's dump names threads, not the test, and the
# progress line of `pytest -q` is lost with the process; `make test` prints this file when
# the run fails (a hang in a Kafka test's consumer close was seen once more, 2026-12-03).
CURRENT_TEST = Path(__file__).resolve().parent.parent / ".pytest_cache" / "current-test"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Every test, its fixtures' set-up and tear-down included, under the hard timeout."""
    with contextlib.suppress(OSError):
        CURRENT_TEST.parent.mkdir(exist_ok=True)
        CURRENT_TEST.write_text(item.nodeid + "\n")
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True, file=_real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _structlog_config() -> Iterator[None]:
    """A command run in-process (click's CliRunner) configures structlog for the whole
    process: put back what was there, so that no test logs through another's set-up."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def rng() -> random.Random:
    """A seeded random source; the seed is printed in the report header."""
    return random.Random(_seed())


@pytest.fixture
async def nats_server() -> AsyncIterator[EmbeddedNats]:
    async with EmbeddedNats() as srv:
        yield srv


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def seen(nc: Client) -> AsyncIterator[list[dict[str, str]]]:
    """A stand-in router on `plane.infer.>` that answers 200 and records each request's
    headers (what a caller of the plane actually sent)."""
    headers: list[dict[str, str]] = []

    async def answer(msg: Msg) -> None:
        h = dict(msg.headers or {})
        headers.append(h)
        await nc.publish(msg.reply, b'{"duration_us": 1}',
                         headers=ok_headers(h.get(Header.REQUEST_ID, "x"), "n1", 0, 1))

    sub = await nc.subscribe(Names().infer_all(), cb=answer)
    await nc.flush()  # the server has the subscription before anyone calls
    yield headers
    await sub.unsubscribe()
