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
    `user`: the connection's user, named in the problems.

    `plane status` asks on a subject per router, node and slot stream: a user without the
    rights (a tenant, the gateway's role) is refused every one of them, and each refusal
    named apart read as eight near-identical sentences for one fact. They are named in one
    (`problems`), and a request refused is not reported as silence too (`refused`)."""

    def __init__(self, user: str | None) -> None:
        self.user = user
        self._denied: dict[str, tuple[str, str]] = {}  # lowercased -> (verb, as asked)

    async def on_error(self, exc: Exception) -> None:
        if m := _VIOLATION_RE.search(str(exc).lower()):
            verb = "publish" if m.group(1) == "publish" else "subscribe"
            self._denied.setdefault(m.group(2), (verb, m.group(2)))

    def refused(self, subject: str) -> bool:
        """The server refused to let us publish on `subject` (asking there got no answer
        for that reason, which `problems` names)."""
        denied = self._denied.get(subject.lower())
        if denied is None or denied[0] != "publish":
            return False
        self._denied[subject.lower()] = (denied[0], subject)  # named as it was asked
        return True

    def problems(self) -> list[str]:
        """What the server refused, in one sentence (none when it refused nothing)."""
        if not self._denied:
            return []
        who = f'user "{self.user}"' if self.user else "this connection's user"
        (verb, first), *more = self._denied.values()
        if not more:
            return [f"not allowed: {who} may not {verb} to {first} (the server refused it: "
                    "run this as a role that has that permission)"]
        return [f"not allowed: {who} may not {verb} to {first} (nor to {len(more)} more "
                f"subject{'s' if len(more) > 1 else ''} this asks on, such as {more[0][1]}): "
                "the server refused them; a tenant, or a role without those rights, cannot "
                "run this: run it as admin (--user admin, or PLANE_AUTH=DIR:admin)"]
