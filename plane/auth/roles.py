"""Who may do what on the plane's NATS server: the publish and subscribe allow lists of each
role, built from the plane's names (`plane.contract.subjects.Names`), so a configured prefix changes
them with everything else. Pure: no I/O; `plane.auth.conf` renders them into nats.conf.

Read from the code (router, node, freshness, gateway) and checked on a real server: the
plane's own tests run every role with exactly these lists and find no permission violation
in the server's log (`tests/test_auth.py`). `docs/design.md` ("Roles and permissions") is
the table in words. What the lists rest on:

- A request's answer goes to its caller's reply subject: `_INBOX.<...>` for a caller inside
  the plane's account, `_R_.<...>` for a tenant's request that came through the service
  import (nats-server's mapped reply). The node answers what it ran straight to it (the
  `Plane-Reply-To` of the slot message, not a reply to anything the node received), so
  `allow_responses` would not do: both prefixes are allowed explicitly, to router and node.
- JetStream is a request API: `$JS.API.<verb>.<stream>[.<consumer>[.<filter>]]`, each verb
  allowed on the plane's named streams only (`KV_<bucket>` is a bucket's stream). A KV
  write is a publish on `$KV.<bucket>.<key>`; a KV watch is an ordered push consumer whose
  flow-control replies go to `$JS.FC.<stream>.>`; a pull consumer acks on
  `$JS.ACK.<stream>.>`. Replies and deliveries come to the client's `_INBOX.>`.
- Routers and nodes are NATS micro services: they subscribe `$SRV.PING|INFO|STATS[...]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.micro.service import ServiceVerb, control_subject

from plane.contract.subjects import CLIENT_DISCONNECTS, Names

ROLES = ("router", "node", "bridge", "gateway", "admin")
INBOX = "_INBOX.>"
SERVICE_REPLIES = "_R_.>"  # replies to requests that came through a service import
MICRO = "$SRV.>"


@dataclass(frozen=True, slots=True)
class Permissions:
    """Subjects a user may publish to and subscribe to (NATS wildcards)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _api(verb: str, *streams: str) -> list[str]:
    """A JetStream API verb on `streams`: the exact subject (a stream verb, or an ordered
    consumer's create) and everything under it (a named consumer, a filter)."""
    out = []
    for stream in streams:
        out += [f"$JS.API.{verb}.{stream}", f"$JS.API.{verb}.{stream}.>"]
    return out


def _provision(n: Names) -> list[str]:
    """What `plane.contract.provision.ensure_all` asks: every router and node provisions at
    start."""
    kv_nodes, kv_config = _kv_stream(n.nodes_bucket), _kv_stream(n.config_bucket)
    return [f"$JS.API.STREAM.{verb}.{slots}" for slots in n.slot_streams()
            for verb in ("CREATE", "INFO", "UPDATE")] + [
        f"$JS.API.STREAM.{verb}.{stream}"
        for stream in (kv_nodes, kv_config) for verb in ("CREATE", "INFO")]


def _watch(*buckets: str) -> list[str]:
    """A KV watch (ordered consumer) or `keys()` on `buckets`."""
    streams = [_kv_stream(b) for b in buckets]
    return (_api("CONSUMER.CREATE", *streams) + _api("CONSUMER.INFO", *streams)
            + [f"$JS.FC.{s}.>" for s in streams])


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _take(n: Names) -> list[str]:
    """Read and take (delete) a slot message: `plane.contract.ownership.take`, sweeps, watchdog."""
    return [f"$JS.API.STREAM.MSG.{verb}.{slots}" for slots in n.slot_streams()
            for verb in ("GET", "DELETE")]


def router(n: Names) -> Permissions:
    p = n.prefix
    return Permissions(
        publish=(
            n.slots_all(),  # placements (JetStream publishes; the PubAck comes to the inbox)
            n.admission_all(),  # promises, taken slots, presence notes to the other routers
            f"{p}.router.>",  # forwards to (and probes of) the promise maker; the id check
            f"{p}.node.*.answered",  # "did you answer it?" before the watchdog answers
            INBOX, SERVICE_REPLIES,  # answers: refusals, and 503/504 for a silent node
            # Its container's health check, `plane status --router <id>`: find the plane's
            # routers and nodes by their services' names and ask each for its status (reads
            # only; its own status is under `P.router.>`). Bare `$SRV.INFO`, which `.>` does
            # not match, was what `plane status` asked: the check could never pass.
            *[control_subject(ServiceVerb.INFO, s) for s in (n.router_service, n.node_service)],
            f"{p}.node.*.status",
            *_provision(n), *_take(n), *_watch(n.config_bucket, n.nodes_bucket),
            # keeps a cluster's slot leaders apart (`plane.contract.slot_leaders`)
            *[f"$JS.API.STREAM.LEADER.STEPDOWN.{s}" for s in n.slot_streams()],
            *[f"$JS.API.CONSUMER.LIST.{s}" for s in n.slot_streams()],
            *[f"$JS.API.CONSUMER.LEADER.STEPDOWN.{s}.>" for s in n.slot_streams()],
        ),
        subscribe=(
            n.infer_all(),  # the queue group plane-routers
            f"{p}.router.>",  # its own request subject, status and meter endpoints
            n.health_all(), n.done_all(), n.admission_all(), MICRO, INBOX,
        ),
    )


