"""`plane router` and `plane status`: the work of the commands that do not compute, apart
from their parsing in `plane.cli`, and `ServeSpec`, what every serving command is given.

Nothing here imports the node (and with it torch and triton): these commands start in a
fraction of a second. The commands that compute (`plane up`, `plane node`) are in `plane.up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from plane.contract.config import ConnectOptions, RouterConfig
from plane.contract.errors import Unavailable
from plane.contract.lifecycle import stop_event, until_any
from plane.contract.metrics import PlaneMetrics, serve_metrics
from plane.contract.natsconn import close, connect
from plane.contract.subjects import Names
from plane.contract.tracing import Tracing
from plane.router import Router, router_connection


@dataclass(frozen=True)
class Gone:
    """What died with the process that started a router (`run_router`'s `gone_at_stop`)."""

    nodes: Sequence[str]  # dead: what was placed on them is answered at once
    why: str
    # The server too (`plane up`'s own): nothing sent now reaches anyone, and a request
    # to it is never answered: the stop waits for nothing.
    server: bool = False


# How long a router whose server is gone waits, at its stop, for what it has in hand.
SERVER_GONE_STOP_S = 0.2

# A serving command whose NATS connection was closed for good exits with this, so that its
# supervisor (systemd, Kubernetes, compose) restarts it.
EXIT_LOST = 3


@dataclass(frozen=True)
class ServeSpec:
    connect: ConnectOptions
    metrics_port: int | None
    metrics_host: str = "127.0.0.1"
    replicas: int = 1


async def run_router(spec: ServeSpec, cfg: RouterConfig,
                     gone_at_stop: Callable[[], Gone | None] = lambda: None) -> int:
    """`gone_at_stop`: asked when the stop comes, what is known dead then (None: nothing;
    `plane up`'s router process, whose `plane up` died with its nodes)."""
    metrics = PlaneMetrics()
    nc = await connect(router_connection(spec.connect))
    try:
        with serve_metrics(metrics, spec.metrics_port, spec.metrics_host):
            stop = stop_event()
            async with Router(nc, cfg, metrics, replicas=spec.replicas,
                              tracing=Tracing.from_env("plane-router")) as router:
                await until_any(stop, router.lost)
                if router.lost.is_set():
                    return EXIT_LOST
                if (gone := gone_at_stop()) is not None:
                    router.nodes_gone(gone.nodes, gone.why)
                    if gone.server:  # its takes waited out their 5 s timeout, in vain
                        await router.stop(timeout_s=SERVER_GONE_STOP_S)
    finally:
        await close(nc)  # drains; closes when the server is gone
    return 0


async def run_status(opts: ConnectOptions, names: Names, *, metrics_urls: Sequence[str] = (),
                     as_json: bool = False, timeout_s: float = 1.0,
                     router: str | None = None) -> int:
    """Print every router and node once (and what `metrics_urls` add); exit 0 when a router
    and a node answer and some slot is healthy to a router (with `router`: when that router
    answers and sees a healthy slot), else 1. Bounded: a dead server or a silent process
    costs at most about `timeout_s` each for connecting and asking."""
    from plane.observe.console import console  # rich, for the tables: only here
    from plane.observe.denials import Denials
    from plane.observe.planeview import PlaneView, connect_fast
    from plane.observe.top import render, snapshot

    denials = Denials(opts.user)
    try:
        nc = await connect_fast(opts, timeout_s, denials)
    except Unavailable as exc:
        view = PlaneView(routers=[], nodes=[], problems=[str(exc)], router=router,
                         connected=False)
    else:
        try:
            view = await snapshot(nc, names, metrics_urls, timeout_s=timeout_s,
                                  denials=denials, router=router)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
    if as_json:
        body = msgspec.to_builtins(view)
        for m in body["metrics"]:
            del m["buckets"]  # the histogram itself: its p50/p99 are there
        print(json.dumps({"healthy": view.healthy, **body}))
    else:
        console().print(render(view))
    return 0 if view.healthy else 1


async def run_top_command(opts: ConnectOptions, names: Names, *, metrics_urls: Sequence[str],
                          interval_s: float) -> int:
    from plane.observe.denials import Denials
    from plane.observe.planeview import connect_fast
    from plane.observe.top import run_top

    denials = Denials(opts.user)
    nc = await connect_fast(opts, 2.0, denials)
    try:
        stop = stop_event()
        async with asyncio.TaskGroup() as tg:
            top = tg.create_task(run_top(nc, names, metrics_urls, interval_s=interval_s,
                                         denials=denials))
            await stop.wait()  # Ctrl-C
            top.cancel()
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return 0
