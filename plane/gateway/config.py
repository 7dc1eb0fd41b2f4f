"""The gateway's settings, validated on construction (the CLI builds this from flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plane.config import MAX_BODY_BYTES
from plane.errors import ConfigError
from plane.subjects import Names


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (read it back from `Gateway.port`)
    names: Names = field(default_factory=Names)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies get a 413 before reaching NATS
    bearer_token: str | None = None  # when set, /v1/* needs `Authorization: Bearer <token>`
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port must be in 0..65535")
        if not 1 <= self.max_body_bytes <= 16 * 1024 * 1024:
            raise ConfigError("--max-body-bytes must be between 1 B and 16 MiB")
        if self.bearer_token is not None and len(self.bearer_token) < 8:
            raise ConfigError("the bearer token must be at least 8 characters")
