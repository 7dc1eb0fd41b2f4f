"""Tickets kept per caller (docs/design.md "Retry-After that is worth trusting"): callers who
never come back for their tickets stop pinning their own slot time, and only theirs; a
caller that comes back at its Retry-After with its ticket finds its slot, whoever else
calls the same model. On a real plane, with plain nats-py connections as the callers.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.client import Client as PlaneClient
from plane.contract.embedded import EmbeddedNats
from plane.contract.headers import across_import
from plane.contract.subjects import Header
from plane.router.caller import UNNAMED, caller_of
from tests.plane_fixtures import NAMES, calibrated, client, header, plane, status, wait_until

WORK_US = 40_000  # a slot cycle of ~40 ms: refusals are certain while one runs


async def ask(nc: Client, rid: str, ticket: str | None = None) -> Msg:
    headers = {Header.REQUEST_ID: rid, Header.DEADLINE_MS: "5000"}
    if ticket:
        headers[Header.TICKET] = ticket
    return await nc.request(NAMES.infer("calibrated"), calibrated(WORK_US), timeout=10,
                            headers=headers)


async def comes_back(nc: Client, rid: str) -> tuple[int, int]:
    """One request; on a 429 with a ticket, back at exactly its Retry-After-Ms with it.
    (first status, status on the first retry or 0 when none was needed)."""
    first = await ask(nc, rid)
    if status(first) != 429:
        return status(first), 0
    ticket = header(first, Header.TICKET)
    wait_ms = header(first, Header.RETRY_AFTER_MS)
    assert ticket and wait_ms is not None, first.headers
    await asyncio.sleep(int(wait_ms) / 1000)
    return 429, status(await ask(nc, rid, ticket))


async def test_callers_who_come_back_keep_their_tickets_beside_callers_who_never_do() -> None:
    async with plane(models=("calibrated",), slots=1) as stack, \
            client(stack.url) as gone, client(stack.url) as back:
        # One connection's callers (the gateway's, say) never come back: twelve refusals,
        # each lapsing unredeemed, pull its average of redeemed tickets under a half.
        for i in range(12):
            replies = await asyncio.gather(*(ask(gone, f"gone-{i}-{j}") for j in range(2)))
            assert sorted(status(m) for m in replies) == [200, 429]
            await asyncio.sleep(0.15)  # past the promise's lapse
        router = stack.routers[0].admission
        assert router.redemption["calibrated"] < 0.5
        # Another connection's callers come back at their time, with their tickets: each
        # first retry is served. (Averaged per model, their tickets pinned no slot time and
        # overlapped: 0-1 of 7 first retries were served; found from outside.)
        outcomes = await asyncio.gather(*(comes_back(back, f"back-{j}") for j in range(5)))
    first_retries = [retry for first, retry in outcomes if first == 429]
    assert len(first_retries) >= 3, outcomes
    assert first_retries == [200] * len(first_retries), outcomes


async def test_a_caller_whose_tickets_lapse_stops_pinning_slot_time() -> None:
    """The other side: a connection that never comes back is refused with an estimate that
    holds no slot (its tickets no longer in the router's book), so it cannot hold the slot
    idle for promises nobody redeems."""
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as gone:
        for i in range(12):
            await asyncio.gather(*(ask(gone, f"g-{i}-{j}") for j in range(2)))
            await asyncio.sleep(0.15)
        router = stack.routers[0].admission
        replies = await asyncio.gather(*(ask(gone, f"g-last-{j}") for j in range(2)))
        refused = [m for m in replies if status(m) == 429]
        assert refused and all(header(m, Header.TICKET) not in router.tickets for m in refused)
        assert any(not router.pins("calibrated", c) for (_, c) in router.by_caller)


async def test_tickets_honoured_counts_tickets_handed_out_not_newcomers_that_waited() -> None:
    """First-retry success on the board is honoured / issued. Newcomers that waited here for
    their start (`Plane-Wait-Ms`) were counted honoured with no ticket issued: 478 honoured
    of 0 issued in a run of waiting callers, and 5.7% "first-retry success" for callers
    (`hey`) that never retried at all (found from outside)."""
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        sample = stack.metrics.registry.get_sample_value
        labels = {"model": "calibrated"}

        async def waits(rid: str) -> Msg:
            return await nc.request(NAMES.infer("calibrated"), calibrated(WORK_US), timeout=10,
                                    headers={Header.REQUEST_ID: rid, Header.WAIT_MS: "2000",
                                             Header.DEADLINE_MS: "5000"})

        replies = await asyncio.gather(*(waits(f"w-{j}") for j in range(4)))
        assert [status(m) for m in replies] == [200] * 4
        assert (sample("plane_tickets_parked_total", labels) or 0) >= 1
        assert (sample("plane_tickets_honoured_total", labels) or 0) == 0
        assert (sample("plane_tickets_issued_total", labels) or 0) == 0
        # The router's answered time shows their wait for the slot, one after another (40,
        # 80, 120, 160 ms), which the slot's own time (40 ms each) does not. It comes with
        # the done-event, which the node sends with the answer but which reaches the router
        # on its own connection: the last may come just after our answer (a clean clone).
        await wait_until(lambda: sample("plane_router_answered_seconds_count", labels) == 4,
                         5, "the router's fourth answered time")
        answered = sample("plane_router_answered_seconds_sum", labels) or 0
        on_slot = sample("plane_slot_service_seconds_sum",
                         {**labels, "node": "node0-calibrated"}) or 0
        assert on_slot >= 0.9 * 0.16 and answered >= 0.9 * 0.4, (answered, on_slot)
        assert answered > 2 * on_slot, (answered, on_slot)
        # A ticket handed out and brought back is honoured.
        outcomes = await asyncio.gather(*(comes_back(nc, f"t-{j}") for j in range(2)))
        assert (429, 200) in outcomes, outcomes
        issued = sample("plane_tickets_issued_total", labels) or 0
        assert 1 <= (sample("plane_tickets_honoured_total", labels) or 0) <= issued


async def test_a_clients_streams_and_requests_are_one_caller_and_another_clients_are_not(
) -> None:
    """The router tells callers apart by their reply subject less its last token: a client's
    streams were each on an inbox of their own (`_INBOX.<nuid>`: no caller the router could
    name), so every stream caller shared one record, and a gateway's no-shows (its
    generations are streams) unpinned every NATS caller's stream tickets (found in review)."""
    async with EmbeddedNats() as srv, PlaneClient.connect(srv.url) as one, \
            PlaneClient.connect(srv.url) as two:
        first, second = one.stream_inbox(), one.stream_inbox()
        assert first != second
        assert caller_of(first, None) == caller_of(second, None) != UNNAMED
        assert caller_of(two.stream_inbox(), None) not in (caller_of(first, None), UNNAMED)
        assert caller_of(one.nc.new_inbox(), None) == UNNAMED  # one inbox a request: unnamed
        # Across a tenant's import the server names the connection.
        info = across_import({Header.NATS_REQUEST_INFO: '{"acc":"TENANT","server":"S1","id":7}'})
        assert caller_of("_R_.abc.def", info) == "TENANT:S1/7"
