"""Processes and their identities (issue 16): a node stopped with requests running, a node
restarted under its id while the old process still holds requests, and two processes with one
node or router id. Real nats-server, real routers and nodes; every request must end in exactly
one answer (the Ledger sees a second one, or none). Each case failed before its fix."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from gpu_node.node import Node
from gpu_node.standing import SETTLE_S, Other, Standing
from plane.contract.config import NodeConfig, RouterConfig
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import IdentityInUse
from plane.contract.identity import Heard, Instances
from plane.contract.messages import (
    Heartbeat,
    NodeAdvert,
    SlotAdvert,
    heartbeat_decoder,
    json_encoder,
)
from plane.contract.subjects import Header
from plane.pulse.bodies import default_body
from plane.router import Router
from plane.stack import PlaneStack
from tests.ledger import Ledger
from tests.plane_fixtures import (
    NAMES,
    calibrated,
    client,
    plane,
    slots_running,
    status,
    wait_until,
)

pytestmark = pytest.mark.slow

PLANE = str(Path(sys.executable).parent / "plane")
NODE = "node0-calibrated"


def _healthy(stack: PlaneStack, model: str, node: str) -> int:
    ms = stack.routers[0].models.get(model)
    return 0 if ms is None else sum(1 for v in ms.slots.values() if v.node == node and v.healthy)


def _exactly_once(ledger: Ledger) -> None:
    assert ledger.unanswered() == [], f"no answer: {ledger.unanswered()}"
    assert ledger.answered_twice() == [], {
        i: [a.status for a in ledger.answers[i]] for i in ledger.answered_twice()}


def test_the_process_started_last_speaks_for_a_node_id() -> None:
    seen = Instances()
    assert seen.compare("n1", "a", 100) is Heard.SAME  # the first heard
    seen.adopt("n1", "a", 100)
    assert seen.compare("n1", "a", 100) is Heard.SAME
    assert seen.compare("n1", "b", 200) is Heard.NEWER  # a restart
    assert seen.compare("n1", "b", 50) is Heard.OLDER  # one the current process replaced
    assert seen.compare("n1", "c", 100) is Heard.NEWER  # same start: the token decides
    assert seen.compare("n2", "b", 50) is Heard.SAME  # ids are apart
    seen.forget("n1")
    assert seen.compare("n1", "b", 50) is Heard.SAME
    # A heartbeat from a node older than the fields: one unnamed process, as before.
    old = heartbeat_decoder.decode(b'{"node": "n1", "at_ms": 1, "adverts": []}')
    assert (old.instance, old.started_ms, old.stopping) == ("", 0, False)


def test_a_node_answers_through_the_broker_whenever_a_router_may_have_acted() -> None:
    st = Standing(period_s=0.25, instance="b", started_ms=200)
    assert st.must_take(0.0, 0.0)  # before the first heartbeat
    st.heartbeat(10.0)
    assert st.must_take(10.5, 10.5)  # fetched before routers surely knew this process
    t = 10.0 + SETTLE_S
    for beat in range(1, 9):  # steady heartbeats, up to t + 1
        st.heartbeat(10.0 + 0.25 * beat)
    assert not st.must_take(t + 0.1, t + 1.1)
    assert st.must_take(t + 0.1, t + 1.6)  # heartbeats lapsed now (a stalled loop) ...
    st.heartbeat(t + 1.7)
    assert st.must_take(t + 0.1, t + 1.7)  # ... and since it was fetched, even if sent again
    assert not st.must_take(t + 1.8, t + 1.9)
    # Our own heartbeat, a predecessor draining, an older process, a newer one.
    def hb(instance: str, started_ms: int, stopping: bool = False) -> Heartbeat:
        return Heartbeat(node="n1", at_ms=0, adverts=[], instance=instance,
                         started_ms=started_ms, stopping=stopping)
    assert st.heard(hb("b", 200)) is Other.NONE
    assert st.heard(hb("a", 300, stopping=True)) is Other.NONE
    assert st.heard(hb("a", 100)) is Other.OLDER and not st.superseded
    assert st.heard(hb("c", 300)) is Other.NEWER and st.superseded
    assert st.must_take(t + 1.8, t + 1.9)  # replaced: every answer takes


# -- A: a node stopped with requests running -------------------------------------------------
async def test_a_stopping_node_finishes_its_requests_and_answers_each_once() -> None:
    """The stopping heartbeat used to make the router take the running requests and answer
    503 while the node finished them in its drain and answered 200: two answers each. Now
    routers only stop placing there, and the node's answers are the only ones (200)."""
    async with plane(models=("calibrated",), slots=2, backend="torch") as stack, \
            client(stack.url) as nc:
        ledger = await Ledger(nc).start()
        for _ in range(2):
            await ledger.send(NAMES.infer("calibrated"), calibrated(600_000), 5000)
        await wait_until(lambda: slots_running(stack) == 2, 5, "both requests running")
        await stack.nodes[0].stop()  # drains: both finish within drain_timeout_s (5 s)
        await ledger.settle(timeout_s=3, quiet_s=0.5)
        _exactly_once(ledger)
        assert ledger.statuses() == {200: 2}, ledger.statuses()
        # It is gone for new work: refused at once, never placed on the stopped node.
        m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
        assert status(m) == 503, m.headers


