"""What the server refused a connection, so that `plane status` says "not allowed" where it
would say "nothing answers".

NATS tells a client that it may not publish or subscribe somewhere with an `-ERR
'Permissions Violation for Publish to "<subject>"'`, which nats-py hands to the connection's
error callback (lowercased) and nothing else: the request itself just gets no answer. A
health check run under a role without a right it needs (compose's router-1 as `router`
asked on bare `$SRV.INFO`, which `$SRV.INFO.>` does not match) then said "no router
answers", and for the gateway role "no leader (a cluster electing one)?": a permissions
problem reported as an outage.
"""

from __future__ import annotations

import re

# nats-py lowercases the server's text; the subject is the rest of the quoted part.
_VIOLATION_RE = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"')


class Denials:
    """The violations the server reported on one connection (its `error_cb` is `on_error`);
    `user`: the connection's user, named in the problems."""

    def __init__(self, user: str | None) -> None:
        self.user = user
        self._denied: dict[str, str] = {}  # lowercased subject -> "publish" / "subscribe"
        self._told: set[str] = set()

    async def on_error(self, exc: Exception) -> None:
        if m := _VIOLATION_RE.search(str(exc).lower()):
            verb = "publish" if m.group(1) == "publish" else "subscribe"
            self._denied.setdefault(m.group(2), verb)

    def of(self, subject: str) -> str | None:
        """The problem to name when asking on `subject` got no answer because the server
        refused the publish; None when it did not."""
        if self._denied.get(subject.lower()) != "publish":
            return None
        self._told.add(subject.lower())
        return self._problem("publish", subject)

    def untold(self) -> list[str]:
        """Every refusal `of` has not named yet (a subscription on the inbox: no reply could
        come back to anything asked)."""
        return [self._problem(verb, s) for s, verb in self._denied.items()
                if s not in self._told]

    def _problem(self, verb: str, subject: str) -> str:
        who = f'user "{self.user}"' if self.user else "this connection's user"
        return (f"not allowed: {who} may not {verb} to {subject} (the server refused it: "
                "run this as a role that has that permission)")
