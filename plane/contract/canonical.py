"""One canonical log line per request (the router's decision, the node's run, the gateway's
HTTP exchange), sampled when the rate is high.

A line names the request and what became of it, with the microseconds of each stage, so that
one `grep request_id=...` across the router, the node and the gateway tells a request's
story. At thousands of requests per second a line each would cost more than the request: up
to `per_s` lines per second are written (a token bucket with a one-second burst), and each
line says how many were `skipped` since the last one. Errors have their own budget, so an
outage is seen even while successes are sampled away. A line not written costs a clock read
and a comparison; at a log level above info, nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog


@dataclass(slots=True)
class _Bucket:
    per_s: float
    tokens: float = 0.0
    at_s: float | None = None
    skipped: int = 0

    def take(self, now_s: float) -> bool:
        if self.at_s is not None:
            self.tokens = min(self.per_s, self.tokens + (now_s - self.at_s) * self.per_s)
        self.at_s = now_s
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.skipped += 1
        return False


class CanonicalLog:
    def __init__(self, name: str, *, per_s: float = 20.0, errors_per_s: float = 50.0) -> None:
        self._log = structlog.get_logger(name)
        self._ok = _Bucket(per_s, tokens=per_s)
        self._errors = _Bucket(errors_per_s, tokens=errors_per_s)

    def due(self, *, error: bool = False) -> bool:
        """Whether the next line gets written: callers on the hot path ask first, so that
        the fields of a line that would be skipped are never built."""
        return (self._errors if error else self._ok).take(time.monotonic())

    def line(self, event: str, *, error: bool = False, **fields: Any) -> None:
        if self.due(error=error):
            self.write(event, error=error, **fields)

    def write(self, event: str, *, error: bool = False, **fields: Any) -> None:
        """A line that `due` let through."""
        bucket = self._errors if error else self._ok
        skipped, bucket.skipped = bucket.skipped, 0
        if error:
            self._log.warning(event, skipped=skipped, **fields)
        else:
            self._log.info(event, skipped=skipped, **fields)