def node(n: Names) -> Permissions:
    p = n.prefix
    slots = n.slot_streams()
    features = _kv_stream(n.features_bucket)
    return Permissions(
        publish=(
            n.health_all(),  # heartbeats
            n.done_all(),  # done-events
            f"{p}.node.*.status",  # the id check before claiming
            f"{p}.router.*.answered",  # did the router answer what we took late?
            INBOX, SERVICE_REPLIES,  # answers to callers, micro and `answered` replies
            f"$KV.{n.nodes_bucket}.>",  # adverts
            *_provision(n), *_take(n),
            "$JS.API.STREAM.NAMES",  # which slot stream holds a slot (at each claim)
            *_api("CONSUMER.CREATE", *slots), *_api("CONSUMER.DURABLE.CREATE", *slots),
            *_api("CONSUMER.DELETE", *slots), *_api("CONSUMER.INFO", *slots),
            *_api("CONSUMER.MSG.NEXT", *slots), *[f"$JS.ACK.{s}.>" for s in slots],
            # the freshness guard on risk nodes: reads (watches) the features bucket
            f"$JS.API.STREAM.CREATE.{features}", f"$JS.API.STREAM.INFO.{features}",
            *_watch(n.config_bucket, n.features_bucket),
        ),
        subscribe=(
            n.health_all(),  # its own id's heartbeats (another process with its id)
            f"{p}.node.>",  # status and `answered` endpoints
            f"{p}.fault.>",  # fault injection: only nodes started with --allow-faults listen
            n.cancel_all(),  # its streams' cancels (`P.cancel.<node>.*`: nodes share a role)
            CLIENT_DISCONNECTS,  # a tenant's connection closed: its streams stop
            MICRO, INBOX,
        ),
    )


def bridge(n: Names) -> Permissions:
    """`plane bridge` (Kafka into JetStream) and the feature updater it feeds."""
    events = n.events_stream
    features = _kv_stream(n.features_bucket)
    return Permissions(
        publish=(
            n.events_all(), n.dead_letter_all(),  # JetStream publishes into PLANE_EVENTS
            *[f"$JS.API.STREAM.{verb}.{events}" for verb in ("CREATE", "INFO", "UPDATE")],
            *_api("CONSUMER.CREATE", events), *_api("CONSUMER.DURABLE.CREATE", events),
            *_api("CONSUMER.INFO", events), *_api("CONSUMER.MSG.NEXT", events),
            f"$JS.ACK.{events}.>",
            f"$JS.API.STREAM.CREATE.{features}", f"$JS.API.STREAM.INFO.{features}",
            f"$JS.API.STREAM.MSG.GET.{features}", *_api("DIRECT.GET", features),
            f"$KV.{n.features_bucket}.>",
            n.caught_up_all(),  # the bridge's caught-up watermarks, to the updater
            INBOX,
        ),
        subscribe=(n.caught_up_all(), INBOX),
    )


def gateway(n: Names) -> Permissions:
    """The HTTP gateway: requests (naming the tenant of its bearer token), the cancel of a
    stream whose HTTP client went away, and readiness."""
    return Permissions(publish=(n.infer_all(), n.cancel_all(), f"$SRV.PING.{n.router_service}",
                                INBOX),
                       subscribe=(INBOX,))


def admin(n: Names) -> Permissions:
    """Operators: `plane status`, `pulse`, live settings, fault drills, stream management."""
    return Permissions(publish=(">",), subscribe=(">",))


def tenant(n: Names) -> Permissions:
    """A tenant's users, in its own account: the imported inference services and the
    streams' cancel, nothing else (the account has no JetStream and imports nothing else,
    so even an allowed subject would reach no one but itself)."""
    return Permissions(publish=(n.infer_all(), n.cancel_all()), subscribe=(INBOX,))


def role_permissions(n: Names) -> dict[str, Permissions]:
    return {"router": router(n), "node": node(n), "bridge": bridge(n), "gateway": gateway(n),
            "admin": admin(n)}
