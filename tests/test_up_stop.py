"""How `plane up` stops, as a user stops it: a Ctrl-C at its terminal, and its own death.
Whatever runs at the stop is answered exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import nats
from nats.aio.msg import Msg

from gpu_node.standing import SETTLE_S
from plane.contract.embedded import EmbeddedNats
from plane.contract.natsconn import close_now
from plane.contract.subjects import Header, Names
from tests.up_process import (
    alive,
    children,
    left_none,
    nats_server_process,
    plane_up,
    router_processes,
    until_up,
    url_of,
)

NAMES = Names()
# A router process whose `plane up` died is gone within this (its drain took 5 to 10 s
# when the server went too; a generous bound on a loaded host).
STOPS_WITHIN_S = 4.0
# An idle `plane up` exits within this of a Ctrl-C (0.2 s here; it was 1.4-2.5 s).
IDLE_EXIT_S = 1.2


async def _caller(url: str) -> nats.NATS:
    """A caller's connection, which ends with the plane's server (no reconnects to log)."""
    async def quiet(exc: Exception) -> None:
        pass

    return await nats.connect(url, allow_reconnect=False, error_cb=quiet)


async def _answers(nc: nats.NATS, proc: subprocess.Popen[str], work_ms: int,
                   sent: asyncio.Event) -> list[Msg]:
    """Every answer to one `calibrated` request of `work_ms` sent now (`sent` set once it
    is out), gathered until `plane up` has exited and a second more (a second answer would
    come by then, or the server is gone)."""
    answers: list[Msg] = []

    async def keep(msg: Msg) -> None:
        answers.append(msg)

    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=keep)
    body = json.dumps({"duration_us": work_ms * 1000}).encode()
    await nc.publish(NAMES.infer("calibrated"), body, reply=inbox,
                     headers={Header.DEADLINE_MS: str(work_ms + 10_000)})
    await nc.flush()
    sent.set()
    await asyncio.to_thread(proc.wait, 60)
    await asyncio.sleep(1.0)
    return answers


async def test_a_ctrl_c_at_the_terminal_drains_what_runs_before_the_server_stops() -> None:
    # A terminal's Ctrl-C is SIGINT to its whole foreground process group. It reached the
    # embedded nats-server too, which exited at once: the drain had no server, and the
    # request running then was never answered (found from outside). The server is in a
    # group of its own now, and `plane up` stops it last.
    with plane_up("--models", "calibrated", "--log-level", "warning",
                  start_new_session=True) as proc:  # its own group, as at a terminal
        lines = until_up(proc)
        kids = children(proc.pid)
        nc = await _caller(url_of(lines))
        try:
            # The draining node asked its router, stopped first, whether it had answered
            # the request (it cannot have, before the deadline), and waited out its
            # silence: the answer came ~1 s late (found from outside).
            asked: list[Msg] = []

            async def question(msg: Msg) -> None:
                asked.append(msg)

            await nc.subscribe(NAMES.router_answered("*"), cb=question)
            await asyncio.sleep(SETTLE_S + 0.5)  # a node just up answers through the broker
            sent = asyncio.Event()
            answers = asyncio.create_task(_answers(nc, proc, 1500, sent))
            await sent.wait()
            await asyncio.sleep(0.5)  # placed and running (or in the router's inbox: drained)
            os.killpg(proc.pid, signal.SIGINT)
            got = await answers
        finally:
            await nc.close()
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert proc.returncode == 0, "".join(lines) + rest
        assert [(m.headers or {}).get(Header.STATUS) for m in got] == ["200"], rest
        assert [m.data for m in asked] == [], rest
        assert "Traceback" not in rest, rest
        left_none(kids)


async def test_a_killed_plane_ups_router_answers_what_its_nodes_ran_and_stops() -> None:
    # `plane up` SIGKILLed, on a server of the user's (`--nats`): its nodes die with it, and
    # its router's process gets SIGTERM from the kernel. It stopped as on any SIGTERM,
    # leaving what it had placed to nodes that were dead: the request running then was never
    # answered (found from outside). It answers it now, once, and stops promptly, quietly.
    async with EmbeddedNats() as server:
        with plane_up("--nats", server.url, "--models", "calibrated",
                      "--log-level", "warning") as proc:
            until_up(proc)
            [router] = router_processes(proc.pid)
            nc = await _caller(server.url)
            try:
                sent = asyncio.Event()
                answers = asyncio.create_task(_answers(nc, proc, 3000, sent))
                await sent.wait()
                await asyncio.sleep(0.5)  # placed and running (or unread: then refused)
                proc.kill()
                t0 = time.monotonic()
                got = await answers
                while alive(router) and time.monotonic() - t0 < 30:
                    await asyncio.sleep(0.02)
                router_s = time.monotonic() - t0
            finally:
                await nc.close()
            assert proc.stdout is not None
            rest = proc.stdout.read()  # the router's log too: it wrote on our pipe
    assert [((m.headers or {}).get(Header.STATUS), (m.headers or {}).get(Header.REASON))
            for m in got] in ([("503", "unhealthy")], [("503", "no-capacity")]), rest
    assert router_s < STOPS_WITHIN_S, f"the router's process took {router_s:.1f} s\n{rest}"
    assert "Traceback" not in rest and "plane up's process is gone" in rest, rest


def test_an_idle_plane_up_exits_promptly_on_ctrl_c() -> None:
    # An idle plane took 1.4-2.5 s to exit here (4-6 s on a GPU host), most of it the
    # interpreter's teardown of torch and triton after everything had stopped, in `plane up`
    # and again in its router's process (found from outside).
    with plane_up("--models", "calibrated", "--log-level", "warning",
                  start_new_session=True) as proc:
        lines = until_up(proc)
        kids = children(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=30)
        took_s = time.monotonic() - t0
        assert proc.stdout is not None
        rest = proc.stdout.read()
    assert rc == 0, "".join(lines) + rest
    assert took_s < IDLE_EXIT_S, f"plane up took {took_s:.2f} s to exit\n{rest}"
    left_none(kids)


@contextlib.contextmanager
def _kept_frozen(pid: int) -> Iterator[None]:
    """`pid` stopped (SIGSTOP) and kept so when its parent dies. The kernel continues
    (SIGCONT) the stopped members of a process group that its members' parents' death
    orphans: a process of ours in its group keeps it from being orphaned."""
    keeper = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: os.setpgid(0, pid))
    try:
        os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        keeper.kill()
        keeper.wait()


async def test_a_killed_plane_ups_router_waits_for_nothing_once_its_server_died_too() -> None:
    # `plane up` SIGKILLed with its own server: the server dies with it, and what the
    # router's process asked it at its stop (the takes of the requests it had placed) could
    # never be answered: it waited out their 5 s (found from outside, as a 5 s drain). The
    # server is frozen here while the router asks, then killed: no answer can come.
    with plane_up("--models", "calibrated", "--log-level", "warning") as proc:
        lines = until_up(proc)
        [router] = router_processes(proc.pid)
        server = nats_server_process(proc.pid)
        nc = await _caller(url_of(lines))
        try:
            sent = asyncio.Event()
            answers = asyncio.create_task(_answers(nc, proc, 3000, sent))
            await sent.wait()
            await asyncio.sleep(0.5)  # placed and running
            with _kept_frozen(server):
                proc.kill()
                t0 = time.monotonic()
                await asyncio.sleep(0.3)  # the router asks the frozen server
                os.kill(server, signal.SIGKILL)
            while alive(router) and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.02)
            router_s = time.monotonic() - t0
            await answers  # none can come: the server is gone
        finally:
            await close_now(nc)
        assert proc.stdout is not None
        rest = proc.stdout.read()
    assert router_s < STOPS_WITHIN_S, f"the router's process took {router_s:.1f} s\n{rest}"
    assert "Traceback" not in rest and "plane up's process is gone" in rest, rest
