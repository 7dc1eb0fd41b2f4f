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
body's bytes, and the caller's `Idempotency-Key` and `Plane-Request-Id` when they sent them),
and gives it to a request with that key that brings no ticket of its own:

- only when its holder comes back: at its `Retry-After-Ms` (the `openai` package) or at its
  `Retry-After`, whole seconds rounded up (curl), each up to `LATE_S` late. Not before (a
  client that honours either comes no sooner: an identical request sent meanwhile, another
  client with the same prompt, is a newcomer), and not between the two (given for the whole
  second after `Retry-After-Ms`, a ticket went to any identical newcomer of that second);
- never to a request that says it is a first try (`x-stainless-retry-count: 0`, the openai
  package's count of its retries; `Plane-Attempt: 1`), and at most once;
- identical requests refused together hold a ticket each, one to a retry: of those whose
  time it is, the one whose time ends first (a retry could be any of their holders; given so,
  each of the others is still there for its own).

What it cannot tell apart: clients of one bearer token sending identical bodies with nothing
per request (no `Idempotency-Key`, no `Plane-Attempt`), one a first try that comes while
another's ticket is due: it takes that ticket, and its holder comes back as a newcomer. Time
cannot tell them apart: such a newcomer is typically a client just answered, sending again
as its slot frees, which is when the holder is due (found from outside: 6 such callers on 2
slots, 54-61% of first retries served; the tickets newcomers took were 1.7 ms past their
time at the median, those their holders took 2.1 ms). Those clients send an
`Idempotency-Key` per request, or `Plane-Attempt` (then 100% were served). The book is
bounded (`GatewayConfig.max_held_tickets`: past it the oldest ticket is dropped) and pure:
the time comes in (monotonic seconds).
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

# How late a holder may come, at either of its times, and still be given its ticket: the
# router holds a promise for a late holder at most this long (`plane.router.admission`,
# LATE_TOLERANCE_MAX_S); one later finds it gone. (Given for a whole second after
# `Retry-After-Ms`, to cover `Retry-After`'s rounding up, a ticket went to any identical
# newcomer of that second.)
LATE_S = 0.200
# The openai package's count of its retries of one request (0 on its first try).
RETRY_COUNT_HTTP = "x-stainless-retry-count"
IDEMPOTENCY_HTTP = "Idempotency-Key"


@dataclass(slots=True)
class _Held:
    key: bytes
    ticket: str
    due_s: float  # when its holder comes back, at `Retry-After-Ms` (monotonic)
    whole_s: float  # ... or at `Retry-After`, whole seconds (not before `due_s`)
    gone: bool = False  # taken, or dropped

    @property
    def expires_s(self) -> float:
        return self.whole_s + LATE_S

    def ends_s(self, now_s: float) -> float | None:
        """When the time to give it that `now_s` falls in ends; None: not its time."""
        for at_s in (self.due_s, self.whole_s):
            if at_s <= now_s < at_s + LATE_S:
                return at_s + LATE_S
        return None


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

    def keep(self, key: bytes, ticket: str, due_s: float, whole_s: float, now_s: float) -> None:
        """Hold `ticket` for the retry of the request `key` names, due at `due_s`
        (`Retry-After-Ms`) or `whole_s` (`Retry-After`); the oldest tickets go now if no
        longer good, or past `max_held`."""
        held = _Held(key=key, ticket=ticket, due_s=due_s, whole_s=max(whole_s, due_s))
        self._by_key.setdefault(key, deque()).append(held)
        self._order.append(held)
        self._live += 1
        # Bounded by the tickets still held (given ones leave `_order` as they reach its
        # front, or with age: counted, they dropped live tickets early under a flood).
        while self._order and (self._live > self.max_held or self._order[0].gone
                               or self._order[0].expires_s <= now_s):
            self._drop(self._order.popleft())

    def take(self, key: bytes, now_s: float) -> str | None:
        """Of the tickets kept for `key` whose holders may be coming now, the one whose time
        ends first (the first kept of those), which is then no longer held; None when there
        is none."""
        line = self._by_key.get(key)
        while line and line[0].expires_s <= now_s:  # gone with age
            self._drop(line[0])
        best: _Held | None = None
        best_end_s = 0.0
        for h in line or ():
            end_s = None if h.gone else h.ends_s(now_s)
            if end_s is not None and (best is None or end_s < best_end_s):
                best, best_end_s = h, end_s
        if best is None:
            return None
        self._drop(best)
        return best.ticket

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
    after_s = response.headers.get(Header.RETRY_AFTER, "")
    due_s = now_s + int(after_ms) / 1000
    whole_s = now_s + int(after_s) if after_s.isdigit() else due_s
    request.app[TICKETS_KEY].keep(key, ticket, due_s, whole_s, now_s)
