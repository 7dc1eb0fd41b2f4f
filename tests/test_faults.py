"""Faults with a ledger of every request and every answer: a node killed with SIGKILL
mid-request, the nats-server restarted under load. Exactly one answer per request, nothing
lost; callers of a dead node get a result from another node through the SDK."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import nats
from nats.aio.msg import Msg

from plane.client import Client as PlaneClient
from plane.client import Result
from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header
from plane.router.inflight import InFlight
from tests.ledger import Ledger
from tests.plane_fixtures import (
    NAMES,
    calibrated,
    client,
    plane,
    slots_running,
    slow_steps,
    wait_until,
)

PLANE = str(Path(sys.executable).parent / "plane")
# A call made while the server is down for its restart may be lost with it (core NATS is
# at-most-once) and end in the SDK's own 504 at its deadline; none made later may, and few.
LOST_WINDOW_S = 0.25
MAX_LOST_AT_RESTART = 5
MIN_SERVED = 25
WORK_US = 20_000  # 2 slots, 50 calls/s: a half of the capacity


async def test_node_killed_mid_request() -> None:
    async with EmbeddedNats() as srv:
        victim = subprocess.Popen(
            [PLANE, "node", "--nats", srv.url, "--model", "calibrated", "--slots", "2",
             "--node-id", "victim", "--log-level", "warning"])
        try:
            async with plane(srv.url, models=("calibrated",), slots=2) as stack, \
                    client(srv.url) as nc:
                router = stack.routers[0]
                await wait_until(lambda: router.models["calibrated"].healthy_count() == 4, 30,
                                 "the victim's slots")
                ledger = await Ledger(nc).start()
                # 4 slots, 8 long requests: 4 run (2 on the victim), 4 are refused with tickets.
                for _ in range(8):
                    await ledger.send(NAMES.infer("calibrated"), calibrated(800_000), 3000)
                js = nc.jetstream()

                async def victim_runs_two() -> bool:  # each victim slot has fetched one
                    infos = [await js.consumer_info(NAMES.slots_stream,
                                                    NAMES.slot_consumer("calibrated", "victim", k))
                             for k in (0, 1)]
                    return all(info.num_ack_pending == 1 for info in infos)

                await wait_until(victim_runs_two, 5, "two requests running on the victim")
                os.kill(victim.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                await ledger.settle(timeout_s=6)
                assert ledger.unanswered() == []
                assert ledger.answered_twice() == []
                counts = ledger.statuses()
                assert set(counts) <= {200, 429, 503}, counts
                dead = [i for i in ledger.answers if ledger.status(i) == 503]
                assert counts == {200: 2, 429: 4, 503: 2}, counts
                for i in dead:
                    h = ledger.first(i).headers
                    assert h[Header.NODE] == "victim" and h[Header.REASON] == "unhealthy"
                    # within the request's deadline
                    assert ledger.latency_ms(i) < ledger.deadline_ms[i]
                    assert ledger.first(i).at_s - killed_at < 2.0
                # The SDK retries those callers on another node, which answers.
                sdk = PlaneClient(nc)
                for _ in dead:
                    res = await sdk.invoke("calibrated", {"duration_us": 1000}, deadline_ms=2000)
                    assert res.headers[Header.NODE] == "node0-calibrated"
                # The dead node's slots are gone from the router; orphans expired by TTL.
                assert all(v.node != "victim"
                           for v in router.models["calibrated"].slots.values())

                async def no_orphans() -> bool:
                    info = await js.stream_info(NAMES.slots_stream,
                                                subjects_filter=NAMES.node_slots("victim"))
                    return not info.state.subjects

                await wait_until(no_orphans, 6, "the victim's orphans to expire")
        finally:
            if victim.poll() is None:
                victim.kill()
            victim.wait()


async def test_a_node_killed_before_its_requests_deadline_is_answered_once_it_is_dead(
) -> None:
    """Requests on a node killed with SIGKILL whose deadline (300 ms) passes before its
    heartbeats lapse (1 s): the router asks the node whether it answered them, patiently
    while it may be alive (its server failing over), and answered 2.4 s after they were sent
    (found from outside). Answered once, by the heartbeats' lapse at the latest."""
    ledger, i, took_s = await answered_after_a_node_fault(signal.SIGKILL, 300,
                                                          node_timeout_ms=None)
    assert ledger.status(i) in (503, 504), ledger.statuses()
    # The heartbeat timeout after the kill, the watchdog's tick, the question's last try:
    # not the 2 s of patience on top of the deadline.
    assert took_s < 1.0 + 0.6, took_s


