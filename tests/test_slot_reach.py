"""A slot whose consumer does not take its pulls (`gpu_node.pull.StandingPull.reaches`), on a
real server: the node advertises it unhealthy at once, so routers place on its other slots,
and claims it again when the broker says the consumer is gone. (In a cluster the same holds
while a dead server's consumer leader is elected again: the consumer exists, the node waits.)"""

from __future__ import annotations

import asyncio

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.embedded import EmbeddedNats
from plane.contract.provision import ProvisionPlan, ensure_all
from plane.contract.subjects import Header
from tests.plane_fixtures import NAMES, calibrated, plane, wait_until

MODEL, NODE = "calibrated", "node0-calibrated"


async def test_a_slot_whose_consumer_is_deleted_is_unhealthy_until_claimed_again(
        nats_server: EmbeddedNats, nc: Client) -> None:
    async with plane(nats_server.url, models=(MODEL,), slots=2) as stack:
        slot = stack.nodes[0].slots[0]
        view = stack.routers[0].models[MODEL].slots[f"{NODE}/0"]
        first = slot.consumer
        await nc.jetstream().delete_consumer(slot.stream, slot.consumer)  # behind its back
        await wait_until(lambda: not view.healthy, 5, "the router to hear slot 0 unhealthy")
        assert not slot.reaches
        # Meanwhile every call goes to slot 1, none is left on slot 0 to time out.
        for _ in range(5):
            reply = await nc.request(NAMES.infer(MODEL), calibrated(1000), timeout=5,
                                     headers={Header.DEADLINE_MS: "2000"})
            assert (reply.headers or {}).get(Header.STATUS) == "200"
            assert (reply.headers or {}).get(Header.SLOT) == "1"
        # The node finds the consumer gone and claims the slot again: it serves.
        await wait_until(lambda: slot.reaches and view.healthy, 10, "slot 0 claimed again")
        info = await nc.jetstream().consumer_info(slot.stream, first)
        assert info.config.durable_name == first
        replies = await asyncio.gather(*(
            nc.request(NAMES.infer(MODEL), calibrated(20_000), timeout=5,
                       headers={Header.DEADLINE_MS: "2000"}) for _ in range(2)))
        assert sorted((r.headers or {}).get(Header.SLOT) for r in replies) == ["0", "1"]


async def test_a_slot_whose_stream_is_gone_is_claimed_again_once_it_is_back(
        nats_server: EmbeddedNats, nc: Client) -> None:
    """The consumer and its stream both gone (a shard deleted by an operator, or lost): the
    claim fails while no stream holds the subject, and is tried again until one does."""
    plan = ProvisionPlan(names=NAMES, slot_shards=2)
    await ensure_all(nc.jetstream(), plan)
    async with plane(nats_server.url, models=(MODEL,), slots=2) as stack:
        slot = stack.nodes[0].slots[0]
        assert slot.stream == NAMES.slot_shard_stream(0)
        await nc.jetstream().delete_stream(slot.stream)
        await wait_until(lambda: not slot.claimed, 5, "slot 0 withdrawn, its consumer gone")
        await asyncio.sleep(1.5)  # claims fail meanwhile: no stream holds the subject
        assert not slot.claimed and slot.withdrawn_for == "consumer-lost"
        await ensure_all(nc.jetstream(), plan)  # the shard is back
        view = stack.routers[0].models[MODEL].slots[f"{NODE}/0"]
        await wait_until(lambda: slot.claimed and view.healthy, 10, "slot 0 claimed again")
        replies = await asyncio.gather(*(
            nc.request(NAMES.infer(MODEL), calibrated(20_000), timeout=5,
                       headers={Header.DEADLINE_MS: "2000"}) for _ in range(2)))
        assert sorted((r.headers or {}).get(Header.SLOT) for r in replies) == ["0", "1"]


async def test_a_slots_health_gauge_is_0_while_the_connection_is_down(
        nats_server: EmbeddedNats) -> None:
    """No server, no pulls taken: `plane_slot_healthy` says so (it stayed 1 for as long as the
    server was gone), and 1 again once the slot is served after the reconnect (the restarted
    server lost the memory-stored slot stream: the node claims its slots again)."""
    async with plane(nats_server.url, models=(MODEL,), slots=2) as stack:
        def gauges() -> list[float | None]:
            return [stack.metrics.registry.get_sample_value(
                "plane_slot_healthy", {"model": MODEL, "node": NODE, "slot": str(k)})
                for k in (0, 1)]

        assert gauges() == [1.0, 1.0]
        await nats_server.stop(kill=True)
        await wait_until(lambda: gauges() == [0.0, 0.0], 10, "both slots' gauges at 0")
        assert all(s.claimed and not s.reaches for s in stack.nodes[0].slots)
        await nats_server.start()
        await wait_until(lambda: gauges() == [1.0, 1.0], 20, "both slots' gauges back at 1")
        view = stack.routers[0].models[MODEL]
        await wait_until(lambda: view.healthy_count() == 2, 10, "the router to see both")
        reply = await asyncio.wait_for(_call(stack.url), 10)
        assert (reply.headers or {}).get(Header.STATUS) == "200"


async def _call(url: str) -> Msg:
    nc = await nats.connect(url)
    try:
        return await nc.request(NAMES.infer(MODEL), calibrated(1000), timeout=5,
                                headers={Header.DEADLINE_MS: "2000"})
    finally:
        await nc.close()
