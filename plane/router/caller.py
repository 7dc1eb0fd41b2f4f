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

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from plane.contract.headers import RequestInfo

UNNAMED = ""
# A caller whose tickets are redeemed less than this share of the time (`Redemptions`) has
# the next ones booked for nobody: what its tickets stand for (a slot's time, a tenant's
# token) goes to callers that come back.
MIN_REDEMPTION = 0.5
REDEMPTION_WEIGHT = 0.1  # each ticket settled moves the average this share of the way
K = TypeVar("K", bound=Hashable)
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


class Redemptions(Generic[K]):
    """Per caller (`K`: whose tickets an average counts), the share of its tickets whose
    holders came back: an exponential average (REDEMPTION_WEIGHT a ticket), the least
    recently counted forgotten past `size`. One record for every kind of ticket the router
    gives: the slots' promises (`plane.router.admission`) and a tenant's rate tokens
    (`plane.router.rate_limit`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by: dict[K, float] = {}

    def __len__(self) -> int:
        return len(self._by)

    def __contains__(self, key: object) -> bool:
        return key in self._by

    def __iter__(self) -> Iterator[K]:
        return iter(self._by)

    def __setitem__(self, key: K, average: float) -> None:
        """`key`'s average set as it is (a record carried over, a test's starting point)."""
        self._by[key] = average

    def get(self, key: K) -> float | None:
        """`key`'s average, None before its first ticket settled."""
        return self._by.get(key)

    def settle(self, key: K, *, redeemed: bool, prior: float = 1.0) -> tuple[float, float]:
        """One of `key`'s tickets settled (`prior`: where a caller with no record starts);
        its average before and after."""
        before = self._by.pop(key, prior)  # re-inserted: the most recently counted last
        self._by[key] = after = before + REDEMPTION_WEIGHT * (float(redeemed) - before)
        if len(self._by) > self.size:
            del self._by[next(iter(self._by))]
        return before, after

    def pins(self, key: K, prior: float = 1.0) -> bool:
        """Whether `key`'s next ticket books what it stands for: while it comes back."""
        known = self._by.get(key)
        return (known if known is not None else prior) >= MIN_REDEMPTION
