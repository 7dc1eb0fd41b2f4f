"""Typed wire messages: every body that crosses a process boundary is one of these Structs.

Schema evolution (see docs/schema-evolution.md): fields are only ever added, with a default;
readers ignore fields they do not know (msgspec's default), so an old reader accepts a new
message. Decoders are built once, here, and reused.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

FEATURES = 32


class Status(enum.IntEnum):
    OK = 200
    BAD_REQUEST = 400
    TOO_LARGE = 413
    BUSY = 429
    UNAVAILABLE = 503
    DEADLINE = 504


class Reason(enum.StrEnum):
    BUSY = "busy"
    DEADLINE = "deadline"
    # Every slot's promises are taken (PROMISE_MAX_LINKS a slot, STANDING_LINKS while the
    # chain of promises does not drain): the plane is past the load it can promise anything
    # to, whatever the caller's deadline. Go elsewhere now.
    OVERLOADED = "overloaded"
    UNHEALTHY = "unhealthy"
    BAD_REQUEST = "bad-request"
    TOO_LARGE = "too-large"
    NO_CAPACITY = "no-capacity"
    TENANT_SHARE = "tenant-share"  # the tenant holds more than its fair share: others first
    TENANT_LIMIT = "tenant-limit"  # the tenant's own max_rate or max_slots


# 429s not worth another try at this plane: the caller's deadline cannot be met here, or the
# plane is overloaded past its promises. The SDK, pulse and the gateway's OpenAI route
# (`x-should-retry`) give up on these at once; any other 429 is retried after Retry-After-Ms.
FINAL_REFUSALS = frozenset({Reason.DEADLINE, Reason.OVERLOADED})


class Freshness(enum.StrEnum):
    FRESH = "fresh"
    WAITED = "waited"
    DEGRADED = "degraded"


# -- model bodies ------------------------------------------------------------------------
class RiskRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    features: Annotated[list[float], msgspec.Meta(min_length=FEATURES, max_length=FEATURES)]
    card: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None


class RiskReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    score: float
    freshness: str | None = None


# Ten seconds is far beyond any latency budget this plane serves; larger is a caller bug.
MAX_CALIBRATED_US = 10_000_000


class CalibratedRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    duration_us: Annotated[int, msgspec.Meta(ge=0, le=MAX_CALIBRATED_US)]


class CalibratedReply(msgspec.Struct, frozen=True, kw_only=True):
    duration_us: int


# tinylm's context: prompt bytes + max_tokens must fit (kernels.tinylm.TinyLMConfig.context;
# the node checks that its model has this context, so the router can refuse without torch).
TINYLM_CONTEXT = 256
TINYLM_MAX_PROMPT = TINYLM_CONTEXT - 1
TINYLM_DEFAULT_MAX_TOKENS = 16
TINYLM_MAX_TEMPERATURE = 2.0


class TinyLMRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A generation: `prompt` (UTF-8; its bytes are the model's tokens), up to `max_tokens`
    bytes out. Temperature 0 is greedy; a seed makes sampling repeatable; `top_p` below 1
    samples from the nucleus only (the likeliest tokens whose probabilities add up to it)."""

    prompt: Annotated[str, msgspec.Meta(max_length=TINYLM_MAX_PROMPT)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=TINYLM_CONTEXT - 1)] = (
        TINYLM_DEFAULT_MAX_TOKENS)
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=TINYLM_MAX_TEMPERATURE)] = 0.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0

    @property
    def prompt_bytes(self) -> bytes:
        return self.prompt.encode()


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What a generation used: tokens in and out, its time on the slot (µs, from fetch to
    its last token) and that time x the partition's SMs, in SM·ms (0 off a GPU)."""

    prompt_tokens: int
    completion_tokens: int
    slot_us: int = 0
    sm_ms: float = 0.0


class TinyLMReply(msgspec.Struct, frozen=True, kw_only=True):
    """A `tinylm` request's one reply when it did not ask to stream."""

    text: str
    finish_reason: str
    usage: Usage


class StreamFinish(enum.StrEnum):
    STOP = "stop"  # the model sampled its end token
    LENGTH = "length"  # max_tokens produced
    CANCELLED = "cancelled"  # the caller cancelled, or stopped reading
    DEADLINE = "deadline"  # the stream deadline passed (status 504)
    ERROR = "error"  # the slot failed mid-stream (status 503)


# A stream that ended so ran for less than it would have: how far it got is no measure of
# how far streams go (`DoneEvent.cut`).
CUT_SHORT = frozenset({StreamFinish.CANCELLED, StreamFinish.DEADLINE, StreamFinish.ERROR})


