"""One exception root for the plane, one subclass per action the caller can take."""

from __future__ import annotations


class PlaneError(Exception):
    """Root of every error the plane raises on purpose."""

    def __init__(self, message: str, *, request_id: str | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.attempts = attempts


class BadRequest(PlaneError, ValueError):
    """The request itself is wrong (body, model name, deadline): fix it; retrying won't help."""

    def __init__(self, message: str, *, reason: str = "bad-request", **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.reason = reason


class Rejected(PlaneError):
    """Every slot is busy: come back after `retry_after_ms` (or go elsewhere at once when
    `reason == "deadline"`: no slot frees in time for your deadline)."""

    def __init__(
        self, message: str, *, retry_after_ms: int, reason: str = "busy", **kw: object
    ) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.retry_after_ms = retry_after_ms
        self.reason = reason


class DeadlineExceeded(PlaneError, TimeoutError):
    """The deadline passed before an answer: the work may or may not have run."""


class Unavailable(PlaneError, ConnectionError):
    """No healthy capacity for the model, or the node failed mid-request: try another
    plane or later."""


class ConfigError(PlaneError, ValueError):
    """A configuration value is wrong; the message names the option and what is allowed."""


class IdentityInUse(ConfigError):
    """Another running process has this node or router id (`kind`, `ident`): give this one
    another id, or stop the other first."""

    def __init__(self, message: str, *, kind: str, ident: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.ident = ident
