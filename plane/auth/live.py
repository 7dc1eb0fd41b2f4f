"""Tenants' settings into the live-settings bucket: `share.<tenant>` and `max_rate.<tenant>`
in PLANE_CONFIG (`plane.contract.settings`), which routers follow within a second. `plane auth
add-tenant --nats URL` writes them with the admin role (`plane up --auth DIR` through its
stack's `settings`)."""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from plane.auth.store import AuthDir
from plane.contract.config import ConnectOptions
from plane.contract.errors import ConfigError
from plane.contract.natsconn import close, connect
from plane.contract.subjects import Names, config_key


async def put_tenant_settings(d: AuthDir, url: str, *, lifted: str | None = None
                              ) -> dict[str, int]:
    """Write every tenant's settings, and delete the rate limit of tenant `lifted` when it
    has none now (`--max-rate 0` lifts one: the routers follow the deletion as they follow a
    change; only its own: another tenant's set by hand in PLANE_CONFIG stays); return what
    was written (key -> value)."""
    wanted = d.tenant_settings()
    state = d.load()
    gone = state.tenants.get(lifted) if lifted is not None else None
    lifted_keys = ([config_key("max_rate", lifted)]
                   if lifted is not None and gone is not None and gone.max_rate is None else [])
    if not wanted and not lifted_keys:
        return wanted
    nc = await connect(d.options("admin", url, name="plane-auth", state=state))
    try:
        kv = await _config_bucket(nc, state.names, url)
        for key, value in wanted.items():
            await kv.put(key, str(value).encode())
        for key in lifted_keys:
            with contextlib.suppress(KeyNotFoundError):  # none set (or deleted before)
                await kv.get(key)
                await kv.delete(key)
    finally:
        await close(nc)
    return wanted


async def check_plane(d: AuthDir, url: str) -> None:
    """What `add-tenant --nats URL` needs of the server before it writes anything: that it
    lets DIR's admin in, and holds the plane's settings bucket. A ConfigError saying which
    is not so (one connection attempt: an unreachable server fails in seconds)."""
    state = d.load()
    opts = d.options("admin", url, name="plane-auth", state=state)
    if (why := await connect_problem(opts)) is not None:
        raise ConfigError(f"cannot connect to NATS at {url} as {d.path}'s admin: {why}")
    nc = await connect(opts)
    try:
        await _config_bucket(nc, state.names, url)
    finally:
        await close(nc)


async def _config_bucket(nc: Client, names: Names, url: str) -> KeyValue:
    try:
        return await nc.jetstream().key_value(names.config_bucket)
    except NotFoundError as exc:
        raise ConfigError(f"no bucket {names.config_bucket} at {url}: start the plane "
                          "first") from exc


async def connect_problem(opts: ConnectOptions, *, within_s: float = 5.0) -> str | None:
    """Why one attempt to connect fails (None: it connects), in `within_s` at most; no
    retries (the plane's own `connect` retries a refusal for ~10 s)."""
    assert opts.url is not None
    seen: list[Exception] = []

    async def quiet(exc: Exception) -> None:  # nats-py logs a traceback per refusal
        seen.append(exc)

    nc = Client()
    try:
        # One attempt, as nats-py counts: 0 is no limit, and a refused port was tried again
        # for ever, every 2 s (its reconnect wait, which it waits between first attempts too).
        async with asyncio.timeout(within_s):
            await nc.connect(opts.url, user=opts.user, password=opts.password,
                             allow_reconnect=False, max_reconnect_attempts=1,
                             reconnect_time_wait=0, connect_timeout=2, error_cb=quiet)
    except TimeoutError:
        return f"no answer within {within_s:g} s"
    except Exception as exc:
        why = seen[0] if seen else exc  # the refusal itself, not nats-py's summary of it
        return str(why) or type(why).__name__
    finally:
        # Also after a refusal: with reconnects off, nats-py raises the server's refusal
        # without closing the connection's socket (a ResourceWarning when it is collected).
        await nc.close()
    return None


async def can_connect(opts: ConnectOptions) -> bool:
    return await connect_problem(opts) is None


async def tenant_let_in(d: AuthDir, tenant: str, url: str, *, within_s: float = 5.0) -> bool:
    """Whether the server at `url` lets `tenant` connect within `within_s` (it reloads in its
    own time after the signal). False: the reload did not take (nats-server cannot reload
    some changes, a new system account among them: it logs why and keeps the old config)."""
    opts = d.options(tenant, url)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within_s
    while not await can_connect(opts):
        if loop.time() >= give_up:
            return False
        await asyncio.sleep(0.2)
    return True
