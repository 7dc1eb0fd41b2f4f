"""The plane on a 3-server JetStream cluster, with one server SIGKILLed under load.

What it proves (DESIGN.md, "Scale beyond one machine" and "Every request ends in exactly one
answer"):

- every request sent gets exactly one answer (200, 429, 503 or 504): none lost, none twice,
  even though the killed server held a slot stream's leader and some of the plane's own
  connections, which must reconnect to the survivors;
- the broker never holds more than one message on a slot subject (nats-server issue #6245
  reported otherwise in clusters: we check it on our version, before and after the kill);
- the plane keeps answering 200 through the kill: the slots are spread over three streams
  (`plane.contract.provision`), the victim leads one, and the other two (and their slots'
  consumers, moved there) serve while it elects a new leader;
- the plane answers 200 on all its slots again after the kill.

The caller and the checker connect only to survivors: a reply sent to a caller whose own
server dies is lost by core NATS whatever the plane does, and that is the SDK's retry's
business, not what this test measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import re
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from plane.auth.store import AuthDir
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.errors import ConfigError
from plane.contract.processes import free_port
from plane.contract.provision import START_WITHIN_S, ProvisionPlan, ensure_all, stream_of_subject
from plane.contract.subjects import Header
from plane.observe.planeview import collect
from plane.stack import PlaneStack, StackConfig
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated

pytestmark = pytest.mark.slow

SERVERS = 3
REPLICAS = 3
# The slot streams of a cluster: one per replica (plane.contract.provision.slot_shards).
SHARDS = [NAMES.slot_shard_stream(i) for i in range(REPLICAS)]
RATE_PER_S = 150.0
WORK_US = 3000
DEADLINE_MS = 1000
BEFORE_KILL_S = 2.0
SETTLED_CALLS, SETTLE_GAP_S = 10, 0.02
# The slot stream's failover here took 4.6-8.1 s (R3 leader election, reconnects): one run in
# a dozen, with 12 s, still had the last RECOVERED_S seconds' requests refused in part.
AFTER_KILL_S = 15.0
# The first seconds after the kill, while the dead server's slot stream elects its leader.
ELECTING_S = 4.0
# Requests sent in the last RECOVERED_S seconds must include 200s: the plane came back.
RECOVERED_S = 2.0
# After the last request: long enough for its deadline, the router's grace and a watchdog
# 504; then a quiet spell in which a second answer would show up.
ANSWER_WAIT_S = 5.0
DUPLICATE_WAIT_S = 1.5
CHECK_PERIOD_S = 0.01
ANSWERS = {200, 429, 503, 504}
# A request sent this close before the kill may have been inside the dead server (see below).
LOST_WINDOW_S = 0.25
MAX_LOST_AT_KILL = 5


@asynccontextmanager
async def cluster(plan: ProvisionPlan | None = None,
                  auth: AuthDir | None = None) -> AsyncIterator[list[EmbeddedNats]]:
    """Three servers, routes to each other, distinct names and stores; yields once JetStream
    has a meta leader and the plane's streams exist as `plan` lays them out (by default,
    three replicas). With `auth`, every server runs its nats.conf (the roles) and the
    streams are made as its admin."""
    servers = await _start_servers(auth)
    try:
        await provision_when_ready(",".join(s.url for s in servers),
                                   plan or ProvisionPlan(names=NAMES, replicas=REPLICAS),
                                   auth=auth)
        yield servers
    finally:
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)


async def _start_servers(auth: AuthDir | None, tries: int = 3) -> list[EmbeddedNats]:
    """The three servers, routed to each other. A route port is chosen here (a JetStream
    cluster needs its routes configured) and bound by its server later: taken meanwhile (by
    some connection's local port, as happened once in CI), that server cannot listen and
    `start` says so; then again with other ports."""
    for attempt in range(tries):
        ports = [free_port() for _ in range(SERVERS)]
        servers = [
            EmbeddedNats(NatsServerSpec(
                server_name=f"n{i}", cluster_name="plane-test", cluster_port=ports[i],
                routes=[f"nats://127.0.0.1:{p}" for j, p in enumerate(ports) if j != i],
                extra_args=["-c", str(auth.conf)] if auth is not None else [],
            ))
            for i in range(SERVERS)
        ]
        started = await asyncio.gather(*(s.start() for s in servers), return_exceptions=True)
        if not any(isinstance(r, BaseException) for r in started):
            return servers
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if attempt == tries - 1 or not all(isinstance(r, ConfigError) for r in failed):
            raise failed[0]
    raise AssertionError("unreachable")


def _login(auth: AuthDir | None) -> dict[str, str]:
    """nats.connect's user and password: the admin's under `auth`, none without."""
    if auth is None:
        return {}
    opts = auth.options("admin")
    return {"user": opts.user or "", "password": opts.password or ""}


async def provision_when_ready(url: str, plan: ProvisionPlan, timeout_s: float = 30.0, *,
                               auth: AuthDir | None = None) -> None:
    """Create the streams and buckets (R3) once there is a meta leader; until then JetStream
    answers 'temporarily unavailable' or times out, so retry."""
    nc = await nats.connect(url.split(","), **_login(auth))
    try:
        js = nc.jetstream(timeout=2.0)
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await js.account_info()
                    await ensure_all(js, plan)
                    return
                except (NatsError, JsError, TimeoutError):
                    await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def slot_stream_leader(nc: Client, stream: str, consumer: str | None = None) -> str:
    js = nc.jetstream()
    info = (await js.stream_info(stream) if consumer is None
            else await js.consumer_info(stream, consumer))
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


async def move_slot_leader(nc: Client, stream: str, to: str, consumer: str | None = None,
                           timeout_s: float = 15.0) -> str:
    """Ask a slot stream's leader (or one of its consumers') to step down in favour of `to`
    (nats-server 2.11+); the worst case to kill is the leader. Returns the leader after."""
    subject = (f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}" if consumer is None
               else f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}")
    body = json.dumps({"placement": {"preferred": to}}).encode()
    async with asyncio.timeout(timeout_s):
        while (leader := await _leader_or_none(nc, stream, consumer)) != to:
            if leader is not None:
                with contextlib.suppress(NatsError, TimeoutError):
                    await nc.request(subject, body, timeout=2)
            await asyncio.sleep(0.25)
    return to


async def serving_after_the_move(nc: Client, timeout_s: float = 15.0) -> None:
    """Until SETTLED_CALLS calls in a row (SETTLE_GAP_S apart) are answered 200: a slot stream
    whose leader just moved holds placements for a moment (its consumers move too)."""
    async with asyncio.timeout(timeout_s):
        in_a_row = 0
        while in_a_row < SETTLED_CALLS:
            with contextlib.suppress(NatsError, TimeoutError):
                reply = await nc.request(NAMES.infer("calibrated"), calibrated(WORK_US),
                                         timeout=DEADLINE_MS / 1000,
                                         headers={Header.DEADLINE_MS: str(DEADLINE_MS)})
                ok = (reply.headers or {}).get(Header.STATUS) == "200"
                in_a_row = in_a_row + 1 if ok else 0
            await asyncio.sleep(SETTLE_GAP_S)


async def _leader_or_none(nc: Client, stream: str, consumer: str | None) -> str | None:
    try:
        return await slot_stream_leader(nc, stream, consumer)
    except (NatsError, JsError, TimeoutError, AssertionError):
        return None


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@dataclass
class SubjectChecker:
    """Reads the slot stream's per-subject counts as often as it can; keeps the maximum."""

    max_seen: int = 0
    reads: int = 0
    reads_after_kill: int = 0
    failures: int = 0
    worst: dict[str, int] = field(default_factory=dict)
    killed: bool = False

    async def run(self, nc: Client, stop: asyncio.Event) -> None:
        js = nc.jetstream(timeout=1.0)
        while not stop.is_set():
            for stream in SHARDS:
                try:
                    info = await js.stream_info(stream, subjects_filter=NAMES.slots_all())
                except (NatsError, JsError, TimeoutError):
                    self.failures += 1  # no leader for a moment after the kill
                    continue
                per_subject = info.state.subjects or {}
                self.reads += 1
                self.reads_after_kill += self.killed
                top = max(per_subject.values(), default=0)
                if top > self.max_seen:
                    self.max_seen, self.worst = top, dict(per_subject)
            await asyncio.sleep(CHECK_PERIOD_S)


