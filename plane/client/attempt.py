"""One attempt of a request, shared by `Client.call` and the streams (`plane.client.stream`):
the body, the headers it goes out with, and the answers the client makes up itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from plane.client.result import LocalCause
from plane.contract.config import MAX_DEADLINE_MS
from plane.contract.errors import ConfigError
from plane.contract.messages import Reason, Status, error_body
from plane.contract.subjects import Header

_encoder = msgspec.json.Encoder()


def encode_payload(payload: Any) -> bytes:
    """Bytes pass through; anything else (dict, list, msgspec Struct) is encoded as JSON."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    return _encoder.encode(payload)


def with_start_wait(headers: Mapping[str, str] | None,
                    start_wait_ms: int | None) -> Mapping[str, str] | None:
    """The caller's headers plus `Plane-Wait-Ms` when it says how long it waits at the router
    for its start rather than be refused (a burst from a caller that does not retry)."""
    if start_wait_ms is None:
        return headers
    if not 1 <= start_wait_ms <= MAX_DEADLINE_MS:
        raise ConfigError(f"start_wait_ms must be 1..{MAX_DEADLINE_MS} ms")
    return {**(headers or {}), Header.WAIT_MS: str(start_wait_ms)}


def attempt_headers_for(
    headers: Mapping[str, str] | None, *, request_id: str, attempt: int,
    deadline_ms: int | None, ticket: str | None, avoid_node: str | None,
    content_type: str | None, wake: str | None = None,
) -> dict[str, str]:
    """The headers of one attempt. The caller's own first (trace context, a tenant the
    gateway names): the plane's, set here, win."""
    out = dict(headers or {})
    out[Header.REQUEST_ID] = request_id
    out[Header.ATTEMPT] = str(attempt)
    if deadline_ms is not None:
        out[Header.DEADLINE_MS] = str(deadline_ms)
    if ticket:
        out[Header.TICKET] = ticket
    if avoid_node:
        out[Header.AVOID_NODE] = avoid_node
    if content_type:
        out[Header.CONTENT_TYPE] = content_type
    if wake:
        out[Header.WAKE] = wake
    return out


def local_reply(status: Status, reason: Reason, message: str, request_id: str,
                cause: LocalCause) -> tuple[bytes, dict[str, str]]:
    """A status the client makes up itself (no answer in time, nobody listening), with the
    call's request id as the plane's replies carry it, and why it did (`Plane-Local`: an
    answer passed on, by the gateway, is told from the plane's own)."""
    return error_body(message, reason), {Header.STATUS: str(int(status)), Header.REASON: reason,
                                         Header.REQUEST_ID: request_id, Header.LOCAL: cause}
