"""What a caller may say in its request headers, read strictly, in one place: the router, the
HTTP gateway and the live settings use these parsers, so the three agree on every limit.

Why strict: what a caller sends is echoed (the request id goes into every reply and into the
slot message) or turned into a number that sizes something (a deadline becomes a TTL and a
schedule). A request id of a megabyte echoed into a reply exceeds the server's max_payload,
and the server closes the router's connection; past 64 KiB of headers JetStream refuses the
slot publish, which was answered 503 `unhealthy`: a caller's error reported as an outage. So
a value the plane cannot carry safely is a 400 at once, and a bad request id is never echoed
(the 400 carries a fresh one). And Python's `int()` is lenient (' 50', '+50', '5_0' and
Arabic-Indic digits all parse; '²' passes `str.isdigit()`, then `int()` fails; 5,000 digits
fail with a different error), so a number is ASCII digits only, at most as many as its bound.

Limits (also in docs/design.md, "Headers"):
  Plane-Request-Id   1..128 visible ASCII characters (0x21-0x7E)
  Plane-Deadline-Ms  ASCII decimal, 1..MAX_DEADLINE_MS
  Plane-Attempt      ASCII decimal, 1..MAX_ATTEMPT
  Plane-Ticket       1..128 visible ASCII characters
  Plane-Avoid-Node   a node name: 1..64 of A-Z a-z 0-9 _ -
  Plane-Wait-Ms      ASCII decimal, 1..MAX_DEADLINE_MS
  Plane-Wake         an inbox: `_INBOX.` then dot-separated tokens of A-Z a-z 0-9 _ -, at most
                     128 characters (the router publishes to it: never a wildcard, never
                     a subject outside the callers' inboxes, such as a slot's)
  Content-Type       1..128 printable ASCII characters (0x20-0x7E)
  every header       names and values together at most MAX_HEADER_BYTES (UTF-8), so that the
                     router's messages on a caller's behalf stay far under the server's limits
  a `Plane-` header  at most once (NATS and HTTP both allow a name twice; which value counts
                     would be a guess, so it is a 400 naming it)

NATS and HTTP both strip the white space around a header value before we see it, so ' 50'
arrives as '50' by either route; the settings parser sees raw values and refuses it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec
from multidict import MultiMapping

from plane.contract.config import MAX_DEADLINE_MS
from plane.contract.errors import BadRequest
from plane.contract.header_lines import REPEATED
from plane.contract.subjects import TOKEN_RE, Header, InvalidToken, check_token

MAX_ID_CHARS = 128
MAX_ATTEMPT = 10_000
MAX_HEADER_BYTES = 8 * 1024
SHOWN_CHARS = 32  # of a bad value, in an error message: never echo a caller's megabyte

_VISIBLE = re.compile(rf"[\x21-\x7e]{{1,{MAX_ID_CHARS}}}")
_PRINTABLE = re.compile(rf"[\x20-\x7e]{{1,{MAX_ID_CHARS}}}")
_WAKE = re.compile(r"_INBOX(?:\.[A-Za-z0-9_-]+)+")


def shown(raw: str) -> str:
    """`raw` for an error message or a log line: its repr, cut to a few characters."""
    if len(raw) <= SHOWN_CHARS:
        return repr(raw)
    return f"{raw[:SHOWN_CHARS]!r}... ({len(raw)} characters)"


def decimal(raw: str, *, what: str, low: int, high: int) -> int:
    """`raw` as an integer in `low..high`: ASCII digits only (no sign, space, underscore or
    other scripts' digits) and at most as many as `high` has. Raises ValueError naming
    `what`, the value (cut short) and the range."""
    if not (0 < len(raw) <= len(str(high)) and raw.isascii() and raw.isdigit()):
        raise ValueError(f"{what} must be a decimal integer {low}..{high}, got {shown(raw)}")
    value = int(raw)
    if not low <= value <= high:
        raise ValueError(f"{what} must be {low}..{high}, got {value}")
    return value


def header_bytes(headers: Mapping[str, str]) -> int:
    """Size of `headers` on the wire, `Name: value\\r\\n` each (UTF-8)."""
    return sum(len(k) + len(v.encode("utf-8", "replace")) + 4 for k, v in headers.items())


class CallerHeaders(msgspec.Struct, frozen=True, kw_only=True):
    """A request's headers, checked: None where the caller did not send one."""

    request_id: str | None = None
    deadline_ms: int | None = None
    attempt: int | None = None
    ticket: str | None = None
    avoid_node: str | None = None
    content_type: str | None = None
    stream: bool = False  # `Plane-Stream: 1`: answer as a stream
    stream_deadline_ms: int | None = None  # budget for the whole stream (streams only)
    wake: str | None = None  # the caller's inbox, where the router calls a holder back
    wait_ms: int | None = None  # how long it will wait for its start rather than a 429


def repeated(headers: Mapping[str, str]) -> list[str]:
    """The `Plane-` headers given more than once, each named once: a NATS message's as
    `plane.contract.header_lines` lists them (nats-py's dict kept the last), an HTTP
    request's (aiohttp's multidict, every field in order) counted without case."""
    if type(headers) is not dict and isinstance(headers, MultiMapping):  # (the router's: a dict)
        seen: set[str] = set()
        names = []
        for name, _ in headers.items():  # every field (its keys() are each name once)
            low = name.lower()
            if low.startswith("plane-"):
                if low in seen:
                    names.append(name)
                seen.add(low)
    else:
        listed = headers.get(REPEATED)
        if not listed:
            return []
        names = [n for n in listed.split(", ") if n.startswith("Plane-")]
    return list(dict.fromkeys(names))


def _tenant(headers: Mapping[str, str]) -> None:
    """`Plane-Tenant`, where it counts (a sender inside the plane's account: across an import
    the server's `Nats-Request-Info` names the account, and the header is ignored): a name
    the plane can keep, or a 400 (it was counted as tenant `other`, silently)."""
    raw = headers.get(Header.TENANT)
    if raw is not None and Header.NATS_REQUEST_INFO not in headers and not TOKEN_RE.fullmatch(
            raw):
        raise ValueError(f"{Header.TENANT} must be 1..64 of A-Z a-z 0-9 _ -, got {shown(raw)}")


def _wake(headers: Mapping[str, str]) -> str | None:
    raw = headers.get(Header.WAKE)
    if raw is not None and (len(raw) > MAX_ID_CHARS or not _WAKE.fullmatch(raw)):
        raise ValueError(f"{Header.WAKE} must be an inbox: _INBOX. and dot-separated tokens of "
                         f"A-Z a-z 0-9 _ -, at most {MAX_ID_CHARS} characters, got {shown(raw)}")
    return raw


def _stream(headers: Mapping[str, str]) -> bool:
    raw = headers.get(Header.STREAM)
    if raw is None:
        return False
    if raw != "1":
        raise ValueError(f"{Header.STREAM} must be 1 (answer as a stream), got {shown(raw)}")
    return True


def _text(headers: Mapping[str, str], name: str, pattern: re.Pattern[str]) -> str | None:
    raw = headers.get(name)
    if raw is not None and not pattern.fullmatch(raw):
        raise ValueError(f"{name} must be 1..{MAX_ID_CHARS} printable ASCII characters, "
                         f"got {shown(raw)}")
    return raw


def _number(headers: Mapping[str, str], name: str, high: int) -> int | None:
    raw = headers.get(name)
    return None if raw is None else decimal(raw, what=name, low=1, high=high)


def echoed_request_id(headers: Mapping[str, str]) -> str | None:
    """The caller's request id when it is valid (what an answer echoes), else None: for the
    answers made before the rest of the headers are read (a flood's refusal)."""
    try:
        return _text(headers, Header.REQUEST_ID, _VISIBLE)
    except ValueError:
        return None


def asked_ms(headers: Mapping[str, str], name: str) -> int | None:
    """The caller's `name` (`Plane-Deadline-Ms`, `Plane-Wait-Ms`: ms, 1..MAX_DEADLINE_MS) when
    it is valid, else None: for what is decided before the rest of the headers are read (a
    request refused unread, the inbox telling one that waits as long as its caller said from
    one waiting too long: `plane.router.inbox`)."""
    try:
        return _number(headers, name, MAX_DEADLINE_MS)
    except ValueError:
        return None


def read_caller(headers: Mapping[str, str]) -> CallerHeaders:
    """Check what a caller sent. Raises `BadRequest` saying what is wrong; its `request_id` is
    the caller's id when that one is valid, else None (the answer then gets a fresh id)."""
    try:
        request_id = _text(headers, Header.REQUEST_ID, _VISIBLE)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if twice := repeated(headers):
        raise BadRequest(f"{', '.join(twice)} given more than once: send each Plane- header "
                         "once (which value counts would be a guess)",
                         request_id=None if Header.REQUEST_ID.lower() in
                         {n.lower() for n in twice} else request_id)
    try:
        # A character is at most 4 bytes in UTF-8 (`header_bytes` adds 4 a header): only
        # headers that might be over are encoded to count them (two C-level sums, against an
        # encode per value).
        chars = sum(map(len, headers)) + sum(map(len, headers.values()))
        if 4 * chars + 4 * len(headers) > MAX_HEADER_BYTES and (
                size := header_bytes(headers)) > MAX_HEADER_BYTES:
            raise ValueError(f"headers are {size} bytes; the limit is {MAX_HEADER_BYTES}")
        avoid = headers.get(Header.AVOID_NODE)
        if avoid is not None:
            check_token("node", avoid)
        _tenant(headers)
        return CallerHeaders(
            request_id=request_id,
            deadline_ms=_number(headers, Header.DEADLINE_MS, MAX_DEADLINE_MS),
            attempt=_number(headers, Header.ATTEMPT, MAX_ATTEMPT),
            ticket=_text(headers, Header.TICKET, _VISIBLE),
            avoid_node=avoid,
            content_type=_text(headers, Header.CONTENT_TYPE, _PRINTABLE),
            stream=_stream(headers),
            stream_deadline_ms=_number(headers, Header.STREAM_DEADLINE_MS, MAX_DEADLINE_MS),
            wake=_wake(headers),
            wait_ms=_number(headers, Header.WAIT_MS, MAX_DEADLINE_MS),
        )
    except InvalidToken:
        raise BadRequest(f"{Header.AVOID_NODE} must be a node name (1..64 of A-Z a-z 0-9 _ -), "
                         f"got {shown(headers[Header.AVOID_NODE])}",
                         request_id=request_id) from None
    except ValueError as exc:
        raise BadRequest(str(exc), request_id=request_id) from None


class RequestInfo(msgspec.Struct):
    """The part of nats-server's `Nats-Request-Info` the plane reads: the requesting account
    and connection (the server's id and its client id there), which the server sets on a
    message that crossed a service import with `share: true` (and overwrites when a caller
    forged it)."""

    acc: str = ""
    id: int = 0  # the client id, on server `server`
    server: str = ""

    @property
    def client(self) -> str:
        """`<server id>/<client id>`: one connection, as the server's advisories name it
        (`client_key`); "" when the header did not say."""
        return client_key(self.server, self.id) if self.server and self.id else ""


_request_info = msgspec.json.Decoder(RequestInfo)


def request_info(headers: Mapping[str, str] | None) -> RequestInfo:
    """What the server said of a message that came across an import; empty fields for one
    sent inside the plane's own account (a plane role) or unreadable."""
    raw = (headers or {}).get(Header.NATS_REQUEST_INFO)
    if not raw:
        return RequestInfo()
    try:
        return _request_info.decode(raw)
    except msgspec.DecodeError:
        return RequestInfo()


def across_import(headers: Mapping[str, str]) -> RequestInfo | None:
    """What the server said of a request that came across an import, read once per request
    and handed to whatever needs it (the tenant, the caller, a stream's node): None when it
    did not (sent inside the plane's own account: the usual case, and no work), empty fields
    when it is unreadable."""
    if Header.NATS_REQUEST_INFO not in headers:
        return None
    return request_info(headers)


def requester_account(headers: Mapping[str, str] | None) -> str:
    """The account a message came from across an import; "" for one sent inside the plane's
    own account (a plane role) or unreadable."""
    return request_info(headers).acc


def client_key(server: str, client_id: int) -> str:
    return f"{server}/{client_id}"


NO_RESPONDERS = "503"  # the server's `Status` when nobody listens (see Header.NATS_STATUS)


def is_no_responders(headers: Mapping[str, str] | None) -> bool:
    """The server's own no-responders status (nobody listened on the subject a message with a
    reply went to), not a plane answer with a 503 (which carries `Plane-Status`)."""
    h = headers or {}
    return h.get(Header.NATS_STATUS) == NO_RESPONDERS and Header.STATUS not in h
