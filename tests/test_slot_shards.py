"""Slots spread over several streams (a cluster's layout, `plane.contract.provision`), on one
real server: slot k in shard k mod shards, depth one in each, nodes and routers using the
stream the broker names, and a router passing over a stream that answers no-responders (a
cluster electing its leader: here, one deleted) for a slot in another.

The failover itself, with a killed server, is `tests/test_cluster.py`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from nats.aio.client import Client
from nats.js.errors import APIError, NotFoundError

from plane.contract.embedded import EmbeddedNats
from plane.contract.messages import Heartbeat, NodeAdvert, SlotAdvert, json_encoder
from plane.contract.provision import (
    ProvisionPlan,
    ensure_all,
    ensure_slot_stream,
    stream_of_subject,
)
from plane.contract.subjects import Header
from plane.router.service import Router
from tests.plane_fixtures import NAMES, calibrated, plane, wait_until

SHARDS = 3
MODEL, GHOST, NODE = "calibrated", "ghost", "node0-calibrated"


async def sharded(nc: Client) -> None:
    await ensure_all(nc.jetstream(), ProvisionPlan(names=NAMES, slot_shards=SHARDS))


async def test_slot_k_lives_in_shard_k_mod_shards_with_depth_one(nc: Client) -> None:
    await sharded(nc)
    js = nc.jetstream()
    for k in (0, 1, 2, 3, 7, 1023):
        subject = NAMES.slot(MODEL, "n1", k)
        assert await stream_of_subject(js, subject) == NAMES.slot_shard_stream(k % SHARDS)
    subject = NAMES.slot(MODEL, "n1", 4)
    await js.publish(subject, b"first")
    with pytest.raises(APIError, match="maximum messages per subject"):
        await js.publish(subject, b"second")
    # A process whose plan is the shared stream (one server, or an older version) leaves the
    # layout as the first creator set it.
    await ensure_slot_stream(js, ProvisionPlan(names=NAMES))
    with pytest.raises(NotFoundError):
        await js.stream_info(NAMES.slots_stream)
    assert await stream_of_subject(js, subject) == NAMES.slot_shard_stream(1)


async def test_a_slot_number_past_the_layout_is_an_error_that_says_what_to_do(nc: Client) -> None:
    await sharded(nc)
    with pytest.raises(NotFoundError, match="provision the plane's streams"):
        await stream_of_subject(nc.jetstream(), NAMES.slot(MODEL, "n1", 1024))


async def test_nodes_and_routers_use_the_stream_the_broker_names(
        nats_server: EmbeddedNats, nc: Client) -> None:
    await sharded(nc)
    async with plane(nats_server.url, models=(MODEL,), slots=SHARDS) as stack:
        node = stack.nodes[0]
        assert [s.stream for s in node.slots] == [NAMES.slot_shard_stream(k)
                                                  for k in range(SHARDS)]
        views = stack.routers[0].models[MODEL].slots.values()
        assert sorted(v.stream for v in views) == sorted(s.stream for s in node.slots)
        replies = await asyncio.gather(*(
            nc.request(NAMES.infer(MODEL), calibrated(20_000), timeout=5,
                       headers={Header.DEADLINE_MS: "2000"}) for _ in range(SHARDS)))
        assert [(r.headers or {}).get(Header.STATUS) for r in replies] == ["200"] * SHARDS
        assert {(r.headers or {}).get(Header.SLOT) for r in replies} == {
            str(k) for k in range(SHARDS)}


@asynccontextmanager
async def ghost(nc: Client, router: Router) -> AsyncIterator[None]:
    """Heartbeats advertising slot 0 of node `ghost`, in shard 0: a node whose stream fell
    silent and that has not heard yet (a real node hears it from its own pull, in a cluster
    only seconds later: `tests/test_slot_reach.py`)."""
    advert = NodeAdvert(node=GHOST, model=MODEL, backend="torch", at_ms=0, slots=[
        SlotAdvert(k=0, subject=NAMES.slot(MODEL, GHOST, 0), stream=NAMES.slot_shard_stream(0))])
    beat = json_encoder.encode(Heartbeat(node=GHOST, at_ms=0, adverts=[advert],
                                         instance="ghost", started_ms=1))
    stop = asyncio.Event()

    async def heartbeats() -> None:
        while not stop.is_set():
            await nc.publish(NAMES.health(GHOST), beat)
            await asyncio.sleep(0.1)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(heartbeats())
        await wait_until(lambda: f"{GHOST}/0" in router.models[MODEL].slots, 5,
                         "the router to hear the ghost's slot")
        try:
            yield
        finally:
            stop.set()


async def test_a_silent_slot_stream_is_passed_over_for_a_slot_in_another(
        nats_server: EmbeddedNats, nc: Client) -> None:
    await sharded(nc)
    async with plane(nats_server.url, models=(MODEL,), slots=SHARDS) as stack:
        router = stack.routers[0]
        async with ghost(nc, router):
            await nc.jetstream().delete_stream(NAMES.slot_shard_stream(0))  # silent now
            statuses = []
            for _ in range(20):
                reply = await nc.request(NAMES.infer(MODEL), calibrated(1000), timeout=5,
                                         headers={Header.DEADLINE_MS: "2000"})
                statuses.append(((reply.headers or {}).get(Header.STATUS),
                                 (reply.headers or {}).get(Header.SLOT)))
        # Every call served on a slot of the other shards; the router tried the ghost's slot,
        # found no stream, and passed it over.
        assert {s for s, _ in statuses} == {"200"}, statuses
        assert {k for _, k in statuses} <= {"1", "2"}, statuses
        silences = stack.metrics.stream_silences.labels(NAMES.slot_shard_stream(0))
        assert silences._value.get() >= 1


async def test_a_silent_stream_with_the_others_busy_is_a_ticket_not_a_503(
        nats_server: EmbeddedNats, nc: Client) -> None:
    """The one free slot's stream is silent and the other slots are busy: the caller gets
    a 429 with a ticket on those (they free soon), not a 503 for the silent one."""
    await ensure_all(nc.jetstream(), ProvisionPlan(names=NAMES, slot_shards=2))
    async with plane(nats_server.url, models=(MODEL,), slots=2) as stack:
        router = stack.routers[0]
        async with ghost(nc, router):
            await nc.jetstream().delete_stream(NAMES.slot_shard_stream(0))  # slot 0's too
            view = router.models[MODEL].slots[f"{NODE}/0"]
            await wait_until(lambda: not view.healthy, 5, "the node's slot 0 unhealthy")
            busy = asyncio.ensure_future(nc.request(
                NAMES.infer(MODEL), calibrated(300_000), timeout=5,
                headers={Header.DEADLINE_MS: "2000"}))  # on slot 1, the only one left
            await wait_until(lambda: stack.nodes[0].slots[1].current is not None, 5,
                             "slot 1 busy")
            reply = await nc.request(NAMES.infer(MODEL), calibrated(1000), timeout=5,
                                     headers={Header.DEADLINE_MS: "2000"})
            h = reply.headers or {}
            assert h.get(Header.STATUS) == "429", reply.data
            assert h.get(Header.TICKET) and int(h[Header.RETRY_AFTER_MS]) > 0
            silences = stack.metrics.stream_silences.labels(NAMES.slot_shard_stream(0))
            assert silences._value.get() >= 1  # the ghost's slot was tried and passed over
            done = await busy
            assert (done.headers or {}).get(Header.STATUS) == "200"
