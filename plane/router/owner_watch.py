"""While a forwarder waits for the owner's word on a forward (`RequestPath._forward`): is the
owner still there?

A forward reaches the router that made a promise (or makes them) and that router says
"taken" as it reads it (forwards are read first: `plane.router.inbox`). One that dies with the
forward in hand (SIGKILL, a crash) never says anything, and the forwarder used to wait out its
whole wait (the request's deadline, the grace and a second) before it answered 504: a second
past the deadline, when the SDK had long answered its own 504. So, once the word is overdue
(`PROBE_AFTER_S`), the forwarder asks the server whether the owner is still connected: a
request on the owner's `answered` subject (the cheapest thing a router answers, a set
lookup), again every `PROBE_EVERY_S`. No responders there means the owner's connection, and
its subscriptions with it, are gone from the server: its word can no longer come, and the
forwarder decides the request itself at once (as for a forward that found no responder).

Why that is sure, not a guess:
- The server handles a connection's bytes in order, and removes its subscriptions only when
  it closes it: a "taken" the owner wrote before it died reached us before the server could
  say "no responders" to a probe sent after it (in a cluster too: the message and the removal
  of interest travel the same route, in that order). So the word is looked for first.
- An owner that is alive but lost its connection (a server restart, a network cut) would send
  what it wrote while disconnected once it reconnects (nats-py keeps a reconnect buffer). It
  does not take over a forward it read on a connection before the one now up, nor one it
  reads while disconnected (`RequestPath._taken_over`, `plane.contract.natsconn.connected_since_s`):
  a forward the server delivered to a connection now gone is never answered by its owner.

A probe the owner answers, or does not answer within `PROBE_WAIT_S` (a stalled loop), leaves
the forward to wait on, to the end of its wait as before.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from plane.contract.reply_inbox import NO_RESPONDERS, ReplyInbox
from plane.contract.subjects import Header, Names

# A live owner says "taken" as it reads the forward: its word is overdue after this long.
PROBE_AFTER_S = 0.05
PROBE_EVERY_S = 0.25  # then asked again this often, while the forward waits
PROBE_WAIT_S = 0.25  # a probe nobody answers in this long: the owner is there, stalled


def _found_nobody(probe: asyncio.Future[Msg]) -> bool:
    """Whether a probe came back as the server's no-responders status."""
    if probe.cancelled() or probe.exception() is not None:
        return False  # the connection closed under us: it says nothing of the owner
    return (probe.result().headers or {}).get(Header.NATS_STATUS) == NO_RESPONDERS


class OwnerWatch:
    """The probes of a router's forwards, through its forwards' reply inbox."""

    def __init__(self, inbox: ReplyInbox, names: Names) -> None:
        self._inbox = inbox
        self._names = names

    async def word(self, sent: asyncio.Future[Msg], owner: str, wait_s: float) -> Msg | None:
        """The first answer to a forward to router `owner` (`sent`: its future), within
        `wait_s`; None when the owner left without one (its connection gone: see the module).
        Raises `NatsTimeout` when the wait ends first, and what `sent` raises. `sent` is
        cancelled when we stop waiting for it."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        probe_at = loop.time() + PROBE_AFTER_S
        try:
            while True:
                now = loop.time()
                if now >= give_up:
                    raise NatsTimeout
                await asyncio.wait({sent}, timeout=min(give_up, probe_at) - now)
                if sent.done():
                    return sent.result()
                if loop.time() < probe_at:
                    continue
                if await self._left(sent, owner, give_up) and not sent.done():
                    return None
                if sent.done():  # (its word came first: the server kept the order)
                    return sent.result()
                probe_at = loop.time() + PROBE_EVERY_S
        finally:
            if not sent.done():
                sent.cancel()

    async def _left(self, sent: asyncio.Future[Msg], owner: str, give_up: float) -> bool:
        """Ask once whether `owner` is still connected, while still waiting on `sent`."""
        probe = await self._inbox.send(self._names.router_answered(owner), b"", {})
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait({sent, probe}, return_when=asyncio.FIRST_COMPLETED,
                               timeout=max(0.0, min(give_up - loop.time(), PROBE_WAIT_S)))
            return probe.done() and _found_nobody(probe)
        finally:
            if not probe.done():
                probe.cancel()
