"""The messages of a stream (docs/design.md "Streams"), built and read in one place.

A stream is `start` (seq 0), `token` messages (seq 1, 2, ...), then one final message: the
node's `end`, or any other reply (a refusal, a router's 503/504), which every reader treats as
final. The node builds the headers here; the SDK, the gateway and pulse read with `kind_of`
and `StreamReader`, so that they all apply the one rule.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from plane.contract.messages import Status, StreamEnd, Usage
from plane.contract.replies import now_ms
from plane.contract.subjects import Header

ASKED = "1"  # the request header's value: answer as a stream

_end_decoder = msgspec.json.Decoder(StreamEnd)


class Kind(enum.StrEnum):
    START = "start"
    TOKEN = "token"
    END = "end"  # the node's end message
    FINAL = "final"  # any other message: a refusal or a router's answer, also final


def kind_of(headers: Mapping[str, str] | None) -> Kind:
    """What a message on a stream's inbox is. Anything but `start`/`token` ends the stream."""
    v = (headers or {}).get(Header.STREAM)
    if v == Kind.START:
        return Kind.START
    if v == Kind.TOKEN:
        return Kind.TOKEN
    if v == Kind.END:
        return Kind.END
    return Kind.FINAL


def asked(headers: Mapping[str, str] | None) -> bool:
    """Did the request ask to be answered as a stream?"""
    return (headers or {}).get(Header.STREAM) == ASKED


# -- building (the node) ---------------------------------------------------------------------
def start_headers(request_id: str, node: str, k: int, cancel_subject: str) -> dict[str, str]:
    return {
        Header.STREAM: Kind.START, Header.STREAM_SEQ: "0", Header.STATUS: "200",
        Header.REQUEST_ID: request_id, Header.NODE: node, Header.SLOT: str(k),
        Header.SERVER_TIME: str(now_ms()), Header.CANCEL_SUBJECT: cancel_subject,
    }


def token_headers(request_id: str, seq: int) -> dict[str, str]:
    return {Header.STREAM: Kind.TOKEN, Header.STREAM_SEQ: str(seq), Header.REQUEST_ID: request_id}


def end_message(request_id: str, seq: int, status: Status, end: StreamEnd,
                service_us: int, *, node: str = "") -> tuple[bytes, dict[str, str]]:
    headers = {
        Header.STREAM: Kind.END, Header.STREAM_SEQ: str(seq), Header.STATUS: str(int(status)),
        Header.REQUEST_ID: request_id, Header.SERVICE_US: str(service_us),
        Header.SERVER_TIME: str(now_ms()),
    }
    if node:
        headers[Header.NODE] = node
    if end.reason:
        headers[Header.REASON] = end.reason
    return msgspec.json.encode(end), headers


# -- reading (SDK, gateway, pulse) ------------------------------------------------------------
class StreamBroken(Exception):
    """A stream's messages came out of order (a gap or a repeat in `Plane-Stream-Seq`)."""


@dataclass(slots=True)
class StreamReader:
    """Follows one stream's messages: checks the sequence, keeps the start's headers and the
    final message. Feed it every message of the inbox with `feed`; it returns the message's
    kind; once `done`, nothing more is to be read."""

    start: Mapping[str, str] | None = None
    final_headers: Mapping[str, str] | None = None
    final_body: bytes = b""
    next_seq: int = 0
    done: bool = False
    texts: list[str] = field(default_factory=list)

    def feed(self, headers: Mapping[str, str] | None, body: bytes) -> Kind:
        if self.done:
            raise StreamBroken("a message after the stream's final message")
        h = headers or {}
        kind = kind_of(h)
        if kind is not Kind.FINAL:
            seq = _seq(h)
            if seq != self.next_seq:
                raise StreamBroken(f"stream message {seq} where {self.next_seq} was due")
            self.next_seq += 1
        if kind is Kind.START:
            self.start = h
        elif kind in (Kind.END, Kind.FINAL):
            self.done = True
            self.final_headers, self.final_body = h, body
        return kind

    @property
    def status(self) -> int:
        """The final status (0 while the stream runs)."""
        if self.final_headers is None:
            return 0
        try:
            return int(self.final_headers.get(Header.STATUS, "0"))
        except ValueError:
            return 0

    @property
    def end(self) -> StreamEnd | None:
        """The node's end body; None for any other final message (or while running)."""
        if self.final_headers is None or kind_of(self.final_headers) is not Kind.END:
            return None
        try:
            return _end_decoder.decode(self.final_body)
        except msgspec.DecodeError:
            return None

    @property
    def usage(self) -> Usage | None:
        end = self.end
        return end.usage if end is not None else None

    @property
    def cancel_subject(self) -> str | None:
        return (self.start or {}).get(Header.CANCEL_SUBJECT)


def _seq(h: Mapping[str, str]) -> int:
    try:
        return int(h.get(Header.STREAM_SEQ, "-1"))
    except ValueError:
        return -1
