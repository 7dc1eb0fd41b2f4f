"""What one call to the plane came to: the `Result` struct and the mapping of a final reply to
the typed errors of `plane.contract.errors`.

A `Result` is returned for every answer, 200 or not (`Client.call`); `Client.invoke` returns
only 200s and raises the matching error for the rest (`Result.raise_for_status`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import msgspec

from plane.contract.errors import BadRequest, DeadlineExceeded, PlaneError, Rejected, Unavailable
from plane.contract.messages import Reason, Status, error_decoder
from plane.contract.subjects import Header


def header_int(headers: Mapping[str, str], name: str) -> int | None:
    """An integer header, or None when absent or not an integer (never raises)."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def reply_status(headers: Mapping[str, str]) -> int:
    """The Plane-Status of a reply; a reply without one is a plain 200 (a bare responder)."""
    status = header_int(headers, Header.STATUS)
    return 200 if status is None else status


class LocalCause(StrEnum):
    """Why the client made a final status up itself (`Result.local`): a status alone cannot
    tell an attempt the plane never answered from one never sent, and a caller that counts
    outcomes (`plane pulse`) must not count the client's own decisions as the plane's
    timeouts."""

    NO_ANSWER = "no-answer"  # sent; no answer within the deadline and its margin (504)
    NOT_SENT = "not-sent"  # the call's deadline passed before the attempt went (504)
    DISCONNECTED = "disconnected"  # not sent: the connection stayed down (503, or 504 when
    # it was waited for until the deadline)
    NO_RESPONDERS = "no-responders"  # sent; nobody listens on the model's subject (503)
    DROPPED = "dropped"  # sent; the connection dropped while it waited (503,
    # `ClientConfig.end_on_disconnect`)
    CLOSED = "closed"  # a stream whose connection closed under it (503)
    BROKEN = "broken"  # a stream whose messages came out of order (503)
    CANCELLED = "cancelled"  # a stream its caller closed before its end (200)


class Result(msgspec.Struct, frozen=True, kw_only=True):
    """One call's answer and how it got there.

    statuses:        the status of each attempt in order (the last is `status`)
    hinted:          how many of the 429s carried a Retry-After-Ms (or Retry-After)
    waited_ms:       time spent sleeping between attempts (Retry-After or backoff)
    last_attempt_ms: latency of the final attempt alone, send to answer
    local:           True when the client made the status up itself (timeout, no responders)
    local_cause:     why it did (None when the status is the plane's own)
    """

    status: int
    body: bytes
    headers: dict[str, str]
    request_id: str
    statuses: tuple[int, ...]
    hinted: int = 0
    waited_ms: float = 0.0
    last_attempt_ms: float = 0.0
    local: bool = False
    local_cause: LocalCause | None = None

    # -- what the reply headers say --------------------------------------------------------
    @property
    def attempts(self) -> int:
        return len(self.statuses)

    @property
    def refusals(self) -> int:
        """How many attempts were refused with a 429."""
        return sum(1 for s in self.statuses if s == Status.BUSY)

    @property
    def node(self) -> str | None:
        return self.headers.get(Header.NODE)

    @property
    def slot(self) -> int | None:
        return header_int(self.headers, Header.SLOT)

    @property
    def service_us(self) -> int | None:
        return header_int(self.headers, Header.SERVICE_US)

    @property
    def reason(self) -> str | None:
        return self.headers.get(Header.REASON)

    @property
    def retry_after_ms(self) -> int | None:
        return header_int(self.headers, Header.RETRY_AFTER_MS)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def json(self) -> Any:
        """The body decoded as JSON."""
        return msgspec.json.decode(self.body)

    def error_message(self) -> str:
        try:
            return error_decoder.decode(self.body).error
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self.body[:200].decode(errors="replace") or f"status {self.status}"

    def raise_for_status(self) -> Result:
        """Return self for a 200; raise the typed error of any other status."""
        if self.ok:
            return self
        raise self.to_error()

    def to_error(self) -> PlaneError:
        kw: dict[str, Any] = {"request_id": self.request_id, "attempts": self.attempts}
        msg = f"{self.error_message()} (status {self.status}, attempts {self.attempts})"
        reason = self.reason
        if self.status == Status.BUSY:
            return Rejected(
                msg,
                retry_after_ms=self.retry_after_ms or 0,
                reason=reason or Reason.BUSY.value,
                **kw,
            )
        if self.status in (Status.BAD_REQUEST, Status.TOO_LARGE):
            return BadRequest(msg, reason=reason or Reason.BAD_REQUEST.value, **kw)
        if self.status == Status.DEADLINE:
            return DeadlineExceeded(msg, **kw)
        return Unavailable(msg, **kw)
