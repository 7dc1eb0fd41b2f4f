"""Reply headers, built in one place for routers, nodes and the gateway."""

from __future__ import annotations

import math
import time
from typing import TypedDict, Unpack

from plane.contract.messages import Reason, Status, error_body
from plane.contract.subjects import Header


def now_ms() -> int:
    """Wall clock, epoch ms: only for stamps (Plane-Server-Time), never for durations."""
    return time.time_ns() // 1_000_000


def ok_headers(request_id: str, node: str, k: int, service_us: int) -> dict[str, str]:
    return {
        Header.STATUS: "200",
        Header.REQUEST_ID: request_id,
        Header.SERVER_TIME: str(now_ms()),
        Header.NODE: node,
        Header.SLOT: str(k),
        Header.SERVICE_US: str(service_us),
    }


class ErrorExtras(TypedDict, total=False):
    """What an error reply may add to its headers (typed keyword plumbing)."""

    retry_after_ms: int | None
    ticket: str | None
    node: str | None


def error_headers(
    request_id: str,
    status: Status,
    reason: Reason,
    *,
    retry_after_ms: int | None = None,
    ticket: str | None = None,
    node: str | None = None,
) -> dict[str, str]:
    h = {
        Header.STATUS: str(int(status)),
        Header.REQUEST_ID: request_id,
        Header.SERVER_TIME: str(now_ms()),
        Header.REASON: reason.value,
    }
    if retry_after_ms is not None:
        h[Header.RETRY_AFTER_MS] = str(retry_after_ms)
        h[Header.RETRY_AFTER] = str(max(1, math.ceil(retry_after_ms / 1000)))
    if ticket is not None:
        h[Header.TICKET] = ticket
    if node is not None:
        h[Header.NODE] = node
    return h


def error_reply(
    request_id: str, status: Status, reason: Reason, message: str, **kw: Unpack[ErrorExtras]
) -> tuple[bytes, dict[str, str]]:
    """An error's body and headers. Besides the plane's own, the NATS services standard's
    `Nats-Service-Error-Code` / `Nats-Service-Error` (what `nats micro` tools show)."""
    headers = error_headers(request_id, status, reason, **kw)
    headers[Header.NATS_SERVICE_ERROR_CODE] = str(int(status))
    headers[Header.NATS_SERVICE_ERROR] = _one_line(message)
    return error_body(message, reason), headers


def _one_line(text: str, limit: int = 256) -> str:
    """A header value: one line of printable text, bounded."""
    # The check alone is one C call: every refusal's message passes it (a character at a
    # time, it was a few per cent of the router's CPU at 2x of 1 ms work).
    flat = text if text.isprintable() else "".join(c if c.isprintable() else " " for c in text)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