async def send_load(ledger: Ledger, until_s: float) -> None:
    """Calibrated requests at a steady rate, each with its own reply subject, until `until_s`."""
    body = calibrated(WORK_US)
    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic()) < until_s:
        due = t0 + i / RATE_PER_S
        if due > now:
            await asyncio.sleep(due - now)
        await ledger.send(NAMES.infer("calibrated"), body, DEADLINE_MS)
        i += 1
    await ledger.nc.flush()


@dataclass
class Replies:
    """Each answer the plane publishes (a node's, a router's): when, and through which
    server (the port its connection was on), by reply subject. A reply handed to a server
    that is killed before it passes it on is lost by core NATS (at most once), whatever the
    plane does: the caller's timeout (the SDK's retry) answers it."""

    sent: dict[str, tuple[float, int | None]] = field(default_factory=dict)

    def patch(self, mp: pytest.MonkeyPatch) -> None:
        # A router publishes its answers; a node makes each into a command that its done
        # batch writes in the same turn (gpu_node/done_batch.py).
        real_publish = importlib.import_module("plane.router.requests").publish
        real_command = importlib.import_module("gpu_node.slot").command

        async def published(nc: Client, subject: str, *args: object, **kw: object) -> None:
            self._record(nc, subject)
            await real_publish(nc, subject, *args, **kw)  # type: ignore[arg-type]

        def made(nc: Client, subject: str, *args: object, **kw: object) -> bytes:
            self._record(nc, subject)
            return real_command(nc, subject, *args, **kw)  # type: ignore[arg-type]

        mp.setattr("plane.router.requests.publish", published)
        mp.setattr("gpu_node.slot.command", made)

    def _record(self, nc: Client, subject: str) -> None:
        url = nc.connected_url
        self.sent[subject] = (time.monotonic(), url.port if url is not None else None)

    def into(self, reply: str, port: int, since_s: float, until_s: float) -> bool:
        """Whether the plane's answer on `reply` went out through the server on `port`
        between `since_s` and `until_s`."""
        at = self.sent.get(reply)
        return at is not None and at[1] == port and since_s <= at[0] <= until_s