async def test_a_drain_shorter_than_the_work_still_gives_one_answer_each() -> None:
    """Work longer than the drain: the node answers 503 at the end of its drain, through
    the broker (it takes the message), and nobody else answers."""
    async with plane(models=("calibrated",), slots=2, backend="torch",
                     node_overrides={"drain_timeout_s": 0.3}) as stack, \
            client(stack.url) as nc:
        ledger = await Ledger(nc).start()
        for _ in range(2):
            await ledger.send(NAMES.infer("calibrated"), calibrated(1_500_000), 5000)
        await wait_until(lambda: slots_running(stack) == 2, 5, "both requests running")
        await stack.nodes[0].stop()
        await ledger.settle(timeout_s=3, quiet_s=1.5)  # past the work: no late 200 either
        _exactly_once(ledger)
        assert ledger.statuses() == {503: 2}, ledger.statuses()
        for i in ledger.answers:
            h = ledger.first(i).headers
            assert h[Header.NODE] == NODE and h[Header.REASON] == "unhealthy"


# -- B: a restart under the same id ----------------------------------------------------------
async def test_b_a_new_process_with_the_id_answers_what_the_stalled_one_left() -> None:
    """The old `n1` stalls (SIGSTOP) holding two requests; a new `n1` starts with one slot.
    Its claim used to purge the old one's message unseen, and the router, finding it gone at
    the deadline, assumed the node had answered: nobody answered. Now the new process takes
    the leftover on its slot and answers 503, the router treats the old process's other
    request as a dead node's (503), and the old one, resumed, answers nothing more."""
    async with EmbeddedNats() as srv:
        old = subprocess.Popen(
            [PLANE, "node", "--nats", srv.url, "--model", "calibrated", "--slots", "2",
             "--node-id", "n1", "--backend", "torch", "--log-level", "warning"])
        try:
            async with plane(srv.url, models=()) as stack, client(srv.url) as nc, \
                    client(srv.url) as node_nc:
                await wait_until(lambda: _healthy(stack, "calibrated", "n1") == 2, 30,
                                "the old n1's slots")
                ledger = await Ledger(nc).start()
                for _ in range(2):
                    await ledger.send(NAMES.infer("calibrated"), calibrated(2_000_000), 8000)
                js = nc.jetstream()

                async def old_holds_two() -> bool:  # each of its slots has fetched one
                    infos = [await js.consumer_info(NAMES.slots_stream,
                                                    NAMES.slot_consumer("calibrated", "n1", k))
                             for k in (0, 1)]
                    return all(info.num_ack_pending == 1 for info in infos)

                await wait_until(old_holds_two, 5, "the old n1 holding both requests")
                os.kill(old.pid, signal.SIGSTOP)
                t0 = time.monotonic()
                new = Node(node_nc, NodeConfig(node_id="n1", model="calibrated", slots=1,
                                               backend="torch"))
                await new.start()
                assert time.monotonic() - t0 < 5.0  # a stalled process does not hold the id
                try:
                    await ledger.settle(timeout_s=3, quiet_s=0.3)
                    assert ledger.unanswered() == [], "the old process's requests were lost"
                    assert ledger.statuses() == {503: 2}, ledger.statuses()
                    for i in ledger.answers:  # before the deadline, not at it
                        assert ledger.latency_ms(i) < ledger.deadline_ms[i] - 1000
                    os.kill(old.pid, signal.SIGCONT)  # its work is done: it must stay silent
                    await asyncio.sleep(1.5)
                    _exactly_once(ledger)
                    # The id is the new process's: it serves.
                    m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5,
                                         headers={Header.DEADLINE_MS: "2000"})
                    assert status(m) == 200 and (m.headers or {})[Header.NODE] == "n1"
                finally:
                    await new.stop()
        finally:
            if old.poll() is None:
                os.kill(old.pid, signal.SIGCONT)
                old.terminate()
                try:
                    old.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    old.kill()
            old.wait()


