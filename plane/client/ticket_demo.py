"""One refusal turned into an answer, for the demos (`plane up --demo`, `plane risk-demo`):
more `calibrated` requests at once than there are slots; the first 429 with a `Plane-Ticket`
is retried after its `Retry-After-Ms` with that ticket, as a caller that trusts the plane
would, and the story of it is told. The retry is the SDK's: refused again (its slot ran past
the holder's park window, as on a host busy starting up: CI once), it comes back with the
new ticket, and the story says how many times it came back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from plane.client.aio import Client
from plane.client.result import Result
from plane.contract.backoff import NO_RETRY
from plane.contract.messages import Reason, Status
from plane.contract.subjects import Header

# The ticket part: more `calibrated` requests at once than the node has slots.
TICKET_BURST = 6
TICKET_WORK_US = 100_000
TICKET_DEADLINE_MS = 1000


@dataclass(frozen=True, kw_only=True)
class TicketStory:
    burst: int
    placed: int  # of the burst, answered 200
    refused: int  # of the burst, 429 busy with a ticket
    ticket: str | None = None
    retry_after_ms: int | None = None
    redeemed_status: int | None = None  # the answer to the retry with the ticket
    redeemed_node: str | None = None
    redeemed_after_ms: float | None = None  # from the refusal to the retry's answer
    returns: int = 1  # times it came back (with the first ticket, then any renewed one)

    @property
    def ok(self) -> bool:
        return self.ticket is not None and self.redeemed_status == Status.OK

    def render(self) -> list[str]:
        head = (f"  ticket            {self.burst} calibrated requests of "
                f"{TICKET_WORK_US // 1000} ms at once: {self.placed} placed, "
                f"{self.refused} refused 429 busy")
        if self.ticket is None:
            return [head, "                    no refusal carried a ticket: nothing to redeem"]
        return [
            head,
            f"                    refused with Plane-Ticket {self.ticket}, "
            f"Retry-After-Ms {self.retry_after_ms}",
            f"                    came back after {self.retry_after_ms} ms with the ticket: "
            + (f"refused again {self.returns - 1} time(s) with a new ticket (its slot ran "
               "late), then " if self.returns > 1 else "")
            + f"{self.redeemed_status}"
            + (f" on {self.redeemed_node}" if self.redeemed_node else "")
            + f", answered {self.redeemed_after_ms:.0f} ms after the refusal "
            f"(its own work {TICKET_WORK_US // 1000} ms)",
        ]


def busy_ticket(r: Result) -> bool:
    return (r.status == Status.BUSY and r.reason == Reason.BUSY
            and bool(r.headers.get(Header.TICKET)) and r.retry_after_ms is not None)


async def redeem_one_ticket(client: Client) -> TicketStory:
    """The burst, and the first refusal's ticket redeemed as soon as it is due (while the
    rest of the burst is still running: a ticket is a promise for a time, not for later)."""
    body = msgspec.json.encode({"duration_us": TICKET_WORK_US})
    ticket: str | None = None
    retry_after_ms: int | None = None
    again: Result | None = None
    after_ms: float | None = None
    async with asyncio.TaskGroup() as tg:
        calls = [tg.create_task(client.call("calibrated", body, deadline_ms=TICKET_DEADLINE_MS,
                                            policy=NO_RETRY)) for _ in range(TICKET_BURST)]
        for done in asyncio.as_completed(calls):
            r = await done
            if ticket is None and busy_ticket(r):
                refused_at = time.monotonic()
                ticket, retry_after_ms = r.headers[Header.TICKET], r.retry_after_ms or 0
                await asyncio.sleep(retry_after_ms / 1000)
                again = await client.call("calibrated", body, deadline_ms=TICKET_DEADLINE_MS,
                                          ticket=ticket, first_attempt=2)
                after_ms = (time.monotonic() - refused_at) * 1000
    burst = [c.result() for c in calls]
    return TicketStory(
        burst=TICKET_BURST, placed=sum(r.status == Status.OK for r in burst),
        refused=sum(busy_ticket(r) for r in burst), ticket=ticket,
        retry_after_ms=retry_after_ms,
        redeemed_status=again.status if again is not None else None,
        redeemed_node=again.node if again is not None else None,
        redeemed_after_ms=after_ms, returns=again.attempts if again is not None else 1)