async def test_cluster_keeps_one_answer_per_request_and_depth_one_when_a_server_dies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    replies = Replies()
    replies.patch(monkeypatch)
    async with cluster() as servers:
        all_urls = ",".join(s.url for s in servers)
        cfg = StackConfig(connect=ConnectOptions(url=all_urls), models=("calibrated",),
                          slots=3, nodes_per_model=2, routers=2, replicas=REPLICAS)
        async with PlaneStack(cfg) as stack:
            # The victim: the server holding most of the plane's own connections, made the
            # slot stream's leader, so the kill costs both a leader and live connections.
            by_port = {port_of(s.url): s for s in servers}
            on = [port_of(c.connected_url.netloc) for c in stack.clients
                  if c.connected_url is not None]
            victim = by_port[max(by_port, key=on.count)]
            survivors = [s for s in servers if s is not victim]
            plane_on_victim = on.count(port_of(victim.url))
            async with _client(survivors[0].url) as caller, \
                    _client(survivors[1].url) as watcher:
                # One slot stream led from the victim, the others (and their slots'
                # consumers) from the survivors: the kill stops a third of the slots, and
                # the rest must serve through its election. (Where JetStream elected them
                # varies from run to run; this is the case it must always survive.) Twice:
                # a router keeping leaders apart may have moved one while the layout was
                # half made; once made, it is apart, and the routers leave it.
                for _ in range(2):
                    await move_slot_leader(watcher, SHARDS[0], victim.spec.server_name or "")
                    for stream, to in zip(SHARDS[1:], survivors, strict=True):
                        name = to.spec.server_name or ""
                        await move_slot_leader(watcher, stream, name)
                        for c in await watcher.jetstream().consumers_info(stream):
                            await move_slot_leader(watcher, stream, name, c.name)
                    # Not what this test measures: start once the plane serves again.
                    await serving_after_the_move(caller)
                assert await slot_stream_leader(watcher, SHARDS[0]) == victim.spec.server_name

                ledger = await Ledger(caller).start()
                await caller.flush()
                checker = SubjectChecker()
                stop_checking = asyncio.Event()

                t_start = time.monotonic()
                t_kill = t_start + BEFORE_KILL_S
                t_end = t_kill + AFTER_KILL_S
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(checker.run(watcher, stop_checking))
                    load = tg.create_task(send_load(ledger, t_end))
                    await asyncio.sleep(max(0.0, t_kill - time.monotonic()))
                    assert checker.reads > 0, "the checker never read the slot stream"
                    t_kill = time.monotonic()
                    await victim.stop(kill=True)
                    t_killed = time.monotonic()
                    checker.killed = True
                    await load
                    await ledger.settle(timeout_s=ANSWER_WAIT_S, quiet_s=DUPLICATE_WAIT_S)
                    stop_checking.set()

                new_leader = await slot_stream_leader(watcher, SHARDS[0])
                reconnected = [c.connected_url.netloc for c in stack.clients
                               if c.is_connected and c.connected_url is not None]

        report = _report(ledger, t_kill, checker, plane_on_victim, new_leader)
        refused_by_broker = stack.metrics.broker_refusals.labels("calibrated")._value.get()
        report += f"\nslot publishes the broker refused (depth one): {refused_by_broker:g}"
        # What ticket holders found and whether promises pinned slot time (the ledger never
        # comes back: a 429 that pins is a no-show), per router: to tell a refusal burst
        # from pinned no-shows apart from one from slots the broker still held.
        for r in stack.routers:
            report += (f"\n{r.cfg.router_id}: redemption {r.admission.redemption}, "
                       f"ticket stats {dict(r.admission.stats)}")
        print(report)
        # Exactly one answer per request: none lost, none twice, all of a known kind. The one
        # exception is a request or its answer that was inside the killed server's process
        # at the kill (on its way to a router connected there; an answer a node or router
        # connected there published as it died): core NATS is at-most-once, and the
        # caller's own timeout (the SDK's retry) is its answer. Such a request was sent, or
        # its answer published, within moments of the kill, and there are very few. (By
        # send time alone, a request decided 250 ms after it was sent, on a host busy with
        # the rest of the suite, whose answer went into the dying server, was counted lost.)
        lost = ledger.unanswered()
        victim_port = port_of(victim.url)
        answer_lost = [i for i in lost if replies.into(
            f"{ledger.inbox}.{i}", victim_port, t_kill - LOST_WINDOW_S, t_killed + LOST_WINDOW_S)]
        at_kill = [i for i in lost if i in answer_lost
                   or t_kill - LOST_WINDOW_S <= ledger.sent_s[i] <= t_killed]
        print(f"lost at the kill: {len(at_kill)}, {len(answer_lost)} of them answered by the "
              "plane through the killed server as it died")
        assert lost == at_kill and len(lost) <= MAX_LOST_AT_KILL, f"lost: {lost[:20]}\n{report}"
        twice = {i: a for i, a in ledger.answers.items() if len(a) != 1}
        assert not twice, f"answered more than once: {dict(list(twice.items())[:10])}\n{report}"
        assert set(ledger.answers) <= set(ledger.sent_s), report
        odd = {i: a for i, a in ledger.answers.items() if a[0].status not in ANSWERS}
        assert not odd, f"unexpected statuses: {dict(list(odd.items())[:10])}\n{report}"
        echoed = [i for i, a in ledger.answers.items()
                  if a[0].reason != "no-responders" and a[0].request_id != Ledger.request_id(i)]
        assert not echoed, f"request id not echoed: {echoed[:10]}\n{report}"
        # Depth one held on every read, before and after the kill (issue #6245).
        assert checker.max_seen <= 1, f"a slot subject held {checker.worst}\n{report}"
        assert checker.reads_after_kill > 10, report
        # The plane served before the kill and serves again after it.
        before = [i for i, t in ledger.sent_s.items() if t < t_kill]
        recent = [i for i, t in ledger.sent_s.items() if t > t_end - RECOVERED_S]
        ok = [i for i in ledger.answers if ledger.status(i) == 200]  # (a lost one is not ok)
        assert len(set(before) & set(ok)) > 0.9 * len(before), report
        assert len(set(recent) & set(ok)) > 0.9 * len(recent), report
        # ... on the dead server's stream's slots too (slot 0 of each node: shard 0).
        slots_back = {(ledger.answers[i][0].msg.headers or {}).get(Header.SLOT)
                      for i in set(recent) & set(ok)}
        assert "0" in slots_back, f"slots serving at the end: {slots_back}\n{report}"
        # ... and through the election of the dead server's slot stream (4-9 s): the other
        # two streams' slots serve (with one shared stream, every request then was a 503).
        electing = [i for i, t in ledger.sent_s.items() if t_kill <= t < t_kill + ELECTING_S]
        assert len(set(electing) & set(ok)) > 0.8 * len(electing), report
        # The plane's own connections left the dead server.
        assert plane_on_victim >= 1
        assert len(reconnected) == len(stack.clients), report
        assert all(port_of(u) != port_of(victim.url) for u in reconnected), report
        assert new_leader != victim.spec.server_name, report


