"""Provisioning again after a reconnect, or after a publish that found no slot stream: one run
at a time, however many requests ask for it (a cluster without a leader for seconds saw
hundreds of concurrent provisioners flood JetStream's API as it recovered). And at a
process's start: asked again while JetStream cannot answer yet (a cluster electing a
leader), with an error that says what to check when it never does."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError

from plane.contract.errors import ConfigError, Unavailable
from plane.contract.provision import ProvisionPlan, Reprovisioner, ensure_all_at_start
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


RELAY = "$JS.relay.API"


async def _relay(nc: Client, answer: list[bytes | None]) -> list[Msg]:
    """JetStream's API behind a relay: each request takes the next of `answer` (None: left
    unanswered, as while its stream elects a leader; bytes: answered so), and goes on to the
    real API once `answer` is spent."""
    asked: list[Msg] = []

    async def relay(msg: Msg) -> None:
        asked.append(msg)
        if answer:
            if (reply := answer.pop(0)) is not None:
                await nc.publish(msg.reply, reply)
            return
        await nc.publish(msg.subject.replace(RELAY, "$JS.API", 1), msg.data, reply=msg.reply)

    await nc.subscribe(f"{RELAY}.>", cb=relay)
    return asked


async def test_a_start_waits_for_jetstream_to_answer(nc: Client) -> None:
    """A node or router started while a stream of the plane has no leader (4-9 s after a
    cluster's server died) stopped at once on a bare TimeoutError; it asks again now."""
    asked = await _relay(nc, [None, None, None])
    nodes, _ = await ensure_all_at_start(nc.jetstream(prefix=RELAY, timeout=0.2),
                                         ProvisionPlan(names=NAMES), who="node", within_s=10)
    assert (await nodes.status()).bucket == NAMES.nodes_bucket
    assert len(asked) > 3  # the three unanswered, then the real API
    info = await nc.jetstream().stream_info(NAMES.slots_stream)
    assert info.config.name == NAMES.slots_stream


async def test_a_start_jetstream_never_answers_says_what_to_check(nc: Client) -> None:
    js = nc.jetstream(prefix="$JS.nobody.API", timeout=0.2)  # nobody serves it
    with pytest.raises(Unavailable, match="JetStream did not answer the router") as err:
        await ensure_all_at_start(js, ProvisionPlan(names=NAMES), who="router", within_s=0.6)
    assert "JetStream is enabled" in str(err.value) and "$JS.API" in str(err.value)


async def test_a_start_refused_by_jetstream_stops_at_once(nc: Client) -> None:
    """An answer that says the request is wrong is not an election: no asking again."""
    refusal = json.dumps({"type": "io.nats.jetstream.api.v1.stream_info_response", "error": {
        "code": 400, "err_code": 10058, "description": "stream name already in use"}}).encode()
    asked = await _relay(nc, [refusal] * 10)
    t0 = time.monotonic()
    with pytest.raises(APIError) as err:
        await ensure_all_at_start(nc.jetstream(prefix=RELAY, timeout=0.2),
                                  ProvisionPlan(names=NAMES), who="node", within_s=10)
    assert err.value.err_code == 10058 and time.monotonic() - t0 < 1.0, err.value
    assert len(asked) <= 3  # what provisioning asks before it gives up, once


async def test_replicas_a_lone_server_cannot_keep_say_what_to_change(nc: Client) -> None:
    with pytest.raises(ConfigError, match=r"without a cluster.*give --replicas 1"):
        await ensure_all_at_start(nc.jetstream(), ProvisionPlan(names=NAMES, replicas=3),
                                  who="node", within_s=2)
