"""Connect to NATS with the options every command shares (URL, user/password, token, creds,
TLS CA). One function, so a secured server works the same for router, node, gateway, bridge."""

from __future__ import annotations

import ssl
from typing import Any

import nats
import structlog
from nats.aio.client import Client

from plane.config import ConnectOptions
from plane.errors import ConfigError, Unavailable


def connect_kwargs(opts: ConnectOptions) -> dict[str, Any]:
    if opts.url is None:
        raise ConfigError("no NATS URL: pass --nats URL, or use `plane up` for the embedded one")
    kw: dict[str, Any] = {
        "servers": opts.url.split(","),
        "name": opts.name,
        "connect_timeout": 5,
        # Bounded for the first connection (a wrong password or URL fails in about ten
        # seconds with a clear error), unbounded once connected: see `connect`.
        "max_reconnect_attempts": INITIAL_ATTEMPTS,
        "reconnect_time_wait": 0.25,
        "allow_reconnect": True,
    }
    if opts.user is not None:
        kw["user"], kw["password"] = opts.user, opts.password
    if opts.token is not None:
        kw["token"] = opts.token
    if opts.creds is not None:
        kw["user_credentials"] = opts.creds
    if opts.tls_ca is not None:
        kw["tls"] = ssl.create_default_context(cafile=opts.tls_ca)
    return kw


log = structlog.get_logger("plane.nats")

INITIAL_ATTEMPTS = 40  # x reconnect_time_wait 0.25 s


async def connect(opts: ConnectOptions) -> Client:
    """Connect; raise `Unavailable` saying why when the server cannot be reached or refuses
    us. Once connected, reconnect forever (a broker restart must not end a node)."""
    last: list[BaseException] = []

    async def remember(exc: Exception) -> None:
        last[:] = [exc]  # only the latest: this callback lives as long as the connection
        log.warning("nats connection error", name=opts.name, error=repr(exc))

    try:
        nc = await nats.connect(**connect_kwargs(opts), error_cb=remember)
    except Exception as exc:
        why = last[-1] if last else exc
        raise Unavailable(
            f"cannot connect to NATS at {opts.url}: {why}. Check the URL and the credentials "
            "(--user/--password, --token, --creds, --tls-ca)"
        ) from exc
    nc.options["max_reconnect_attempts"] = -1  # nats-py reads it at each reconnect
    return nc