async def test_a_shared_slot_stream_made_first_keeps_its_layout_and_gets_three_replicas() -> None:
    """A process without `--replicas` (or an older version) made the shared slot stream with
    one replica: a cluster's processes leave the layout (nodes find their slots in it) and
    raise its replicas to theirs, as for any of the plane's streams."""
    async with cluster(ProvisionPlan(names=NAMES)) as servers, _client(servers[0].url) as nc:
        js = nc.jetstream(timeout=5.0)
        await ensure_all(js, ProvisionPlan(names=NAMES, replicas=REPLICAS))
        info = await js.stream_info(NAMES.slots_stream)
        assert info.config.num_replicas == REPLICAS
        slot = NAMES.slot("calibrated", "n1", 1)
        assert await stream_of_subject(js, slot) == NAMES.slots_stream


async def test_a_plane_started_while_its_buckets_elect_a_leader_starts_once_they_have_one(
        ) -> None:
    """The server leading the node-advert bucket is SIGKILLed and a plane started at once on
    the survivors: its router and node ask JetStream again while the bucket elects its
    leader (4-9 s) and serve once it has one (they stopped at once on a bare TimeoutError:
    `plane.contract.provision.ensure_all_at_start`). The test waits as long as the node's own
    start does (START_WITHIN_S for its provisioning, as long again for its slot's claim), so
    that a start that gives up fails here with its own error: on a loaded host the leaders
    came 13-35 s after the kill (five runs beside two busy loops), and in two clean clones
    of 22 the claim was still unanswered at the 40 s this test used to allow."""
    async with cluster() as servers:
        async with _client(servers[0].url) as nc:
            leader = (await nc.jetstream(timeout=5.0).stream_info(
                f"KV_{NAMES.nodes_bucket}")).cluster
            assert leader is not None and leader.leader
        victim = next(s for s in servers if s.spec.server_name == leader.leader)
        await victim.stop(kill=True)
        survivors = [s for s in servers if s is not victim]
        cfg = StackConfig(connect=ConnectOptions(url=",".join(s.url for s in survivors)),
                          models=("calibrated",), slots=1, replicas=REPLICAS)
        async with (asyncio.timeout(2 * START_WITHIN_S + 10), PlaneStack(cfg),
                    _client(survivors[0].url) as nc):
            for _ in range(50):
                reply = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                         headers={Header.DEADLINE_MS: "1000"})
                if (reply.headers or {}).get(Header.STATUS) == "200":
                    break
                await asyncio.sleep(0.2)
            assert (reply.headers or {}).get(Header.STATUS) == "200", reply.headers


