"""Tenants' settings into the live-settings bucket: `share.<tenant>` and `max_rate.<tenant>`
in PLANE_CONFIG (`plane.contract.settings`), which routers follow within a second. `plane auth
add-tenant --nats URL` writes them with the admin role (`plane up --auth DIR` through its
stack's `settings`)."""

from __future__ import annotations

from nats.js.errors import NotFoundError

from plane.auth.store import AuthDir
from plane.contract.errors import ConfigError
from plane.contract.natsconn import close, connect


async def put_tenant_settings(d: AuthDir, url: str) -> dict[str, int]:
    """Write every tenant's settings; return what was written (key -> value)."""
    wanted = d.tenant_settings()
    if not wanted:
        return wanted
    state = d.load()
    nc = await connect(d.options("admin", url, name="plane-auth", state=state))
    try:
        try:
            kv = await nc.jetstream().key_value(state.names.config_bucket)
        except NotFoundError as exc:
            raise ConfigError(f"no bucket {state.names.config_bucket} at {url}: start the "
                              "plane first") from exc
        for key, value in wanted.items():
            await kv.put(key, str(value).encode())
    finally:
        await close(nc)
    return wanted