# The router's heartbeat timeout in the two tests after the next: far past the deadline, so
# that an answer before it is the deadline's, not the heartbeats' lapse.
LONG_NODE_TIMEOUT_MS = 3000


async def answered_after_a_node_fault(
        fault: signal.Signals, deadline_ms: int,
        node_timeout_ms: int | None = LONG_NODE_TIMEOUT_MS) -> tuple[Ledger, int, float]:
    """A request placed on a node process (slowed to 800 ms a request) that is sent `fault`
    once it runs it; the ledger, the request and how long after its send it was answered
    (`node_timeout_ms`: the router's heartbeat timeout; None: its default)."""
    async with EmbeddedNats() as srv:
        victim = subprocess.Popen(
            [PLANE, "node", "--nats", srv.url, "--model", "calibrated", "--slots", "1",
             "--node-id", "victim", "--log-level", "warning", "--allow-faults"])
        try:
            overrides = {} if node_timeout_ms is None else {"node_timeout_ms": node_timeout_ms}
            async with plane(srv.url, models=("calibrated",), nodes_per_model=0,
                             router_overrides=overrides) as stack, client(srv.url) as nc:
                router = stack.routers[0]
                await wait_until(lambda: (ms := router.models.get("calibrated")) is not None
                                 and ms.healthy_count() == 1, 30, "the victim's slot")
                await slow_steps(nc, 800_000, node="victim")
                ledger = await Ledger(nc).start()
                js = nc.jetstream()

                async def running() -> bool:
                    info = await js.consumer_info(
                        NAMES.slots_stream, NAMES.slot_consumer("calibrated", "victim", 0))
                    return info.num_ack_pending == 1

                sent_at = time.monotonic()
                i = await ledger.send(NAMES.infer("calibrated"), calibrated(1000), deadline_ms)
                await wait_until(running, 5, "the request running on the victim")
                os.kill(victim.pid, fault)
                await ledger.settle(timeout_s=8)
                assert ledger.unanswered() == [] and ledger.answered_twice() == []
                return ledger, i, ledger.first(i).at_s - sent_at
        finally:
            if victim.poll() is None:
                victim.kill()
            victim.wait()


async def test_a_killed_nodes_request_is_answered_at_its_deadline_not_its_heartbeats() -> None:
    """A node killed (SIGKILL) mid-request: at the deadline the router takes the slot message
    and asks the node whether it answered; the server says nobody listens (its connection is
    gone), and on one server with our own connection steady that is the node's "cannot say":
    504 at deadline + grace. Asked on until its heartbeats lapsed, the answer came after an
    SDK caller's own 504 (/tmp/probeF finding 3)."""
    ledger, i, took_s = await answered_after_a_node_fault(signal.SIGKILL, 300)
    first = ledger.first(i)
    assert (first.status, first.reason) == (504, "deadline"), first.headers
    assert first.headers[Header.NODE] == "victim"
    # Well before the heartbeat timeout (3 s), let alone the question's patience on top.
    assert took_s < LONG_NODE_TIMEOUT_MS / 1000 / 2, took_s


async def test_a_stopped_nodes_request_is_answered_at_its_deadline_not_its_heartbeats() -> None:
    """A node stopped (SIGSTOP) mid-request: its connection stays open, so the question would
    time out again and again; its heartbeats are overdue (half the heartbeat timeout, 1.5 s
    here) by the deadline (1,800 ms), so it is not asked: 504 at deadline + grace, well
    before its heartbeats lapse."""
    ledger, i, took_s = await answered_after_a_node_fault(signal.SIGSTOP, 1800)
    first = ledger.first(i)
    assert (first.status, first.reason) == (504, "deadline"), first.headers
    assert took_s < (1800 + LONG_NODE_TIMEOUT_MS) / 1000 / 2, took_s


