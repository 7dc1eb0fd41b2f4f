"""Where a cluster's slot streams and slot consumers are led from (`plane.contract.provision`
spreads the slots over one stream per replica).

A slot serves while both its stream and its consumer have a leader. JetStream elects each on
its own, anywhere among the stream's servers, so a dead server stopped the slots of the
streams it led and of the consumers it led: about 5 in 9 of them on three servers, and every
slot when all three streams happened to be led from it. `keep_apart` moves leaders (a
step-down with a preferred server, nats-server 2.11+) so that a dead server stops only the
slots of the one stream it led, a third:

- no server leads two slot streams while a live one of their peers leads none;
- every slot consumer is led from where its stream is.

A router in a cluster runs it now and then (`plane.router.service`), for leaders that moved
together in a failover. Best effort: a step-down that fails leaves the leader where it is,
which is where it would have been anyway (a moved consumer's standing pull hears "409
Leadership Change" and asks again at once). On a single server it does nothing.
"""

from __future__ import annotations

import json
from collections import Counter

import structlog
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import Error as JsError

from plane.contract.provision import slot_stream_infos
from plane.contract.subjects import Names

log = structlog.get_logger("plane.contract.slot_leaders")

API = "$JS.API"
STEPDOWN_TIMEOUT_S = 2.0


async def keep_apart(nc: Client, js: JetStreamContext, names: Names) -> int:
    """Spread the slot streams' leaders, then lead each consumer from its stream's; how many
    step-downs were asked."""
    led: dict[str, str] = {}  # stream -> its leader
    peers: dict[str, set[str]] = {}  # stream -> the servers that may lead it: live, current
    for name, info in await slot_stream_infos(js, names):
        cluster = None if isinstance(info, Exception) else info.cluster
        if cluster is None or not cluster.leader:
            continue  # a single server, or electing: next time
        led[name] = cluster.leader
        peers[name] = {cluster.leader} | {p.name for p in cluster.replicas or []
                                          if p.name and p.current and not p.offline}
    moved = await _spread(nc, led, peers) if len(led) > 1 else 0
    for stream, leader in led.items():
        try:
            consumers = await js.consumers_info(stream)
        except (JsError, NatsError, TimeoutError):
            continue
        for c in consumers:
            if c.cluster is not None and c.cluster.leader and c.cluster.leader != leader:
                moved += await _step_down(
                    nc, f"{API}.CONSUMER.LEADER.STEPDOWN.{stream}.{c.name}", leader)
    return moved


async def _spread(nc: Client, led: dict[str, str], peers: dict[str, set[str]]) -> int:
    """Move stream leaders off servers that lead two to a peer of theirs that leads none;
    updates `led`."""
    leads = Counter({server: 0 for server in set().union(*peers.values())})
    leads.update(led.values())
    moved = 0
    for name, leader in list(led.items()):
        idle = sorted(s for s in peers[name] if leads[s] == 0)
        if leads[leader] < 2 or not idle:
            continue
        if await _step_down(nc, f"{API}.STREAM.LEADER.STEPDOWN.{name}", idle[0]):
            leads[leader] -= 1
            leads[idle[0]] += 1
            led[name] = idle[0]  # its consumers follow it there
            moved += 1
    if moved:
        log.info("slot stream leaders spread", moved=moved, leads=dict(leads))
    return moved


async def _step_down(nc: Client, subject: str, to: str) -> int:
    body = json.dumps({"placement": {"preferred": to}}).encode()
    try:
        reply = await nc.request(subject, body, timeout=STEPDOWN_TIMEOUT_S)
    except (NatsError, TimeoutError) as exc:
        log.info("leader step-down not answered", subject=subject, to=to, error=repr(exc))
        return 0
    answer = json.loads(reply.data or b"{}")
    if answer.get("error"):
        log.info("leader step-down refused", subject=subject, to=to, error=answer["error"])
        return 0
    return 1
