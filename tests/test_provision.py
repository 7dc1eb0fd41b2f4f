"""Provisioning again after a reconnect, or after a publish that found no slot stream: one run
at a time, however many requests ask for it (a cluster without a leader for seconds saw
hundreds of concurrent provisioners flood JetStream's API as it recovered)."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from plane.contract.provision import ProvisionPlan, Reprovisioner
from tests.plane_fixtures import NAMES

TRIES, WAIT_S = 3, 0.05


async def test_many_requests_for_provisioning_make_one_run_while_jetstream_is_silent(
        nc: Client) -> None:
    # A JetStream API prefix nobody serves: every call fails as while a cluster has no leader.
    silent = Reprovisioner(nc.jetstream(prefix="$JS.nobody.API", timeout=0.2),
                           ProvisionPlan(names=NAMES), tries=TRIES, wait_s=WAIT_S)
    results = await asyncio.gather(*(silent.again() for _ in range(50)))
    assert results == [None] * 50
    assert silent.attempts == TRIES  # one run of TRIES asks, not 50 runs
    await silent.again()  # a later request starts a new run
    assert silent.attempts == 2 * TRIES


async def test_provisioning_again_returns_the_advert_bucket_once_jetstream_answers(
        nc: Client) -> None:
    live = Reprovisioner(nc.jetstream(), ProvisionPlan(names=NAMES), tries=TRIES, wait_s=WAIT_S)
    first, second = await asyncio.gather(live.again(), live.again())
    assert first is not None and (await first.status()).bucket == NAMES.nodes_bucket
    assert second is None  # it asked while the first run was under way
    assert live.attempts == 1
    info = await nc.jetstream().stream_info(NAMES.slots_stream)
    assert info.config.name == NAMES.slots_stream