async def test_nats_server_restarted_under_load() -> None:
    async with EmbeddedNats() as srv, \
            plane(srv.url, models=("calibrated",), slots=2) as stack:
        sdk_nc_ctx = client(srv.url)
        async with sdk_nc_ctx as nc:
            sdk = PlaneClient(nc)
            calls: dict[int, tuple[float, float, Result]] = {}  # call -> (sent, answered, it)

            async def one(i: int) -> None:
                await asyncio.sleep(i * 0.02)
                t0 = time.monotonic()
                res = await sdk.call("calibrated", {"duration_us": WORK_US}, deadline_ms=3000)
                calls[i] = (t0, time.monotonic(), res)

            load = asyncio.gather(*(one(i) for i in range(100)))
            await asyncio.sleep(0.6)  # pacing: restart with calls in flight
            down_s = time.monotonic()
            await srv.restart()
            up_s = time.monotonic()
            await load
            counts = sorted(Counter(res.status for _, _, res in calls.values()).items())
            for t0, t1, res in calls.values():
                assert res.status in (200, 429, 503, 504)
                # Never past the deadline and the SDK's wait for an answer in the router's
                # grace (`answer_margin_ms`), plus scheduling slack.
                assert t1 - t0 < 3.0 + sdk.config.answer_margin_ms / 1000 + 0.5
            # Nothing lost but what the restart itself swallowed: an attempt with no answer at
            # all (the SDK's own 504) was sent while the server was down, and there are few.
            lost = {i: round(t1 - res.last_attempt_ms / 1000 - down_s, 3)
                    for i, (_, t1, res) in calls.items() if res.local and res.status == 504}
            at_restart = {i: t for i, t in lost.items()
                          if -LOST_WINDOW_S <= t <= up_s - down_s + LOST_WINDOW_S}
            assert lost == at_restart, f"lost (s after the restart began): {lost}, {counts}"
            assert len(lost) <= MAX_LOST_AT_RESTART, (lost, counts)
            # The calls the SDK held back through the outage reach the plane together at the
            # reconnect, a burst past the promise horizon (8 per slot): beyond it they are
            # refused at once, `overloaded` (go elsewhere now). Every call not lost is served
            # or refused by the plane, none left to time out; most made before the restart
            # (30, 20 ms apart) are served.
            # (A 504 the router gave at a deadline that passed in the outage is the plane's
            # answer too: the SDK waits for it past the deadline, `answer_margin_ms`.)
            unserved = {i: (round(t0 - down_s, 2), res.statuses, res.reason, res.local)
                        for i, (t0, _, res) in calls.items()
                        if res.status != 200 and i not in lost}
            assert all(statuses[-1] == 429 or (statuses[-1] == 504 and not local)
                       for _, statuses, _, local in unserved.values()), {
                i: u for i, u in unserved.items() if u[1][-1] != 429}
            ok = sum(1 for _, _, res in calls.values() if res.status == 200)
            assert ok >= MIN_SERVED, (counts, unserved)
            # The plane recovered by itself: new calls succeed.
            t_end = time.monotonic() + 10
            while True:
                res = await sdk.call("calibrated", {"duration_us": 1000}, deadline_ms=1000)
                if res.status == 200:
                    break
                assert time.monotonic() < t_end, res
                await asyncio.sleep(0.1)
        assert stack.routers[0].models["calibrated"].healthy_count() == 2