@pytest.fixture
def roles(tmp_path: Path) -> AuthDir:
    d = AuthDir(tmp_path / "auth", rounds=4)  # the cheapest bcrypt cost: tests connect a lot
    d.init()
    return d


@pytest.mark.parametrize("secured", [False, True], ids=["open", "under-the-roles"])
async def test_a_router_keeps_slot_leaders_apart_and_consumers_with_their_streams(
        secured: bool, roles: AuthDir) -> None:
    """Every slot stream led from one server (a failover can leave them so): a router moves
    them apart and leads each slot's consumer from its stream's server, so that the next dead
    server stops a third of the slots, not all (`plane.contract.slot_leaders`). Under the
    roles too: the router's and the node's allow lists carry what this takes (the leader
    step-downs, the consumer lists, the stream names), and no server logs a violation."""
    auth = roles if secured else None
    async with cluster(auth=auth) as servers, _client(servers[0].url, auth) as nc:
        one = servers[0].spec.server_name or ""
        for stream in SHARDS:
            await move_slot_leader(nc, stream, one)
        url = ",".join(s.url for s in servers)
        cfg = StackConfig(connect=roles.options("admin", url) if auth else ConnectOptions(url=url),
                          roles=roles.roles() if auth else {},
                          models=("calibrated",), slots=3, replicas=REPLICAS)
        async with PlaneStack(cfg) as stack:
            js = nc.jetstream(timeout=5.0)

            async def apart() -> bool:
                # (A stream whose leader the router is moving right now answers the API
                # after its election, or answers with no leader yet: "not yet", as on CI's
                # host once and in a clean clone's run, 2026-12-07.)
                try:
                    leaders = {s: await _leader_or_none(nc, s, None) for s in SHARDS}
                    if None in leaders.values() or len(set(leaders.values())) != len(SHARDS):
                        return False
                    led = [(s, c.cluster.leader if c.cluster else None)
                           for s in SHARDS for c in await js.consumers_info(s)]
                except (NatsError, JsError, TimeoutError):
                    return False
                return all(leader == leaders[s] for s, leader in led)

            async with asyncio.timeout(30):  # a router looks every 10 s
                while not await apart():
                    await asyncio.sleep(0.5)
            consumers = [c for s in SHARDS for c in await js.consumers_info(s)]
            assert len(consumers) == 3  # one slot per shard
            # A moved consumer's standing pull heard "409 Leadership Change" and asked the
            # new leader at once: not an error (no back-off), and every slot serves.
            pulls = [s._pull for s in stack.nodes[0].slots]
            assert all(p is not None and p.errors == 0 for p in pulls)
            replies = await asyncio.gather(*(
                nc.request(NAMES.infer("calibrated"), calibrated(20_000), timeout=5,
                           headers={Header.DEADLINE_MS: "2000"}) for _ in range(3)))
            assert sorted((r.headers or {}).get(Header.SLOT) or "" for r in replies) == \
                ["0", "1", "2"]
            # `plane status` shows the layout: three streams, three leaders, and all replicas
            # current (a follower of a leader just moved catches up for a moment).
            async with asyncio.timeout(10):
                while True:
                    view = await collect(nc, NAMES)
                    assert sorted(f.stream for f in view.slot_streams) == SHARDS
                    assert len({f.leader for f in view.slot_streams}) == len(SHARDS)
                    if all(f.current == f.replicas == REPLICAS for f in view.slot_streams):
                        break
                    await asyncio.sleep(0.2)
        violations = [line for s in servers for line in s.violations]
        assert violations == []


