"""One exception root for the plane, one subclass per action the caller can take."""

from __future__ import annotations

import errno
from typing import TypedDict, Unpack


class ErrorContext(TypedDict, total=False):
    """What every PlaneError may carry besides its message (typed keyword plumbing)."""

    request_id: str | None
    attempts: int


class PlaneError(Exception):
    """Root of every error the plane raises on purpose."""

    def __init__(self, message: str, *, request_id: str | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.attempts = attempts


class BadRequest(PlaneError, ValueError):
    """The request itself is wrong (body, model name, deadline): fix it; retrying won't help."""

    def __init__(self, message: str, *, reason: str = "bad-request",
                 **kw: Unpack[ErrorContext]) -> None:
        super().__init__(message, **kw)
        self.reason = reason


class Rejected(PlaneError):
    """Every slot is busy: come back after `retry_after_ms`, or go elsewhere at once when
    `reason` is `"deadline"` (no slot frees in time for your deadline) or `"overloaded"`
    (every slot's promises are taken: the plane is past the load it can promise to)."""

    def __init__(
        self, message: str, *, retry_after_ms: int, reason: str = "busy",
        **kw: Unpack[ErrorContext],
    ) -> None:
        super().__init__(message, **kw)
        self.retry_after_ms = retry_after_ms
        self.reason = reason


class DeadlineExceeded(PlaneError, TimeoutError):
    """The deadline passed before an answer: the work may or may not have run."""


class Unavailable(PlaneError, ConnectionError):
    """No healthy capacity for the model, or the node failed mid-request: try another
    plane or later."""


class ConfigError(PlaneError, ValueError):
    """A configuration value is wrong; the message names the option and what is allowed."""


def cannot_listen(server: str, host: str, port: int, exc: OSError, *, option: str,
                  host_option: str) -> ConfigError:
    """The one-line error for a server of ours that cannot bind `host`:`port` (the metrics',
    the gateway's): which address, why, and what to do, where the bare OSError was a
    traceback. `option`/`host_option`: the flags that set them. A busy port reads as a busy
    NATS port does (`plane.contract.embedded`)."""
    if exc.errno == errno.EADDRINUSE:
        why = (f"the port is in use; stop what listens there or pick another port ({option}; "
               "0: any free port)")
    else:  # an address not of this host, a name that does not resolve, a privileged port
        why = f"{exc.strerror or exc}; check {host_option} and {option}"
    return ConfigError(f"{server} cannot listen on {host}:{port}: {why}")


class IdentityInUse(ConfigError):
    """Another running process has this node or router id (`kind`, `ident`): give this one
    another id, or stop the other first."""

    def __init__(self, message: str, *, kind: str, ident: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.ident = ident


class ConnectFailed(Unavailable):
    """The plane's NATS server could not be reached at `url` (refused, unknown host, bad
    credentials, TLS) within the client's connect attempts: check the URL and credentials, or
    start a plane (`plane up --port 4222`)."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class ConnectionClosed(Unavailable):
    """This client's connection to the plane is closed, by `close()` or by nats-py after an
    error the server sent (`why`, e.g. the account's subscription limit): open a new client
    (a closed one never reopens)."""

    def __init__(self, message: str, *, why: str = "", **kw: Unpack[ErrorContext]) -> None:
        super().__init__(message, **kw)
        self.why = why


class MissingExtra(PlaneError, ImportError):
    """A command needs an optional part of the package that is not installed (`extra`, the
    missing `module`): install it as the message says."""

    def __init__(self, message: str, *, extra: str, module: str) -> None:
        super().__init__(message)
        self.extra = extra
        self.module = module