async def test_requests_running_when_the_server_restarts_are_answered_once() -> None:
    """nats-server killed and started again while requests run on their slots: its memory
    stream comes back empty, so the slot messages are gone for the node (which finds them
    gone when it claims its answer, and stays silent: "the router took it") and for the
    router at the deadline ("the node took it"): nobody answered a plain NATS caller, 4 runs
    of 4 (found from outside; the SDK's own 504 hid it). The router asks the node now, and
    answers what the node did not."""
    async with EmbeddedNats() as srv, \
            plane(srv.url, models=("calibrated",), slots=2) as stack:
        # A caller back on its connection before the deadline (core NATS cannot deliver an
        # answer to a connection that is down).
        nc = await nats.connect(srv.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1)
        inbox = nc.new_inbox()
        got: list[Msg] = []

        async def keep(msg: Msg) -> None:
            got.append(msg)

        await nc.subscribe(inbox, cb=keep)
        rids = [f"restart-{i}" for i in range(2)]
        for rid in rids:
            await nc.publish(NAMES.infer("calibrated"), calibrated(400_000), reply=inbox,
                             headers={Header.REQUEST_ID: rid, Header.DEADLINE_MS: "3000"})
        await wait_until(lambda: slots_running(stack) == 2, 5, "both requests running")
        await srv.restart(kill=True)
        await wait_until(lambda: {(m.headers or {}).get(Header.REQUEST_ID) for m in got}
                         >= set(rids), 10, "an answer to each request")
        await asyncio.sleep(1.0)  # nothing more comes
        await nc.close()
        answers = Counter((m.headers or {}).get(Header.REQUEST_ID) for m in got)
        assert answers == Counter(rids), answers