@asynccontextmanager
async def _client(url: str, auth: AuthDir | None = None) -> AsyncIterator[Client]:
    nc = await nats.connect(url, allow_reconnect=False, **_login(auth))
    try:
        yield nc
    finally:
        await nc.close()


def _report(ledger: Ledger, t_kill: float, checker: SubjectChecker, plane_on_victim: int,
            new_leader: str) -> str:
    def counts(ids: list[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for i in ids:
            if i in ledger.answers:
                out[ledger.status(i)] = out.get(ledger.status(i), 0) + 1
        return dict(sorted(out.items()))

    before = [i for i, t in ledger.sent_s.items() if t < t_kill]
    after = [i for i, t in ledger.sent_s.items() if t >= t_kill]
    first_ok = min((ledger.answers[i][0].at_s - t_kill for i in after
                    if i in ledger.answers and ledger.status(i) == 200), default=None)
    timeline: dict[int, dict[str, int]] = {}
    for i, t in ledger.sent_s.items():
        key = f"{ledger.status(i)} {ledger.answers[i][0].reason}" if i in ledger.answers \
            else "lost"
        second = timeline.setdefault(int((t - t_kill) // 1), {})
        second[key] = second.get(key, 0) + 1
    lines = "\n".join(f"  {s:+3d} s: {dict(sorted(c.items()))}"
                      for s, c in sorted(timeline.items()))
    # What the refusals and 503s said, digits masked: a host stall or a plane that lost track.
    said: Counter[str] = Counter()
    example: dict[str, str] = {}
    for a in ledger.answers.values():
        if a[0].status in (429, 503):
            text = a[0].msg.data[:160].decode(errors="replace")
            said[masked := re.sub(r"\d+", "#", text)] += 1
            example.setdefault(masked, text)
    lines += "".join(f"\n  {n} x {example[text]}" for text, n in said.most_common(4))
    return (
        f"cluster: sent {len(ledger.sent_s)} (before kill {counts(before)}, after "
        f"{counts(after)}), unanswered {len(ledger.unanswered())}, answered twice "
        f"{sum(len(a) > 1 for a in ledger.answers.values())}; first 200 after the kill at "
        f"+{first_ok if first_ok is None else round(first_ok, 3)} s; max per-subject count "
        f"{checker.max_seen} over {checker.reads} reads ({checker.reads_after_kill} after the "
        f"kill, {checker.failures} failed); plane connections on the victim {plane_on_victim}; "
        f"slot stream leader now {new_leader}\nby send time from the kill:\n{lines}"
    )


async def test_a_server_that_cannot_bind_its_route_port_fails_to_start() -> None:
    """nats-server says "ready" before it binds its route port, then exits when that port is
    taken: `start` waits for the route listener too, so the cluster is not one peer short."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedNats(NatsServerSpec(
            server_name="n0", cluster_name="plane-test", cluster_port=port,
            routes=[f"nats://127.0.0.1:{free_port()}"]))
        with pytest.raises(ConfigError, match=f"cannot listen on {port}: the port is in use"):
            await server.start()
        await server.close()
        assert not server.running
