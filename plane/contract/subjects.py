"""Every subject, stream, bucket, consumer and header name of the plane, built in one place.

Nothing else in the code base writes a subject literal: it asks a `Names` object (which
carries the configurable prefix) or reads a constant from `Header`. Model and node names are
validated tokens (`[A-Za-z0-9_-]+`), so a name can never inject a wildcard or an extra token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

ROUTER_QUEUE_GROUP = "plane-routers"
# nats-server's advisory that a connection of account `*` closed. Under `plane auth` the
# plane's account imports it from the system account: a node stops the streams of a tenant
# whose connection went (inside the plane's account the no-responders status does that).
CLIENT_DISCONNECTS = "$SYS.ACCOUNT.*.DISCONNECT"
# A cluster spreads its slots over at most this many streams (JetStream's largest replica
# count, and so its largest useful cluster for one stream's peers; `plane.contract.provision`).
MAX_SLOT_SHARDS = 5


class InvalidToken(ValueError):
    """A model, node or stream name that is not a plain subject token."""


# Keys of the topics' caught-up watermarks in the features bucket start with this (a card
# id has no dot: `Names.caught_up_key`).
CAUGHT_UP_KEY_PREFIX = "_caughtup."


def check_token(kind: str, value: str) -> str:
    """Return `value` if it is a valid subject token, else raise `InvalidToken` saying why."""
    if not TOKEN_RE.fullmatch(value):  # match() lets a trailing newline through ($)
        raise InvalidToken(
            f"invalid {kind} name {value!r}: use 1 to 64 characters from A-Z a-z 0-9 _ -"
        )
    return value


class Header:
    """NATS header names (the HTTP gateway maps them one to one)."""

    DEADLINE_MS = "Plane-Deadline-Ms"
    REQUEST_ID = "Plane-Request-Id"
    ATTEMPT = "Plane-Attempt"
    TICKET = "Plane-Ticket"
    STATUS = "Plane-Status"
    RETRY_AFTER_MS = "Retry-After-Ms"
    RETRY_AFTER = "Retry-After"
    SERVER_TIME = "Plane-Server-Time"
    REASON = "Plane-Reason"
    NODE = "Plane-Node"
    SLOT = "Plane-Slot"
    SERVICE_US = "Plane-Service-Us"
    FRESHNESS = "Plane-Freshness"
    # Reply: made up by the caller's SDK itself, not the plane (no answer in time, nobody
    # listening, the connection down, dropped or closed): why (`plane.client.result.
    # LocalCause`). The gateway passes it on, so that its HTTP callers (pulse) tell them apart.
    LOCAL = "Plane-Local"
    AVOID_NODE = "Plane-Avoid-Node"  # request: a node that just refused (503); go elsewhere
    # Request: an inbox of the caller's (`_INBOX.` and tokens) where the router says, with a
    # message carrying the ticket, that a promised slot freed before the ticket's Retry-After.
    WAKE = "Plane-Wake"
    # Request: how long (ms) a newcomer will wait at the router for its start rather than be
    # refused (a caller that does not retry a 429; docs/design.md, "Retry-After").
    WAIT_MS = "Plane-Wait-Ms"
    # Request: the tenant, as a trusted sender inside the plane's own account says (the HTTP
    # gateway, from its bearer tokens). A tenant's own requests arrive through a service
    # import, and then the server's `Nats-Request-Info` names its account instead.
    TENANT = "Plane-Tenant"
    NATS_REQUEST_INFO = "Nats-Request-Info"  # set by nats-server on a shared service import
    # Internal: router -> router, on a ticket holder's request forwarded to the router that
    # made the promise (never forwarded twice). With `Plane-Reply-To` (the caller's reply) and
    # `Plane-Forward-Until` (epoch ms: when the forwarder gives up), the maker takes the
    # request over: it answers an empty "taken" to the forwarder, then the caller directly.
    # `Plane-Forward-Held-Us`: how long the forwarder had it (the maker's deadline and the
    # holder's time of return count from the forwarder's receipt).
    FORWARDED_BY = "Plane-Forwarded-By"
    FORWARD_UNTIL = "Plane-Forward-Until"
    FORWARD_HELD_US = "Plane-Forward-Held-Us"
    CONTENT_TYPE = "Content-Type"
    # Internal: router -> node, on the slot message only.
    REPLY_TO = "Plane-Reply-To"
    DEADLINE_AT = "Plane-Deadline-At"
    ROUTER = "Plane-Router"
    WORK_US = "Plane-Work-Us"
    # Streams (docs/design.md "Streams"): on a request `1`; on stream messages start|token|end.
    STREAM = "Plane-Stream"
    STREAM_SEQ = "Plane-Stream-Seq"
    STREAM_DEADLINE_MS = "Plane-Stream-Deadline-Ms"  # request: budget for the whole stream
    STREAM_DEADLINE_AT = "Plane-Stream-Deadline-At"  # slot message: router wall clock, epoch ms
    CANCEL_SUBJECT = "Plane-Cancel-Subject"  # start message: where a cancel goes
    # Slot message of a stream sent across a tenant's import: the account it came from; only
    # a cancel from that account (or from inside the plane's own) may end it.
    CALLER_ACCOUNT = "Plane-Caller-Account"
    # ... and the caller's connection (`<server id>/<client id>`, from the server's
    # `Nats-Request-Info`): when that connection closes, the node stops the stream.
    CALLER_CLIENT = "Plane-Caller-Client"
    # Kafka bridge stamps on plane.events.* messages.
    EVENT_TIME = "Plane-Event-Time"
    INGEST_TIME = "Plane-Ingest-Time"
    KAFKA_KEY = "Plane-Kafka-Key"
    KAFKA_PARTITION = "Plane-Kafka-Partition"
    KAFKA_OFFSET = "Plane-Kafka-Offset"
    DEAD_REASON = "Plane-Dead-Reason"
    # W3C trace context, carried from the caller (HTTP gateway, a Kafka record) through the
    # router and the slot message to the node, and back on the reply.
    TRACEPARENT = "traceparent"
    TRACESTATE = "tracestate"
    # Set by nats-server on the status it sends to a reply subject when nobody listens on the
    # subject a message with that reply went to (`no_responders`): `Status: 503` and, on the
    # subject, `Nats-Subject`.
    NATS_STATUS = "Status"
    NATS_SUBJECT = "Nats-Subject"
    # NATS server headers we set.
    NATS_TTL = "Nats-TTL"
    NATS_MSG_ID = "Nats-Msg-Id"
    # The NATS services standard's error headers, on every error reply beside Plane-Status.
    NATS_SERVICE_ERROR = "Nats-Service-Error"
    NATS_SERVICE_ERROR_CODE = "Nats-Service-Error-Code"


MSGPACK = "application/msgpack"
TRACE_HEADERS = (Header.TRACEPARENT, Header.TRACESTATE)
TRACE_HEADER_MAX = 512  # W3C: traceparent is 55 characters, tracestate at most 512


@dataclass(frozen=True, slots=True)
class Names:
    """Builds every name from one prefix (default `plane`)."""

    prefix: str = "plane"

    def __post_init__(self) -> None:
        for part in self.prefix.split("."):
            check_token("prefix", part)

    # -- core subjects -------------------------------------------------------------------
    def infer(self, model: str) -> str:
        return f"{self.prefix}.infer.{check_token('model', model)}"

    def infer_all(self) -> str:
        """The routers' subscription: every token after `infer`, so bad names get a 400."""
        return f"{self.prefix}.infer.>"

    def infer_model_of(self, subject: str) -> str:
        """The raw model part of a request subject, shared or one router's own (validated by
        the caller)."""
        head = f"{self.prefix}.infer."
        if subject.startswith(head):
            return subject[len(head) :]
        return subject.split(".infer.", 1)[-1]

    def router_infer(self, router_id: str, model: str) -> str:
        """One router's own request subject: a ticket holder's retry that reached another
        router is forwarded here, to the router that made the promise."""
        return f"{self.prefix}.router.{router_id}.infer.{check_token('model', model)}"

    def router_infer_all(self, router_id: str) -> str:
        return f"{self.prefix}.router.{router_id}.infer.>"

    def slot(self, model: str, node: str, k: int) -> str:
        return f"{self.prefix}.slot.{model}.{node}.{int(k)}"

    def slots_all(self) -> str:
        return f"{self.prefix}.slot.>"

    def slots_numbered(self, k: int) -> str:
        """Slot k of every model and node (a shard of the slot streams lists these)."""
        return f"{self.prefix}.slot.*.*.{int(k)}"

    def node_slots(self, node: str) -> str:
        return f"{self.prefix}.slot.*.{node}.*"

    def done(self, model: str, node: str, k: int) -> str:
        return f"{self.prefix}.done.{model}.{node}.{int(k)}"

    def done_batch(self, model: str, node: str) -> str:
        """The done-events of several of a node's slots made in one turn of its event loop,
        as one message (a msgpack array of them: `plane.contract.messages.read_done`)."""
        return f"{self.prefix}.done.{model}.{node}"

    def is_done_batch(self, subject: str) -> bool:
        """Whether a subject under `done_all` is a node's `done_batch` (one token fewer than a
        slot's `done`)."""
        return subject.count(".") == self.prefix.count(".") + 3

    def done_all(self) -> str:
        return f"{self.prefix}.done.>"

    def done_model(self, model: str) -> str:
        """One model's done-events (a router that serves some models only)."""
        return f"{self.prefix}.done.{check_token('model', model)}.>"

    def admission(self, model: str) -> str:
        """Where routers tell each other the promises they make and drop, and the slots they
        take."""
        return f"{self.prefix}.admission.{check_token('model', model)}"

    def admission_all(self) -> str:
        return f"{self.prefix}.admission.>"

    def health(self, node: str) -> str:
        return f"{self.prefix}.health.{node}"

    def health_all(self) -> str:
        return f"{self.prefix}.health.*"

    def events(self, stream: str) -> str:
        return f"{self.prefix}.events.{check_token('stream', stream)}"

    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    def dead_letter(self, stream: str) -> str:
        return f"{self.prefix}.dead.{check_token('stream', stream)}"

    def scored(self, stream: str) -> str:
        return f"{self.prefix}.scored.{check_token('stream', stream)}"

    def router_status(self, router_id: str) -> str:
        return f"{self.prefix}.router.{router_id}.status"

    def router_meter(self, router_id: str) -> str:
        """One router's metering: per tenant and model, what it placed and what came of it."""
        return f"{self.prefix}.router.{router_id}.meter"

    def node_status(self, node: str) -> str:
        return f"{self.prefix}.node.{node}.status"

    def node_answered(self, node: str) -> str:
        """Router asks a node "did you answer request X?" before taking over its deadline."""
        return f"{self.prefix}.node.{node}.answered"

    def router_answered(self, router_id: str) -> str:
        """A node asks the router that placed a message it took after the deadline "did you
        answer that attempt without the broker's word?" (`plane.contract.ownership`)."""
        return f"{self.prefix}.router.{router_id}.answered"

    def cancel(self, node: str, k: int) -> str:
        """Where a caller cancels the stream slot k of `node` runs (the message names it by
        `Plane-Request-Id`)."""
        return f"{self.prefix}.cancel.{node}.{int(k)}"

    def node_cancels(self, node: str) -> str:
        """A node's one subscription for the cancels of all its slots."""
        return f"{self.prefix}.cancel.{node}.*"

    def cancel_all(self) -> str:
        """What the plane exports to tenants beside `infer_all`."""
        return f"{self.prefix}.cancel.>"

    def fault(self, node: str) -> str:
        """Fault-injection control subject of a node (tests and drills only)."""
        return f"{self.prefix}.fault.{node}"

    # -- streams, buckets, consumers -----------------------------------------------------
    @property
    def slots_stream(self) -> str:
        return f"{self._upper}_SLOTS"

    def slot_shard_stream(self, i: int) -> str:
        """Shard `i` of the slot streams a cluster spreads its slots over
        (`plane.contract.provision`: slot k lives in shard k mod shards)."""
        return f"{self._upper}_SLOTS_{int(i)}"

    def slot_streams(self) -> tuple[str, ...]:
        """Every name a slot stream may have: the shared one and each possible shard (what
        the roles allow, and what a router accepts from a node's advert)."""
        return (self.slots_stream,
                *(self.slot_shard_stream(i) for i in range(MAX_SLOT_SHARDS)))

    @property
    def events_stream(self) -> str:
        return f"{self._upper}_EVENTS"

    @property
    def nodes_bucket(self) -> str:
        return f"{self._upper}_NODES"

    @property
    def config_bucket(self) -> str:
        return f"{self._upper}_CONFIG"

    @property
    def features_bucket(self) -> str:
        return f"{self._upper}_FEATURES"

    def slot_consumer(self, model: str, node: str, k: int) -> str:
        return f"slot_{model}_{node}_{int(k)}"

    @property
    def router_service(self) -> str:
        return f"{self.prefix.replace('.', '-')}-router"

    @property
    def node_service(self) -> str:
        return f"{self.prefix.replace('.', '-')}-node"

    @property
    def _upper(self) -> str:
        return self.prefix.replace(".", "_").replace("-", "_").upper()

    # -- freshness: Kafka bridge, feature updater, risk pipeline (freshness/) ---------------
    def dead_letter_all(self) -> str:
        return f"{self.prefix}.dead.>"

    def scored_all(self) -> str:
        return f"{self.prefix}.scored.>"

    def caught_up(self, stream: str) -> str:
        """Core subject: a bridge's word that it has bridged everything Kafka held, as of a
        time, for the partitions of a topic it holds (`freshness.watermark`)."""
        return f"{self.prefix}.caughtup.{check_token('stream', stream)}"

    def caught_up_all(self) -> str:
        return f"{self.prefix}.caughtup.>"

    def caught_up_key(self, stream: str) -> str:
        """Key in the features bucket of a topic's caught-up watermark (the feature
        updater's; a card id never has a dot, so no card can take it)."""
        return f"{CAUGHT_UP_KEY_PREFIX}{check_token('stream', stream)}"

    def features_consumer(self, stream: str) -> str:
        """Durable JetStream consumer of the feature updater on `events(stream)`."""
        return f"features_{check_token('stream', stream)}"

    def scorer_consumer(self, stream: str) -> str:
        """Durable JetStream consumer of the risk-demo scorer on `events(stream)`."""
        return f"scorer_{check_token('stream', stream)}"


def advert_key(node: str, model: str) -> str:
    """Key of a node's advert for one model in the nodes bucket."""
    return f"{node}.{model}"


def config_key(setting: str, scope: str | None = None) -> str:
    """Key of a live setting in the config bucket: `deadline_ms.risk`, `freshness_ms`, ..."""
    return setting if scope is None else f"{setting}.{scope}"
