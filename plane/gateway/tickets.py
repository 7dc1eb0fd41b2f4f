"""Tickets the gateway carries for HTTP clients that cannot: the ticket of each 429 it
answers, held for the retry, and attached to that retry when it comes without one.

The plane's promise is that a caller who comes back at its Retry-After is served (a ticket
books its start: docs/design.md, "Retry-After that is worth trusting"). The `openai` package
honours `Retry-After-Ms` and retries, curl `--retry` honours `Retry-After`, but neither knows
`Plane-Ticket`: each came back as a newcomer, and while promises were pinned its own promise
refused it (found from outside: 5 of 12 such retries served, 8 of 8 with the ticket; the
`openai` package with `max_retries=1`, 2 of 10 raised `RateLimitError` after its retry).

So the gateway remembers each ticket it hands out, keyed by what a retry repeats exactly
(`retry_key`: the bearer token, which names the tenant, the route with `/v1/infer`'s model, the
body's bytes, and the caller's `Idempotency-Key` and `Plane-Request-Id` when it sent them),
and gives it to a request with that key that brings no ticket of its own:

- only once the ticket's `Retry-After-Ms` has passed: a client that honours it comes no
  sooner, so an identical request sent meanwhile (another client with the same prompt) is
  a newcomer, not the holder;
- never to a request that says it is a first try (`x-stainless-retry-count: 0`, the openai
  package's count of its retries; `Plane-Attempt: 1`);
- for as long as the ticket can still count (`GOOD_FOR_S` past its time), and at most once;
- identical requests refused together (two clients, one prompt) hold a ticket each, and
  their retries take them in the order they were refused (told successive times), one each.

What it cannot tell apart: two clients of one bearer token sending identical bodies, the
second as a first try that says nothing of it (curl) and comes after the first's
Retry-After: the second takes the first's ticket, and the first comes back as a newcomer, as
every such client did before. The book is bounded (`GatewayConfig.max_held_tickets`: past
it the oldest ticket is dropped) and pure: the time comes in (monotonic seconds).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import structlog
from aiohttp import web

from plane.client.aio import CallOptions
from plane.contract.headers import CallerHeaders
from plane.contract.subjects import Header

log = structlog.get_logger("plane.gateway")

# How long past its Retry-After a held ticket is still given: the router holds a promise for
# a late holder at most 200 ms and counts one back within 0.5 s after that as redeemed (not a
# no-show), and a client that reads `Retry-After` (whole seconds, rounded up) rather than
# `Retry-After-Ms` comes up to a second after the latter.
GOOD_FOR_S = 1.0
# The openai package's count of its retries of one request (0 on its first try).
RETRY_COUNT_HTTP = "x-stainless-retry-count"
IDEMPOTENCY_HTTP = "Idempotency-Key"


@dataclass(slots=True)
class _Held:
    key: bytes
    ticket: str
    due_s: float  # when its holder may come back (monotonic)
    gone: bool = False  # taken, or dropped


class HeldTickets:
    """The tickets of 429s answered, by retry key, until taken or no longer good. Each
    request costs a look at the tickets of its own key only, the earliest kept first (a
    flood of identical bodies refused holds many under one key: each is due after the one
    kept before it, so the first that is due comes first)."""

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self._by_key: dict[bytes, deque[_Held]] = {}
        self._order: deque[_Held] = deque()  # as kept: the oldest dropped first
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def keep(self, key: bytes, ticket: str, due_s: float, now_s: float) -> None:
        """Hold `ticket` for the retry of the request `key` names, due at `due_s`; the
        oldest tickets go now if no longer good, or past `max_held`."""
        held = _Held(key=key, ticket=ticket, due_s=due_s)
        self._by_key.setdefault(key, deque()).append(held)
        self._order.append(held)
        self._live += 1
        # Bounded by the tickets still held (given ones leave `_order` as they reach its
        # front, or with age: counted, they dropped live tickets early under a flood).
        while self._order and (self._live > self.max_held or self._order[0].gone
                               or self._order[0].due_s + GOOD_FOR_S <= now_s):
            self._drop(self._order.popleft())

    def take(self, key: bytes, now_s: float) -> str | None:
        """The first ticket kept for `key` whose time has come and that is still good, which
        is then no longer held; None when there is none."""
        line = self._by_key.get(key)
        while line and line[0].due_s + GOOD_FOR_S <= now_s:  # gone with age
            self._drop(line[0])
        for h in line or ():
            if not h.gone and h.due_s <= now_s < h.due_s + GOOD_FOR_S:
                self._drop(h)  # the line changes: no next step of this loop
                return h.ticket
        return None

    def forget(self, key: bytes, ticket: str) -> None:
        """A request brought `ticket` itself: it is not to be given again."""
        for h in self._by_key.get(key, ()):
            if h.ticket == ticket and not h.gone:
                self._drop(h)  # the line changes: no next step of this loop
                return

    def _drop(self, h: _Held) -> None:
        """No longer held (given, or gone with age). An entry leaves its key's line once
        all kept before it have (in `_order` it leaves from the front)."""
        if not h.gone:
            h.gone = True
            self._live -= 1
        line = self._by_key.get(h.key)
        while line and line[0].gone:
            line.popleft()
        if line is not None and not line:
            del self._by_key[h.key]


TICKETS_KEY = web.AppKey("held_tickets", HeldTickets)
RETRY_KEY = web.RequestKey("retry_key", bytes)  # a request's, once its body is read


def retry_key(headers: Mapping[str, str], path: str, caller: CallerHeaders,
              body: bytes) -> bytes:
    """What a retry of a request (its HTTP headers, path, checked Plane headers and body)
    repeats exactly, as a digest (each part length-prefixed: no two different requests run
    together into one)."""
    h = headers
    digest = hashlib.blake2b(digest_size=20)
    for part in (h.get("Authorization", ""), path,
                 h.get(IDEMPOTENCY_HTTP, ""), caller.request_id or ""):
        data = part.encode()
        digest.update(len(data).to_bytes(8, "big") + data)
    digest.update(body)
    return digest.digest()


def says_first_try(headers: Mapping[str, str], caller: CallerHeaders) -> bool:
    """The request says it is no retry: the openai package counts its retries, and a caller
    that sends `Plane-Attempt` numbers its tries."""
    return headers.get(RETRY_COUNT_HTTP, "").strip() == "0" or caller.attempt == 1


def attach_ticket(request: web.Request, caller: CallerHeaders, body: bytes,
                  args: CallOptions, now_s: float) -> None:
    """Give the request the ticket held for it, unless it brought its own (then that one is
    held no more) or says it is a first try; note its key for `keep_ticket`."""
    book = request.app[TICKETS_KEY]
    key = retry_key(request.headers, request.path, caller, body)
    request[RETRY_KEY] = key
    if caller.ticket is not None:
        book.forget(key, caller.ticket)
    elif not says_first_try(request.headers, caller) and (ticket := book.take(key, now_s)):
        args["ticket"] = ticket
        log.debug("held ticket given to a retry", ticket=ticket, path=request.path)


def keep_ticket(request: web.Request, response: web.StreamResponse, now_s: float) -> None:
    """Hold the ticket of a 429 answered to a request whose key `attach_ticket` noted."""
    key = request.get(RETRY_KEY)
    ticket = response.headers.get(Header.TICKET)
    after_ms = response.headers.get(Header.RETRY_AFTER_MS, "")
    if key is None or response.status != 429 or not ticket or not after_ms.isdigit():
        return
    request.app[TICKETS_KEY].keep(key, ticket, now_s + int(after_ms) / 1000, now_s)
