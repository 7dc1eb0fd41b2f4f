"""Who a request came from, as far as the router can tell: whose record of coming back for
its tickets decides whether its next ticket pins slot time (`Admission.pins`).

A NATS client makes its requests with one reply prefix per connection (nats-py, nats.js and
nats.go all subscribe once to `_INBOX.<nuid>.*` and reply on `_INBOX.<nuid>.<token>`), so the
reply subject without its last token names the connection; the SDK's streams have their
inboxes under one prefix of their client's too (`Client.stream_inbox`). A request that came across a
tenant's service import has a reply subject the server made for it; the server names its
connection in `Nats-Request-Info` (`<server id>/<client id>`) instead. A client that makes a
reply subject of its own per request (an old-style request: `_INBOX.<nuid>`, two tokens)
cannot be told apart from another: "", the callers nobody can name, who share one record.
"""

from __future__ import annotations

from plane.contract.headers import RequestInfo

UNNAMED = ""
# A caller's record for the tickets it was given on a retry (`again_record`).
AGAIN = " again"


def caller_of(reply: str, info: RequestInfo | None) -> str:
    """The caller `reply` (a request's reply subject) names, or the server's `info` on a
    request that came across an import (`plane.contract.headers.across_import`)."""
    if info is not None:
        return f"{info.acc}:{info.client}" if info.client else UNNAMED
    prefix, _, _ = reply.rpartition(".")
    return prefix if "." in prefix else UNNAMED


def again_record(caller: str) -> str:
    """Where `caller`'s tickets given on a retry (a request that came with a ticket, or a
    `Plane-Attempt` past 1) are judged: apart from those given on its first attempts. A
    caller that retries a refusal once (a common policy) comes back for every first ticket
    and for no second one; judged together, the second ones unpinned its first ones, their
    holders, back on time, were refused again, and each left one more no-show (two tenants at
    2x, share refusals starting it: 31-71% of first retries served; one tenant: 100%).
    Apart, each kind pins as its own record says, and a caller that claims every request is
    a retry only judges itself there."""
    return caller + AGAIN