async def test_a_message_that_lands_after_its_router_answered_it_is_not_answered_again() -> None:
    """A cluster failing over: the router's publish got no PubAck and the message was nowhere
    by the deadline, so the router answered 504 without the broker's word; then the message
    landed and a node fetched it, and answered a second time (tests/test_cluster.py, 2.5 s
    later). Here the two halves by hand, on one server: the router's entry for a placement
    whose outcome is unknown, then its message published after the router answered. The
    node takes it, asks the router, and stays silent; an attempt the router did not answer
    is still answered by the node, once."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        view = next(iter(router.models["calibrated"].slots.values()))
        js = nc.jetstream()
        answers: dict[str, list[Msg]] = {"late-1": [], "late-2": []}
        inbox = nc.new_inbox()

        async def keep(msg: Msg) -> None:
            answers[msg.subject.rsplit(".", 1)[1]].append(msg)

        await nc.subscribe(f"{inbox}.*", cb=keep)
        now = time.monotonic()
        fl = InFlight(request_id="late-1", model="calibrated", reply=f"{inbox}.late-1",
                      node=view.node, key=view.key, placed_s=now, tenant="default",
                      subject=view.subject, stream=view.stream,
                      deadline_s=now + 0.05, answer_by_s=now + 0.1, attempt="1")
        router.inflight.placed(router.inflight.track(fl), None)  # its PubAck never came
        await wait_until(lambda: answers["late-1"], 5, "the router's 504")
        assert answers["late-1"][0].headers[Header.STATUS] == "504"

        def landed(rid: str) -> dict[str, str]:  # the slot message, as the router wrote it
            past_ms = int(time.time() * 1000) - 200
            return {Header.REPLY_TO: f"{inbox}.{rid}", Header.REQUEST_ID: rid,
                    Header.DEADLINE_AT: str(past_ms), Header.DEADLINE_MS: "50",
                    Header.WORK_US: "1000", Header.ROUTER: router.cfg.router_id,
                    Header.ATTEMPT: "1"}

        await js.publish(view.subject, calibrated(1000), headers=landed("late-1"))
        await asyncio.sleep(1.0)  # the node fetches it, takes it, asks the router
        assert len(answers["late-1"]) == 1, [m.headers for m in answers["late-1"]]
        # The control: an attempt the router never answered is the node's to answer.
        await wait_until(lambda: slots_running(stack) == 0, 5, "the slot free")
        await js.publish(view.subject, calibrated(1000), headers=landed("late-2"))
        await wait_until(lambda: answers["late-2"], 5, "the node's 504")
        await asyncio.sleep(0.5)
        assert [m.headers[Header.STATUS] for m in answers["late-2"]] == ["504"]
        assert answers["late-2"][0].headers[Header.NODE] == view.node


async def test_a_message_found_gone_that_its_node_did_not_answer_is_answered_once() -> None:
    """The router finds its placement's message gone at the deadline and the node says it
    did not answer it (a restarted server lost it, or the node's take is still on its way):
    the router answers, and records the attempt first, so that a node whose take then goes
    through asks it before answering and stays silent (without the record the node answered
    too: two answers; found in review)."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        view = next(iter(router.models["calibrated"].slots.values()))
        js = nc.jetstream()
        got: list[Msg] = []
        inbox = nc.new_inbox()

        async def keep(msg: Msg) -> None:
            got.append(msg)

        await nc.subscribe(inbox, cb=keep)
        now = time.monotonic()
        fl = InFlight(request_id="gone-1", model="calibrated", reply=inbox,
                      node=view.node, key=view.key, placed_s=now, tenant="default",
                      subject=view.subject, stream=view.stream,
                      deadline_s=now + 0.05, answer_by_s=now + 0.1, attempt="1~x")
        router.inflight.placed(router.inflight.track(fl), 999_999)  # a sequence not there
        await wait_until(lambda: got, 5, "the router's 504")
        assert got[0].headers[Header.STATUS] == "504"  # type: ignore[index]
        # The node's take, late: the same attempt lands on the slot and the node takes it.
        past_ms = int(time.time() * 1000) - 200
        await js.publish(view.subject, calibrated(1000), headers={
            Header.REPLY_TO: inbox, Header.REQUEST_ID: "gone-1",
            Header.DEADLINE_AT: str(past_ms), Header.DEADLINE_MS: "50",
            Header.WORK_US: "1000", Header.ROUTER: router.cfg.router_id,
            Header.ATTEMPT: "1~x"})
        await wait_until(lambda: slots_running(stack) == 0, 5, "the slot free")
        await asyncio.sleep(1.0)
        assert len(got) == 1, [m.headers for m in got]


async def test_a_node_restarted_with_its_id_cannot_say_its_predecessor_did_not_answer() -> None:
    """The router finds a placement's message gone and asks its node whether it answered;
    the process that answers now started after the placement (a node restarted with the
    same id, its heartbeat not yet heard: a reply can overtake it). It remembers nothing of
    its predecessor's answers and said "no", and the router answered a second time. Its
    reply names its process now, and the router takes a "no" only from the process it
    placed the request with: from another, the message is its predecessor's, answered."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        view = next(iter(router.models["calibrated"].slots.values()))
        got: list[Msg] = []
        inbox = nc.new_inbox()

        async def keep(msg: Msg) -> None:
            got.append(msg)

        await nc.subscribe(inbox, cb=keep)

        def placed(rid: str) -> InFlight:
            now = time.monotonic()
            fl = router.inflight.track(InFlight(
                request_id=rid, model="calibrated", reply=inbox, node=view.node,
                key=view.key, placed_s=now, tenant="default", subject=view.subject,
                stream=view.stream, deadline_s=now + 0.05, answer_by_s=now + 0.1,
                attempt="1"))
            return fl

        # The control: placed with the process that runs now, which did not answer it.
        fl = placed("mine")
        assert fl.instance == stack.nodes[0].standing.instance
        router.inflight.placed(fl, 999_999)  # a sequence not there: gone
        await wait_until(lambda: got, 5, "the router's 504 on its node's no")
        assert [m.headers[Header.STATUS] for m in got] == ["504"]  # type: ignore[index]
        await wait_until(lambda: not router.inflight.entries, 5, "the entry resolved")
        got.clear()
        # Placed with an earlier process of that id: the one now cannot say.
        fl = placed("predecessors")
        fl.instance = "an-earlier-process"
        router.inflight.placed(fl, 999_999)
        await wait_until(lambda: not router.inflight.entries, 5, "the entry resolved")
        await asyncio.sleep(0.5)
        assert got == [], [m.headers for m in got]


async def test_two_requests_a_caller_gave_one_id_stay_apart_in_the_ownership_protocol() -> None:
    """Router and node name a placement by `<request id>#<attempt>` where the broker cannot
    say who answers, and the router finds such a placement's message by it: a caller that
    gives two requests one id (its to choose) must not have one taken or answered for the
    other. Each placement's `Plane-Attempt` on the slot message is the caller's made unique
    (read off the slot subject here), and a message of the same id but another placement is
    not the router's to find."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        view = next(iter(router.models["calibrated"].slots.values()))
        copies = await nc.subscribe(view.subject)  # a core copy of each slot publish
        await nc.flush()
        for _ in range(2):
            m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5,
                                 headers={Header.REQUEST_ID: "dup", Header.ATTEMPT: "1"})
            assert (m.headers or {})[Header.STATUS] == "200"
        attempts = [(await copies.next_msg(timeout=5)).headers[Header.ATTEMPT]
                    for _ in range(2)]
        assert attempts[0] != attempts[1] and all(a.startswith("1~") for a in attempts)
        # A message of that id left on the subject (the slot stopped fetching) belongs to
        # the placement whose attempt it carries.
        slot = stack.nodes[0].slots[0]
        await slot.withdraw("test")
        await nc.jetstream().publish(view.subject, calibrated(0), headers={
            Header.REQUEST_ID: "dup", Header.ATTEMPT: attempts[1], Header.REPLY_TO: "_INBOX.x"})
        now = time.monotonic()

        def placement(attempt: str) -> InFlight:
            return InFlight(request_id="dup", model="calibrated", reply="_INBOX.x",
                            node=view.node, key=view.key, placed_s=now, tenant="default",
                            subject=view.subject, stream=view.stream, deadline_s=now + 5,
                            answer_by_s=now + 6, attempt=attempt)

        assert await router.inflight._find(placement(attempts[0])) is None
        assert await router.inflight._find(placement(attempts[1])) is not None