async def test_b_a_claim_answers_what_it_finds_on_its_subject_and_never_purges() -> None:
    """A request placed on n1's slot by a router that then died, with no n1 running: the
    n1 that starts used to purge it unseen, and its caller never heard back. Now the claim
    takes it and answers 503 (retry elsewhere)."""
    async with plane(models=()) as stack, client(stack.url) as nc, \
            client(stack.url) as node_nc:
        answers: list[Msg] = []

        async def got(msg: Msg) -> None:
            answers.append(msg)

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=got)
        deadline_at_ms = int(time.time() * 1000) + 10_000
        await nc.jetstream().publish(NAMES.slot("calibrated", "n1", 0), calibrated(0), headers={
            Header.REPLY_TO: inbox, Header.REQUEST_ID: "orphan-1",
            Header.DEADLINE_AT: str(deadline_at_ms), Header.WORK_US: "0",
            Header.ROUTER: "gone", Header.NATS_TTL: "30s"})
        node = Node(node_nc, NodeConfig(node_id="n1", model="calibrated", slots=1,
                                        backend="torch"))
        await node.start()
        try:
            await wait_until(lambda: answers, 3, "an answer to the orphan")
            await asyncio.sleep(0.5)
            assert len(answers) == 1
            h = answers[0].headers or {}
            assert h[Header.STATUS] == "503" and h[Header.REASON] == "unhealthy"
            assert h[Header.NODE] == "n1" and h[Header.REQUEST_ID] == "orphan-1"
            await wait_until(lambda: _healthy(stack, "calibrated", "n1") == 1, 3, "the slot")
            m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
            assert status(m) == 200  # and the slot is free
        finally:
            await node.stop()


