"""Connect to NATS with the options every command shares (URL, user/password, token, creds,
TLS CA). One function, so a secured server works the same for router, node, gateway, bridge."""

from __future__ import annotations

import ssl
from typing import Any

import nats
from nats.aio.client import Client

from plane.config import ConnectOptions
from plane.errors import ConfigError


def connect_kwargs(opts: ConnectOptions) -> dict[str, Any]:
    if opts.url is None:
        raise ConfigError("no NATS URL: pass --nats URL, or use `plane up` for the embedded one")
    kw: dict[str, Any] = {
        "servers": opts.url.split(","),
        "name": opts.name,
        "connect_timeout": 5,
        "max_reconnect_attempts": -1,
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


async def connect(opts: ConnectOptions) -> Client:
    return await nats.connect(**connect_kwargs(opts))
