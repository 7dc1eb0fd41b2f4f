"""What the bridge carries: the record schema it validates, the stamps it adds as headers,
and the per-card feature value the updater keeps in KV.

Schema evolution: fields are only added, with defaults; unknown fields are ignored, so an old
reader accepts a new record. Decoders are built once, here.
"""

from __future__ import annotations

import base64
import contextlib
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

from plane.contract.messages import FEATURES
from plane.contract.subjects import TRACE_HEADER_MAX, TRACE_HEADERS, Header

# A card id is a KV key and may appear in a subject: a plain token.
CardId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


# An amount's bound, either sign: far past any currency's, near enough that a card's sum of
# them stays finite (two amounts of 1.7e308 summed to inf, which JSON writes as null: the
# card's features were dropped by the guard, and the updater could not read them back).
MAX_AMOUNT = 1e15


class Transaction(msgspec.Struct, frozen=True, kw_only=True):
    """A Kafka record of the transactions topic (JSON). `features` are the transaction's own
    numbers (up to 32); the card's history is added by the feature guard."""

    card: CardId
    amount: Annotated[float, msgspec.Meta(ge=-MAX_AMOUNT, le=MAX_AMOUNT)]
    merchant: str = ""
    features: Annotated[list[float], msgspec.Meta(max_length=FEATURES)] = []


class CardFeatures(msgspec.Struct, frozen=True, kw_only=True):
    """Value of key `<card>` in the features bucket. The stamps are those of the newest
    arrival (by ingest time), so that the value shows the pipeline's current lag;
    `last_event_time_ms` is the newest event time seen; `seq` is the events-stream sequence
    last applied (redeliveries at or below it are skipped)."""

    card: str
    values: list[float]
    event_time_ms: int
    ingest_time_ms: int
    count: int = 0
    amount_sum: float = 0.0
    amount_max: float = 0.0
    last_amount: float = 0.0
    seq: int = 0
    last_event_time_ms: int = 0

    @property
    def lag_ms(self) -> float:
        return float(self.ingest_time_ms - self.event_time_ms)


class Stamps(msgspec.Struct, frozen=True, kw_only=True):
    """The bridge's stamps on a `<prefix>.events.<topic>` message (NATS headers)."""

    event_time_ms: int
    ingest_time_ms: int
    partition: int
    offset: int
    key: bytes | None = None

    def headers(self, msg_id: str) -> dict[str, str]:
        h = {
            Header.EVENT_TIME: str(self.event_time_ms),
            Header.INGEST_TIME: str(self.ingest_time_ms),
            Header.KAFKA_PARTITION: str(self.partition),
            Header.KAFKA_OFFSET: str(self.offset),
            Header.NATS_MSG_ID: msg_id,
        }
        if self.key is not None:
            h[Header.KAFKA_KEY] = encode_bytes(self.key)
        return h

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None) -> Stamps:
        """Raises `ValueError` when a stamp is missing or malformed."""
        if not headers:
            raise ValueError("message has no bridge stamps (no headers)")
        try:
            key = headers.get(Header.KAFKA_KEY)
            return cls(
                event_time_ms=int(headers[Header.EVENT_TIME]),
                ingest_time_ms=int(headers[Header.INGEST_TIME]),
                partition=int(headers[Header.KAFKA_PARTITION]),
                offset=int(headers[Header.KAFKA_OFFSET]),
                key=decode_bytes(key) if key is not None else None,
            )
        except KeyError as exc:
            raise ValueError(f"bridge stamp {exc.args[0]} missing") from exc

    @property
    def lag_ms(self) -> int:
        return self.ingest_time_ms - self.event_time_ms


_B64 = "b64:"


def encode_bytes(raw: bytes) -> str:
    """Kafka bytes (a key, a header value) as a NATS header value: UTF-8 text as is; anything
    a header cannot carry exactly (not UTF-8, not printable, white space at either end,
    which NATS trims, or text that starts with `b64:`) as `b64:` + base64."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return _B64 + base64.b64encode(raw).decode()
    if text.startswith(_B64) or not text.isprintable() or text != text.strip():
        return _B64 + base64.b64encode(raw).decode()
    return text


def decode_bytes(value: str) -> bytes:
    if value.startswith(_B64):
        return base64.b64decode(value[len(_B64):])
    return value.encode()


# -- Kafka record headers on the JetStream message ----------------------------------------
# Kafka header `<name>` travels as NATS header `Plane-Kafka-Header-<name>`; its value as
# `encode_bytes` writes it (a null value as an empty one). A name byte that a NATS header
# name cannot hold (anything but A-Z a-z 0-9 ! # $ & ' * + - . ^ _ ` | ~) is written `%XX`,
# as are `%` itself. Kafka allows one name several times: the last value is carried (Java's
# `Headers.lastHeader`).
KAFKA_HEADER_PREFIX = "Plane-Kafka-Header-"
_NAME_SAFE = frozenset(b"!#$&'*+-.^_`|~0123456789"
                       b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def kafka_header_name(name: str) -> str:
    """The NATS header that carries Kafka header `name`."""
    raw = name.encode()
    if all(b in _NAME_SAFE for b in raw):
        return KAFKA_HEADER_PREFIX + name
    return KAFKA_HEADER_PREFIX + "".join(
        chr(b) if b in _NAME_SAFE else f"%{b:02X}" for b in raw)


def kafka_header_of(nats_name: str) -> str | None:
    """The Kafka header name a NATS header carries, or None when it carries none."""
    if not nats_name.startswith(KAFKA_HEADER_PREFIX):
        return None
    return urllib.parse.unquote(nats_name[len(KAFKA_HEADER_PREFIX):], errors="strict")


def carry_kafka_headers(
    into: dict[str, str], headers: Sequence[tuple[str, bytes | None]] | None
) -> None:
    """Add a record's Kafka headers to the NATS headers `into`. A W3C trace context
    (`traceparent`, `tracestate`: what OpenTelemetry's Kafka instrumentation writes) is also
    set under its own name, so the trace goes on to whoever reads the message."""
    if not headers:
        return
    for name, value in headers:
        into[kafka_header_name(name)] = encode_bytes(value) if value else ""
        if name in TRACE_HEADERS and value and len(value) <= TRACE_HEADER_MAX:
            with contextlib.suppress(UnicodeDecodeError):
                text = value.decode("ascii")
                if text.isprintable():
                    into[name] = text


def kafka_headers(headers: Mapping[str, str] | None) -> dict[str, bytes]:
    """The Kafka headers a bridged message carries (what a consumer of the stream reads)."""
    out: dict[str, bytes] = {}
    for nats_name, value in (headers or {}).items():
        name = kafka_header_of(nats_name)
        if name is not None:
            out[name] = decode_bytes(value)
    return out


def msg_id(topic: str, partition: int, offset: int, timestamp_ms: int) -> str:
    """Nats-Msg-Id of a record: `topic:partition:offset:timestamp_ms`.

    topic:partition:offset names a record for the life of a topic; the timestamp tells apart
    two incarnations of a topic (deleted and created again, or a memory broker restarted),
    whose offsets start again at 0 and would otherwise be dropped as duplicates.
    """
    return f"{topic}:{partition}:{offset}:{timestamp_ms}"


transaction_decoder = msgspec.json.Decoder(Transaction)
features_decoder = msgspec.json.Decoder(CardFeatures)
json_encoder = msgspec.json.Encoder()