async def test_a_slot_whose_claim_fails_after_a_reconnect_is_claimed_again() -> None:
    """The embedded server's restart loses its memory-stored slot streams: the node makes
    them again and claims its slots anew. A claim that fails then (JetStream still electing
    or loading answers with timeouts for seconds) used to leave the slot withdrawn for good,
    a node short of a slot until it restarted. It is asked again until the broker takes it."""
    async with EmbeddedNats() as srv, \
            plane(srv.url, models=("calibrated",), slots=1) as stack:
        slot = stack.nodes[0].slots[0]
        claim = slot.claim
        failed: list[float] = []

        async def claim_failing_once() -> None:
            if not failed:
                failed.append(time.monotonic())
                raise TimeoutError  # what nats-py raises when JetStream does not answer
            await claim()

        slot.claim = claim_failing_once  # type: ignore[method-assign]
        async with client(srv.url) as nc:
            sdk = PlaneClient(nc)
            assert (await sdk.call("calibrated", {"duration_us": 100})).status == 200
            await srv.restart()
            await wait_until(lambda: failed, 15, "the claim after the reconnect")
            await wait_until(lambda: slot.claimed, 10, "the slot claimed again")
            res = await sdk.call("calibrated", {"duration_us": 100}, deadline_ms=1000)
            t_end = time.monotonic() + 10
            while res.status != 200:
                assert time.monotonic() < t_end, res
                await asyncio.sleep(0.1)
                res = await sdk.call("calibrated", {"duration_us": 100}, deadline_ms=1000)


async def test_a_plane_stops_cleanly_and_at_once_with_its_server_gone() -> None:
    """Stopped while its server is dead: no error out of the stop (nats-py's close raised
    into it, flushing what it buffered into the dead transport: `plane up` exited 1 with a
    traceback), and no wait on a broker that cannot answer (the node's advert delete waited
    out JetStream's 5 s timeout)."""
    async with EmbeddedNats() as srv:
        stack = plane(srv.url, models=("calibrated",), slots=2)
        started = await stack.__aenter__()
        await srv.stop(kill=True)
        await wait_until(lambda: not any(s.reaches for s in started.nodes[0].slots), 10,
                         "the slots out of reach")
        t0 = time.monotonic()
        await stack.__aexit__(None, None, None)
        assert time.monotonic() - t0 < 3.0
