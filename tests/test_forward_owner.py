"""A forward whose owner (the router that made the promise, or makes them) goes away with it in
hand: the forwarder learns it from the server (`plane.router.owner_watch`) and decides the
request itself, instead of waiting out its whole wait to answer 504; an owner still there but
slow is waited for, and the caller gets one answer either way. An owner never takes over a
forward its connection read before the one now up (`RequestPath._taken_over`)."""

from __future__ import annotations

import time

import nats
from nats.aio.msg import Msg

from plane.contract.messages import Presence, msgpack_encoder
from plane.contract.natsconn import connected_since_s
from plane.contract.subjects import Header
from plane.router.receipt import mark_received
from tests.plane_fixtures import (
    NAMES,
    calibrated,
    client,
    listen,
    plane,
    status,
    wait_until,
)

TICKET = "aaa-0123456789abcdef"  # a promise of router `aaa`, the stand-in owner below


async def test_a_forward_whose_owner_dies_with_it_in_hand_is_decided_by_its_forwarder(
) -> None:
    """Router `aaa` (a connection of its own, as a router's) gets the ticket holder's forward
    and goes away without a word (its connection closed, as a SIGKILL closes it). The
    forwarder used to wait until the deadline, its grace and a second had passed and answer
    504 `deadline` (3.05 s for this 2 s deadline); now it finds `aaa` gone and serves the
    holder itself, and takes `aaa` for gone."""
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        router = stack.routers[0]
        owner = await nats.connect(stack.url)
        got: list[Msg] = []

        async def hold(m: Msg) -> None:  # never answers: dies with it
            got.append(m)

        async def answered(m: Msg) -> None:  # alive until then: it answers the probe
            await owner.publish(m.reply, b"0")

        await owner.subscribe(NAMES.router_infer_all("aaa"), cb=hold)
        await owner.subscribe(NAMES.router_answered("aaa"), cb=answered)
        await owner.publish(NAMES.admission("_routers"), msgpack_encoder.encode(
            Presence(router="aaa", instance="x")))
        await owner.flush()
        await wait_until(lambda: router.peers.promiser("calibrated") == "aaa", 5, "aaa heard")
        caller = nc.new_inbox()
        to_caller = await listen(nc, caller)
        await nc.publish(NAMES.infer("calibrated"), calibrated(1000), reply=caller,
                         headers={Header.TICKET: TICKET, Header.DEADLINE_MS: "2000"})
        await wait_until(lambda: got, 5, "the forward at aaa")
        await owner.close()
        await wait_until(lambda: to_caller, 5, "the answer")
        assert [status(m) for m in to_caller] == [200], to_caller[0].headers
        assert stack.metrics.registry.get_sample_value("plane_router_forwarded_total", {
            "model": "calibrated", "why": "ticket", "outcome": "owner-gone"}) == 1
        assert router.peers.promiser("calibrated") == router.cfg.router_id


async def test_an_owner_slow_to_take_a_forward_over_is_waited_for() -> None:
    """An owner that answers the forwarder's probes but says "taken" only after several of
    them is still there: the forwarder leaves the caller to it, who hears one answer, the
    owner's."""
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        owner = await nats.connect(stack.url)
        probes: list[Msg] = []
        forwards: list[Msg] = []

        async def hold(m: Msg) -> None:
            forwards.append(m)

        async def answered(m: Msg) -> None:
            probes.append(m)
            await owner.publish(m.reply, b"0")

        await owner.subscribe(NAMES.router_infer_all("aaa"), cb=hold)
        await owner.subscribe(NAMES.router_answered("aaa"), cb=answered)
        await owner.flush()
        caller = nc.new_inbox()
        to_caller = await listen(nc, caller)
        await nc.publish(NAMES.infer("calibrated"), calibrated(1000), reply=caller,
                         headers={Header.TICKET: TICKET, Header.DEADLINE_MS: "2000"})
        await wait_until(lambda: len(probes) >= 2, 5, "the forwarder asking after aaa")
        [fwd] = forwards
        await owner.publish(fwd.reply, b"", headers={Header.FORWARDED_BY: "taken"})
        reply_to = (fwd.headers or {})[Header.REPLY_TO]
        await owner.publish(reply_to, b'{"owner": true}', headers={Header.STATUS: "200"})
        await owner.flush()
        taken = {"model": "calibrated", "why": "ticket", "outcome": "taken"}
        await wait_until(lambda: stack.metrics.registry.get_sample_value(
            "plane_router_forwarded_total", taken) == 1, 5, "the forward taken over")
        await nc.flush()
        assert [m.data for m in to_caller] == [b'{"owner": true}']
        await owner.close()


async def test_an_owner_does_not_take_over_a_forward_read_before_its_connection_was() -> None:
    """A forward its connection read before the connection now up (a reconnect between):
    its forwarder may have heard from the server that we were gone, and decided it. Dropped,
    not taken over; one read on the connection now up is taken over."""
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        router = stack.routers[0]
        since = connected_since_s(router.nc)
        assert since <= time.monotonic()

        async def forward(read_at_s: float) -> tuple[list[Msg], list[Msg]]:
            forwarder, caller = nc.new_inbox(), nc.new_inbox()
            got = (await listen(nc, forwarder), await listen(nc, caller))
            msg = Msg(router.nc, subject=NAMES.router_infer(router.cfg.router_id, "calibrated"),
                      reply=forwarder, data=calibrated(1000), headers={
                          Header.FORWARDED_BY: "r9", Header.DEADLINE_MS: "2000",
                          Header.REPLY_TO: caller,
                          Header.FORWARD_UNTIL: str(int((time.time() + 5) * 1000))})
            mark_received(msg, read_at_s)
            await router.requests.on_request(msg)
            await router.nc.flush()
            await nc.flush()
            return got

        stale = await forward(since - 1.0)
        fresh = await forward(time.monotonic())
        await wait_until(lambda: fresh[1], 5, "the fresh forward's answer")
        assert [m.data for m in fresh[0]] == [b""]  # "taken"
        assert stale == ([], [])
