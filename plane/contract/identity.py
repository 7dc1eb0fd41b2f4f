"""Process identity: every node and router process has a random instance token, so that a
restart (or, by mistake, a second process) under one id is told apart from the first.

- `Instances`: a router's record of which process speaks for each node id. The one started
  last does: a restart replaces its predecessor (whose requests in flight the router then
  treats as a dead node's), and an older process still talking speaks for nothing.
- `ensure_node_id_free`: a node, before it claims anything, makes sure no other process
  serves its id; a router does the same with its peers (`plane.router.peers.Peers.ensure_id_free`).
- `RequestIds`: ids for requests that come without one (a router's, the SDK's, pulse's).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import secrets
import uuid
from dataclasses import dataclass

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from plane.contract.errors import IdentityInUse
from plane.contract.messages import Heartbeat, heartbeat_decoder
from plane.contract.subjects import Names

log = structlog.get_logger("plane.contract.identity")


def new_instance() -> str:
    return uuid.uuid4().hex[:12]


class RequestIds:
    """Request ids for the requests that come without one: a random prefix drawn once and a
    count, unique to the process's life. A NUID or a `uuid4` per request reads the OS's random
    source or runs a base-62 loop each time: ~1.5% of a router's CPU, ~10% of an SDK call's
    (docs/perf)."""

    def __init__(self, prefix: str | None = None) -> None:
        self._prefix = prefix or secrets.token_hex(10)
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count)}"


class Heard(enum.Enum):
    SAME = "same"  # the process we know for the id (or the first we hear)
    NEWER = "newer"  # one started after it: it replaces it
    OLDER = "older"  # one the id's current process replaced: it speaks for nothing


@dataclass(frozen=True, slots=True)
class Instance:
    token: str
    started_ms: int

    def rank(self) -> tuple[int, str]:
        return self.started_ms, self.token


class Instances:
    """Which process speaks for each node id. Pure bookkeeping: the router decides what a
    replacement means for the requests in flight."""

    def __init__(self) -> None:
        self._by_node: dict[str, Instance] = {}

    def compare(self, node: str, token: str, started_ms: int) -> Heard:
        known = self._by_node.get(node)
        if known is None or known.token == token:
            return Heard.SAME
        return Heard.NEWER if (started_ms, token) > known.rank() else Heard.OLDER

    def adopt(self, node: str, token: str, started_ms: int) -> None:
        self._by_node[node] = Instance(token, started_ms)

    def forget(self, node: str) -> None:
        self._by_node.pop(node, None)

    def token(self, node: str) -> str:
        """The instance token of the process that speaks for `node` ("": none heard)."""
        known = self._by_node.get(node)
        return known.token if known is not None else ""


async def answers(nc: Client, subject: str, timeout_s: float, data: bytes = b"") -> bool:
    """Whether anyone answers a request on `subject` within `timeout_s` (no responders: at
    once). A subscriber that does not answer in time counts as absent: a stalled process."""
    try:
        await nc.request(subject, data, timeout=timeout_s)
    except (NoRespondersError, NatsTimeoutError, TimeoutError):
        return False
    return True


async def ensure_node_id_free(nc: Client, names: Names, node: str, *, period_s: float,
                              stopping_wait_s: float) -> None:
    """Raise `IdentityInUse` if another live process serves node id `node`; wait, up to
    `stopping_wait_s`, for one that is stopping (a rolling restart) to go.

    Whoever serves the id answers its status endpoint: no responder (the usual case: at
    once), or none within two heartbeat periods (a stalled process, which routers give up
    too), means the id is free. When one answers, its heartbeats say whether it is stopping.
    """
    heard: asyncio.Queue[Heartbeat] = asyncio.Queue()

    async def on_heartbeat(msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            hb = heartbeat_decoder.decode(msg.data)
            if hb.node == node:
                heard.put_nowait(hb)

    status = names.node_status(node)
    sub = await nc.subscribe(names.health(node), cb=on_heartbeat)
    try:
        if not await answers(nc, status, 2 * period_s):
            return
        try:
            async with asyncio.timeout(3 * period_s):
                _refuse_if_live(node, await heard.get())
        except TimeoutError:
            return  # it answers but sends no heartbeat: the last moment of a stop
        log.warning("another process with this node id is stopping: waiting for it to go",
                    node=node, up_to_s=stopping_wait_s)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + stopping_wait_s
        while await answers(nc, status, 2 * period_s):
            while not heard.empty():  # a live one besides the one stopping?
                _refuse_if_live(node, heard.get_nowait())
            if loop.time() >= give_up:
                raise IdentityInUse(
                    f"node id {node!r}: the node stopping under this id is still there after "
                    f"{stopping_wait_s:.0f} s: wait for it to go, or use another --node-id",
                    kind="node", ident=node)
            await asyncio.sleep(period_s)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def _refuse_if_live(node: str, hb: Heartbeat) -> None:
    if not hb.stopping:
        model = hb.adverts[0].model if hb.adverts else "unknown"
        raise IdentityInUse(
            f"node id {node!r} is in use by another running node (model {model}): give this "
            "node another --node-id, or stop the other one first", kind="node", ident=node)