class StreamEnd(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The body of a stream's `end` message (JSON)."""

    finish_reason: str
    usage: Usage
    error: str | None = None
    reason: str | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: str
    reason: str


# -- control plane -----------------------------------------------------------------------
class SlotAdvert(msgspec.Struct, frozen=True, kw_only=True):
    k: int
    subject: str
    healthy: bool = True
    p50_us: int = 0
    p99_us: int = 0
    # The slot stream that holds `subject` (a cluster spreads slots over several); "" from a
    # node older than the field, whose slots are in the shared stream.
    stream: str = ""


class NodeAdvert(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    model: str
    backend: str
    slots: list[SlotAdvert]
    at_ms: int
    partition: str = "none"
    version: int = 1


class DoneEvent(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Published by a node when a slot frees. Array-like: it is on the hot path."""

    request_id: str
    node: str
    model: str
    k: int
    status: int
    service_us: int
    router: str = ""
    # The slot time the request itself asked for, which the routers subtract from its cycle
    # to learn the slot's overhead: its requested device work (a stream's: the device time it
    # took) plus its wait for inputs (the freshness guard's wait for a fresh value).
    work_us: int = 0
    sms: int = 0  # the slot's partition in SMs (0: not a GPU partition; metered as 1)
    # Streams only (0 otherwise): what the router learns its per-token rates from.
    prompt_tokens: int = 0
    tokens: int = 0  # produced
    prefill_us: int = 0
    decode_us: int = 0
    # The stream was ended before its own end (its caller cancelled or left, or its stream
    # deadline came): its tokens say how long it ran, not how far a stream goes.
    cut: bool = False


class PeerNote(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What a router tells the other routers (`plane.admission.<model>`, presence on
    `plane.admission._routers`), so that they keep one schedule between them. A tagged union
    (msgspec: the tag is the first array element), one struct per kind of note; times are
    wall-clock epoch ms (routers may be on different hosts). `instance` is the sending
    process: two routers with one id are a mistake to report."""

    router: str
    instance: str = ""


class _PromiseTerms(PeerNote, frozen=True):
    """A promise's first fields, in their wire order (before the note's `router`, `instance`)."""

    model: str
    ticket: str
    due_ms: int
    expires_ms: int
    service_us: int


class PromiseMade(_PromiseTerms, frozen=True, kw_only=True, tag="made"):
    """A promise (ticket) made: its slot time is booked by every router. `wake` (its holder's
    inbox, `Plane-Wake`) and `told_ms` (when it was told to come back: 0, at `due_ms`) let
    another router call the holder if the maker is gone. They trail the array, after
    `router` and `instance` (msgspec puts keyword-only fields last, a base's first: hence the
    base class), so a router that predates them reads the note without them, and a newer one
    reads an older note."""

    wake: str | None = None
    told_ms: int = 0


class PromiseGone(PeerNote, frozen=True, tag="gone"):
    """A promise kept elsewhere, replaced or lapsed: its slot time is free again."""

    model: str
    ticket: str


class _SlotTakenTerms(PeerNote, frozen=True):
    """A slot-taken note's first fields, in their wire order (before `router`, `instance`)."""

    model: str
    slot: str
    service_us: int
    p99_us: int
    ticket: str | None = None


class SlotTaken(_SlotTakenTerms, frozen=True, kw_only=True, tag="took"):
    """A slot taken: busy for about `service_us`, at most `p99_us`; by a kept promise's
    holder (`ticket`: that promise is gone too) or by a newcomer (no ticket). `request_id`
    (the request placed) trails the array, as `PromiseMade.wake` does: a peer that has heard
    its done-event already (short work ends before the note arrives) does not mark the slot
    busy again; a router that predates it reads the note without it."""

    request_id: str | None = None


class Presence(PeerNote, frozen=True, kw_only=True, tag="here"):
    """A router is there (every second), or asks whether a live router has its id. `models`,
    those it serves (`plane router --models`; None: every model), trails the array as
    `PromiseMade.wake` does (keyword-only): a router that predates it reads the presence
    without it, and one that has it reads an older presence as "every model"."""

    models: tuple[str, ...] | None = None


AdmissionNote = PromiseMade | PromiseGone | SlotTaken | Presence


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """Sent every heartbeat period and at once on any change: carries the node's adverts, so
    routers learn of a withdrawn slot within a millisecond (the KV advert is for discovery).

    A stopping node keeps sending them (`stopping`, no adverts) until its drain is over.
    `instance` tells processes with one node id apart (a restart, or a second process by
    mistake): the one started last (`started_ms`, then `instance`) speaks for the id."""

    node: str
    at_ms: int
    adverts: list[NodeAdvert]
    stopping: bool = False
    instance: str = ""  # random, per process; "" from a node older than the field
    started_ms: int = 0  # when that process started, wall clock epoch ms


class FaultCommand(msgspec.Struct, frozen=True, kw_only=True):
    """Fault injection for tests: make a slot hang, slow down, raise, or go back to normal."""

    k: int
    mode: str  # "hang" | "slow" | "raise" | "none"
    extra_us: int = 0


class _AdvisoryServer(msgspec.Struct):
    id: str = ""


class _AdvisoryClient(msgspec.Struct):
    id: int = 0
    acc: str = ""


class ClientDisconnect(msgspec.Struct):
    """nats-server's advisory that a connection closed (`$SYS.ACCOUNT.<acc>.DISCONNECT`,
    imported into the plane's account under `plane auth`): the part the plane reads."""

    server: _AdvisoryServer = msgspec.field(default_factory=_AdvisoryServer)
    client: _AdvisoryClient = msgspec.field(default_factory=_AdvisoryClient)


json_encoder = msgspec.json.Encoder()
msgpack_encoder = msgspec.msgpack.Encoder()
advert_decoder = msgspec.json.Decoder(NodeAdvert)
done_decoder = msgspec.msgpack.Decoder(DoneEvent)
done_batch_decoder = msgspec.msgpack.Decoder(list[DoneEvent])
admission_note_decoder = msgspec.msgpack.Decoder(AdmissionNote)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
fault_decoder = msgspec.json.Decoder(FaultCommand)
error_decoder = msgspec.json.Decoder(ErrorBody)
disconnect_decoder = msgspec.json.Decoder(ClientDisconnect)


def error_body(error: str, reason: Reason) -> bytes:
    return json_encoder.encode(ErrorBody(error=error, reason=reason.value))


def read_done(data: bytes, *, batch: bool) -> list[DoneEvent]:
    """The done-events in one message: a slot's one (`plane.done.<model>.<node>.<k>`), or a
    node's batch (`plane.done.<model>.<node>`, `Names.is_done_batch`). Raises
    `msgspec.DecodeError` for anything else."""
    return done_batch_decoder.decode(data) if batch else [done_decoder.decode(data)]
