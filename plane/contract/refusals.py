"""What a NATS server's refusal of a connection means and what to do about it, read in one
place from the server's `-ERR` text (nats-py hands it on as `nats.errors.Error("nats:
'...'")`): for the SDK's connection (`plane.client.connection`), the roles'
(`plane.contract.natsconn`) and `plane status`.

A refusal is final for the connection that got it: the same credentials are refused again,
and an account at its connection limit stays there until one of its connections closes. So
a first connect stops at the first refusal (nats-py would try again and again: 40 times over
ten seconds for a role, and its later tries often saw only the reset that follows the
server's `-ERR`, which then stood as the reason), and the message names the cause and what
to do instead of "is a server running there?".
"""

from __future__ import annotations

import socket
from enum import StrEnum

from nats.errors import AuthorizationError


class Refusal(StrEnum):
    """Why the server would not have this connection."""

    CREDENTIALS = "credentials"  # wrong, missing, revoked or expired credentials
    ACCOUNT_CONNECTIONS = "account-connections"  # the account holds its max_connections
    SERVER_CONNECTIONS = "server-connections"  # the server holds its max_connections
    SUBSCRIPTIONS = "subscriptions"  # the account's max_subscriptions (once connected)


# The server's -ERR texts (nats-server 2.15.1, lowercased), most specific first: "maximum
# connections exceeded" is a substring of no account's, but keep the account's first anyway.
_SIGNS: tuple[tuple[Refusal, tuple[str, ...]], ...] = (
    (Refusal.CREDENTIALS, ("authorization violation", "authentication expired",
                           "authentication revoked", "authorization failed")),
    (Refusal.ACCOUNT_CONNECTIONS, ("maximum account active connections exceeded",)),
    (Refusal.SERVER_CONNECTIONS, ("maximum connections exceeded",)),
    (Refusal.SUBSCRIPTIONS, ("maximum subscriptions exceeded",)),
)


def refusal_of(exc: BaseException | None) -> Refusal | None:
    """The refusal `exc` reports, or None for anything else (a socket error, a timeout)."""
    if exc is None:
        return None
    if isinstance(exc, AuthorizationError):  # nats-py's own, for an -ERR once connected
        return Refusal.CREDENTIALS
    text = str(exc).lower()
    for refusal, signs in _SIGNS:
        if any(sign in text for sign in signs):
            return refusal
    return None


def what_to_do(refusal: Refusal, *, credentials: str) -> str:
    """One sentence on the cause of `refusal` and what to do. `credentials`: where the
    caller gave them (`--user/--password, --token, --creds`; `ConnectOptions`)."""
    match refusal:
        case Refusal.CREDENTIALS:
            return (f"the server refused the credentials: check them ({credentials}); a "
                    "tenant's are printed by `plane auth add-tenant DIR NAME --json`, a "
                    "role's by `plane auth init DIR --json` (a revoked or rotated one: ask "
                    "the operator for the new one)")
        case Refusal.ACCOUNT_CONNECTIONS:
            return ("the account already holds as many connections as its limit allows: "
                    "close some of its connections, or have the operator raise the limit "
                    "(`plane auth add-tenant DIR NAME --max-connections N`)")
        case Refusal.SERVER_CONNECTIONS:
            return ("the server already holds as many connections as it allows: close some, "
                    "or raise max_connections in the server's config")
        case Refusal.SUBSCRIPTIONS:
            return ("the account's limit of subscriptions (its operator raises it: `plane "
                    "auth add-tenant DIR NAME --max-subscriptions N --max-connections N`)")


def unknown_host(exc: BaseException, url: str) -> str | None:
    """Why `url` is likely no URL at all: a server given without a scheme (`garbage`, which
    nats-py reads as the host `garbage`, port 4222) whose host name does not resolve. None
    when that cannot be told (a `nats://` URL whose host does not resolve yet may be a
    container that is still starting: that is retried)."""
    if not isinstance(exc, socket.gaierror):
        return None
    bare = [s for s in url.split(",") if "://" not in s]
    if not bare:
        return None
    return (f"{', '.join(bare)} is no host name that resolves ({exc.strerror or exc}); a NATS "
            "URL reads nats://HOST:PORT (or tls://, ws://, wss://), several comma separated")
