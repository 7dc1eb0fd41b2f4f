"""`plane router` and `plane status`: the work of the commands that do not compute, apart
from their parsing in `plane.cli`, and `ServeSpec`, what every serving command is given.

Nothing here imports the node (and with it torch and triton): these commands start in a
fraction of a second. The commands that compute (`plane up`, `plane node`) are in `plane.up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import nats

from plane.config import ConnectOptions, RouterConfig
from plane.lifecycle import stop_event, until_any
from plane.metrics import PlaneMetrics, serve_metrics
from plane.natsconn import close, connect
from plane.router import Router
from plane.subjects import Names

# A serving command whose NATS connection was closed for good exits with this, so that its
# supervisor (systemd, Kubernetes, compose) restarts it.
EXIT_LOST = 3


@dataclass(frozen=True)
class ServeSpec:
    connect: ConnectOptions
    metrics_port: int | None
    metrics_host: str = "127.0.0.1"
    replicas: int = 1


async def run_router(spec: ServeSpec, cfg: RouterConfig) -> int:
    metrics = PlaneMetrics()
    nc = await connect(spec.connect)
    try:
        with serve_metrics(metrics, spec.metrics_port, spec.metrics_host):
            stop = stop_event()
            async with Router(nc, cfg, metrics, replicas=spec.replicas) as router:
                await until_any(stop, router.lost)
                if router.lost.is_set():
                    return EXIT_LOST
    finally:
        await close(nc)  # drains; closes when the server is gone
    return 0


async def run_status(opts: ConnectOptions, names: Names, timeout_s: float = 1.0) -> int:
    """Exit 0 when at least one router and one node answer `$SRV.PING`, else 1."""
    nc = await connect(opts)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.PING", b"", reply=inbox)
        seen: dict[str, int] = {}
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            async with asyncio.timeout(timeout_s):
                while True:
                    m = await sub.next_msg(timeout=timeout_s)
                    if not m.data:  # the server's "no responders": nobody serves
                        break
                    svc = json.loads(m.data).get("name", "?")
                    seen[svc] = seen.get(svc, 0) + 1
        print(json.dumps(seen))
        healthy = seen.get(names.router_service, 0) > 0 and seen.get(names.node_service, 0) > 0
        return 0 if healthy else 1
    finally:
        await nc.close()
