"""The gateway's settings, validated on construction (the CLI builds this from flags)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from plane.contract.config import MAX_BODY_BYTES
from plane.contract.errors import ConfigError
from plane.contract.subjects import InvalidToken, Names, check_token


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (read it back from `Gateway.port`)
    names: Names = field(default_factory=Names)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies get a 413 before reaching NATS
    bearer_token: str | None = None  # when set, /v1/* needs `Authorization: Bearer <token>`
    # Tenants by bearer token: with any, /v1/* needs one of these tokens (or `bearer_token`,
    # which names no tenant) and the request goes on as its tenant (`Plane-Tenant`, which
    # the router trusts from the plane's own account: docs/design.md, "Tenants").
    tenant_tokens: dict[str, str] = field(default_factory=dict)  # token -> tenant
    shutdown_timeout_s: float = 5.0
    # Slow clients (slowloris): a connection must deliver a whole request head within
    # `header_timeout_s` of opening, or of its previous answer, else it is closed; an idle
    # keep-alive connection is closed after as long. A body must arrive within
    # `body_timeout_s` of its head (else 408, and the connection is closed).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    # /readyz asks whether a router answers `$SRV.PING` (`plane.gateway.ready`): it waits at
    # most `ready_timeout_s` for one, and keeps the answer for `ready_cache_s`.
    ready_timeout_s: float = 0.5
    ready_cache_s: float = 1.0
    # While the gateway's NATS connection is down, a request that comes meanwhile waits this
    # long for it to come back (a server's restart), then is answered 503 `no-capacity` (not
    # held for the SDK's 30 s wait of a call with no deadline). One sent before the drop
    # is answered at the drop, 503 `unhealthy` (a stream's Server-Sent Events end with it):
    # its answer, if the plane sends one, is lost with the connection
    # (`plane.client.connection.OnDrop`).
    reconnect_wait_ms: int = 1000
    # The tickets of 429s held for retries that cannot bring them back (`plane.gateway.
    # tickets`): at most this many at once (a few hundred bytes each), the oldest dropped.
    max_held_tickets: int = 10_000

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not 0.1 <= getattr(self, name) <= 3600:
                raise ConfigError(f"{name} must be between 0.1 and 3600 s")
        if not 0.01 <= self.ready_timeout_s <= 60 or not 0 <= self.ready_cache_s <= 60:
            raise ConfigError("ready_timeout_s must be 0.01..60 s and ready_cache_s 0..60 s")
        if not 0 <= self.reconnect_wait_ms <= 600_000:
            raise ConfigError("reconnect_wait_ms must be 0..600000 ms")
        if not 1 <= self.max_held_tickets <= 1_000_000:
            raise ConfigError("max_held_tickets must be 1..1000000")
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port must be in 0..65535")
        if not 1 <= self.max_body_bytes <= 16 * 1024 * 1024:
            raise ConfigError("--max-body-bytes must be between 1 B and 16 MiB")
        if self.bearer_token is not None and len(self.bearer_token) < 8:
            raise ConfigError("the bearer token must be at least 8 characters")
        if self.bearer_token is not None and (
                tenant := self.tenant_tokens.get(self.bearer_token)) is not None:
            raise ConfigError(f"--bearer-token is also the --tenant-token of tenant {tenant!r}: "
                              f"its requests would all go on as {tenant!r}; give the tenant a "
                              "token of its own")
        for token, tenant in self.tenant_tokens.items():
            if len(token) < 8:
                raise ConfigError(f"tenant {tenant!r}: a bearer token must be at least 8 "
                                  "characters")
            try:
                check_token("tenant", tenant)
            except InvalidToken as exc:
                raise ConfigError(str(exc)) from exc

    @property
    def needs_token(self) -> bool:
        return self.bearer_token is not None or bool(self.tenant_tokens)


def tenant_tokens_from(pairs: Iterable[str]) -> dict[str, str]:
    """`--tenant-token TENANT=TOKEN` flags as `GatewayConfig.tenant_tokens` (token -> tenant).
    A tenant may have several tokens (one rotated in beside the old); a token names one
    tenant, so one given to two is refused, naming the tenants and not the token (accepted,
    every request with it went on as the last named, metered and share-limited as that one:
    found from outside)."""
    tokens: dict[str, str] = {}
    for pair in pairs:
        tenant, sep, secret = pair.partition("=")
        if not sep or not tenant or not secret:
            # Never the value itself: without its `=` it may be the token alone.
            got = (f"tenant {tenant!r} with an empty token" if sep and tenant else
                   "an empty tenant" if sep else
                   f"a value with no '=' ({len(pair)} characters, not shown: it may be a token)")
            raise ConfigError(f"--tenant-token wants TENANT=TOKEN, got {got}")
        if (other := tokens.setdefault(secret, tenant)) != tenant:
            raise ConfigError(f"--tenant-token: tenants {other!r} and {tenant!r} are given the "
                              "same bearer token, and a token names one tenant (its requests "
                              "go on as it): give each tenant its own")
    return tokens
