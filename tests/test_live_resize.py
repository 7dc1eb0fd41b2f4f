"""Slots per node changed live under load (`slots.<node>` in PLANE_CONFIG): a slot a resize
removes leaves the adverts at once and serves on for a moment (`gpu_node.retiring`), so a
request a router placed on it before it heard of the removal is answered by the slot, not
by its router's 504 at the deadline (probe F, finding 1: one 504 on 3 of 5 shrinks)."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from plane.contract import replies
from plane.contract.ownership import slot_ttl
from plane.contract.subjects import Header, config_key
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated, client, plane, wait_until

MODEL = "calibrated"
NODE = "node0-calibrated"


async def test_a_request_placed_on_a_slot_just_removed_is_answered_by_it() -> None:
    """The router that placed it had not heard of the removal yet: here a request put on
    the removed slot's subject as a router writes it, just after the router heard. It used
    to wait there unfetched and unswept (no router tracks it: nobody answered it at all)."""
    async with plane(models=(MODEL,), slots=2) as stack, client(stack.url) as nc:
        node, router = stack.nodes[0], stack.routers[0]
        kv = await nc.jetstream().key_value(NAMES.config_bucket)
        await kv.put(config_key("slots", NODE), b"1")
        await wait_until(lambda: f"{NODE}/1" not in router.models[MODEL].slots, 5,
                         "the router to hear of the removal")
        assert len(node.slots) == 1
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        now = replies.now_ms()
        await nc.jetstream().publish(NAMES.slot(MODEL, NODE, 1), calibrated(1000), headers={
            Header.REPLY_TO: inbox, Header.REQUEST_ID: "late-placed",
            Header.DEADLINE_AT: str(now + 5000), Header.DEADLINE_MS: "5000",
            Header.WORK_US: "1000", Header.ROUTER: router.cfg.router_id, Header.ATTEMPT: "1",
            Header.NATS_TTL: slot_ttl(5000)})
        answer: Msg = await sub.next_msg(timeout=3)  # well before its 5 s deadline
        assert (answer.headers or {})[Header.STATUS] == "200", answer.headers
        assert (answer.headers or {})[Header.SLOT] == "1"
        # Then it withdraws, and is gone: routers were told once, and nothing else serves 1.
        await wait_until(lambda: len(node.retiring) == 0, 10, "the removed slot to close")
        assert f"{NODE}/1" not in router.models[MODEL].slots


async def test_a_slot_removed_and_added_back_at_once_is_the_same_slot_serving() -> None:
    """2 -> 1 -> 2 within the linger: slot 1 is taken back as it is (its consumer, its
    number), not made anew beside a removed one still fetching on the same consumer."""
    async with plane(models=(MODEL,), slots=2) as stack, client(stack.url) as nc:
        node = stack.nodes[0]
        slot1 = node.slots[1]
        kv = await nc.jetstream().key_value(NAMES.config_bucket)
        await kv.put(config_key("slots", NODE), b"1")
        await wait_until(lambda: len(node.slots) == 1, 5, "slot 1 removed")
        await kv.put(config_key("slots", NODE), b"2")
        await wait_until(lambda: len(node.slots) == 2, 5, "slot 1 back")
        assert node.slots[1] is slot1 and slot1.claimed and len(node.retiring) == 0
        await wait_until(lambda: stack.routers[0].models[MODEL].healthy_count() == 2, 5,
                         "both slots routed to")
        both = await asyncio.gather(*(nc.request(NAMES.infer(MODEL), calibrated(200_000),
                                                 timeout=5) for _ in range(2)))
        assert sorted((m.headers or {})[Header.SLOT] for m in both) == ["0", "1"]


async def test_slots_shrunk_and_grown_live_under_a_trickle_answer_every_request_once() -> None:
    """A steady trickle (40/s of 20 ms work, deadline 400 ms) while the slot count goes
    2 -> 1 -> 2 four times: every request answered exactly once, none 504 or 503."""
    async with plane(models=(MODEL,), slots=2) as stack, client(stack.url) as nc:
        kv = await nc.jetstream().key_value(NAMES.config_bucket)
        ledger = await Ledger(nc).start()

        async def trickle() -> None:
            while True:
                await ledger.send(NAMES.infer(MODEL), calibrated(20_000), 400)
                await asyncio.sleep(0.025)

        sending = asyncio.create_task(trickle())
        try:
            for _ in range(4):
                await asyncio.sleep(0.6)
                await kv.put(config_key("slots", NODE), b"1")
                await asyncio.sleep(0.6)
                await kv.put(config_key("slots", NODE), b"2")
            await asyncio.sleep(0.6)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        await ledger.settle(5.0)
        assert not ledger.unanswered(), ledger.unanswered()
        assert not ledger.answered_twice(), ledger.answered_twice()
        # Nothing the removed slot was given is left to its deadline (504) or handed back
        # (503: the caller retries elsewhere, but the slot could run it): served or a 429.
        other = {i: ledger.first(i).headers for i in ledger.answers
                 if ledger.status(i) not in (200, 429)}
        assert not other, other
        assert ledger.statuses()[200] > len(ledger.sent_s) // 2, ledger.statuses()