async def test_b_a_restart_waits_for_the_stopping_process_and_every_request_is_answered_once(
) -> None:
    """A rolling restart: the old process drains while the new one starts under its id. The
    new one waits until the old one is gone (it used to start at once and purge), the old
    one's requests end with its 200s, and the new one serves after."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc, client(stack.url) as node_nc:
        ledger = await Ledger(nc).start()
        await ledger.send(NAMES.infer("calibrated"), calibrated(800_000), 5000)
        await wait_until(lambda: slots_running(stack) == 1, 5, "the request running")
        old = stack.nodes[0]
        new = Node(node_nc, NodeConfig(node_id=NODE, model="calibrated", slots=1,
                                       backend="torch"))
        stopping = asyncio.create_task(old.stop())
        # The old one says it is stopping first (the router has heard it and placed nothing).
        await wait_until(lambda: _healthy(stack, "calibrated", NODE) == 0, 3,
                         "the old one's stopping heartbeat")
        await new.start()
        started_s = time.monotonic()
        try:
            await stopping
            await ledger.settle(timeout_s=3, quiet_s=0.5)
            _exactly_once(ledger)
            assert ledger.first(0).at_s < started_s, "it did not wait for the old one"
            assert ledger.statuses() == {200: 1}, ledger.statuses()
            await wait_until(lambda: _healthy(stack, "calibrated", NODE) == 1, 5,
                            "the new process's slot")
            m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
            assert status(m) == 200
        finally:
            await new.stop()


# -- C: two processes with one id ------------------------------------------------------------
async def test_c_a_node_whose_id_a_live_node_has_is_refused_whatever_its_model() -> None:
    """Two nodes with one id used to start without a word (one model: they purged each
    other's consumers; two models: one's heartbeat kept the other's slots alive)."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as node_nc:
        for model in ("calibrated", "risk"):
            twin = Node(node_nc, NodeConfig(node_id=NODE, model=model, slots=1,
                                            backend="torch"))
            with pytest.raises(IdentityInUse, match="--node-id") as err:
                await twin.start()
            assert err.value.ident == NODE and not twin.slots
        # The first one never noticed: it serves on.
        m = await node_nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
        assert status(m) == 200 and (m.headers or {})[Header.NODE] == NODE


async def test_c_nodes_of_two_models_on_one_host_need_no_node_id() -> None:
    """The default id names the model (`n-<hostname>-<model>`): a `calibrated` and a `risk`
    node on one host start side by side and both serve (with `n-<hostname>` for both, the
    second was refused as a twin)."""
    async with plane(models=(), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        nodes = [Node(nc, NodeConfig(model=m, slots=1, backend="torch"))
                 for m in ("calibrated", "risk")]
        try:
            for node in nodes:
                await node.start()
            ids = [node.cfg.node_id for node in nodes]
            assert ids[0] != ids[1] and all(i.endswith(m) for i, m in
                                            zip(ids, ("calibrated", "risk"), strict=True))
            for node in nodes:
                model = node.cfg.model
                await wait_until(lambda m=model, n=node: _healthy(stack, m, n.cfg.node_id) == 1,
                                 5, f"the {model} node's slot")
                m = await nc.request(NAMES.infer(model), default_body(model), timeout=5)
                assert status(m) == 200 and (m.headers or {})[Header.NODE] == node.cfg.node_id
        finally:
            for node in nodes:
                await node.stop()


async def test_c_one_process_heartbeat_never_keeps_another_models_slots_alive() -> None:
    """Heartbeats of two processes with id `n1`, one serving `risk`, one `calibrated` (as
    when two nodes share an id). The `risk` one is killed: its slots used to stay healthy
    for good (the other's heartbeats kept `n1` alive), and risk callers got 504s. Now the
    router listens to the process started last only."""
    async with plane(models=(), router_overrides={"node_timeout_ms": 500}) as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]

        def heartbeat(instance: str, started_ms: int, model: str) -> bytes:
            advert = NodeAdvert(node="n1", model=model, backend="torch", at_ms=0,
                                slots=[SlotAdvert(k=0, subject=NAMES.slot(model, "n1", 0))])
            return json_encoder.encode(Heartbeat(node="n1", at_ms=0, adverts=[advert],
                                                 instance=instance, started_ms=started_ms))

        async def beat(body: bytes, until: asyncio.Event) -> None:
            while not until.is_set():
                await nc.publish(NAMES.health("n1"), body)
                await asyncio.sleep(0.1)

        risk_dead, calibrated_dead = asyncio.Event(), asyncio.Event()
        now_ms = int(time.time() * 1000)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(beat(heartbeat("a", now_ms - 1000, "risk"), risk_dead))
            await wait_until(lambda: "risk" in router.models and router.models["risk"].slots,
                            3, "the risk process's slot")
            tg.create_task(beat(heartbeat("b", now_ms, "calibrated"), calibrated_dead))
            await wait_until(lambda: "calibrated" in router.models
                             and router.models["calibrated"].slots, 3,
                             "the calibrated process's slot")
            risk_dead.set()  # killed
            # Gone within a few node timeouts (it used to stay healthy for good).
            await wait_until(lambda: not router.models["risk"].slots, 5,
                             "the dead risk process's slots to go")
            assert list(router.models["calibrated"].slots) == ["n1/0"]
            m = await nc.request(NAMES.infer("risk"), b'{"features": [' + b",".join(
                [b"0"] * 32) + b"]}", timeout=5, headers={Header.DEADLINE_MS: "300"})
            assert status(m) == 503 and (m.headers or {})[Header.REASON] == "no-capacity"
            calibrated_dead.set()


async def test_c_a_router_whose_id_a_live_router_has_is_refused() -> None:
    """Two routers with one id used to start without a word: a request forwarded to that id
    reached both, and both ran it. A router stopped under the id frees it at once."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        twin = Router(nc, RouterConfig(router_id="router0"))
        with pytest.raises(IdentityInUse, match="--router-id"):
            await twin.start()
        m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
        assert status(m) == 200
        # Stopped, the id is free again: a router starts under it without waiting.
        await stack.routers[0].stop()
        again = Router(nc, RouterConfig(router_id="router0"))
        t0 = time.monotonic()
        await again.start()
        try:
            assert time.monotonic() - t0 < 3.0  # not the 10 s a stopping one is given
            await wait_until(lambda: _healthy_in(again, "calibrated") == 1, 3, "the slot")
            m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
            assert status(m) == 200
        finally:
            await again.stop()


def _healthy_in(router: Router, model: str) -> int:
    ms = router.models.get(model)
    return 0 if ms is None else ms.healthy_count()
