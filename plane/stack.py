"""A whole plane: an embedded nats-server (or a given URL), routers and nodes, in one process
or with each router in a process of its own (`StackConfig.router_processes`, what `plane up`
runs: `plane.router_child`). What `plane up` runs, and what tests and benchmarks start.
Composed with an AsyncExitStack, so everything started is stopped, in reverse order (the
routers before the nodes), whatever fails."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client

from freshness.config import GuardConfig, OnStale
from freshness.guard import guarded_enricher
from plane.contract.config import ConnectOptions, NodeConfig, RouterConfig
from plane.contract.embedded import EmbeddedNats
from plane.contract.lifecycle import Lifecycle, freeze_startup_heap
from plane.contract.metrics import ChildMetrics, PlaneMetrics, serve_metrics
from plane.contract.natsconn import close_now, connect
from plane.contract.subjects import Names
from plane.contract.tracing import Tracing
from plane.router import Router, router_connection
from plane.router_child import RouterChild
from plane.serve import ServeSpec

if TYPE_CHECKING:
    from gpu_node.node import Node
    from gpu_node.slot import Enrich


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    connect: ConnectOptions = field(default_factory=ConnectOptions)  # url None: embedded
    names: Names = field(default_factory=Names)
    models: tuple[str, ...] = ("risk", "calibrated")
    slots: int | None = None  # per node; None: the backend's default (a GPU's: shared)
    backend: str = "auto"
    nodes_per_model: int = 1
    routers: int = 1
    # Router i serves router_models[i] only (`plane router --models`); past the tuple's end,
    # or None: every model.
    router_models: tuple[frozenset[str] | None, ...] = ()
    metrics_port: int | None = None  # 0: any free port
    metrics_host: str = "127.0.0.1"
    allow_faults: bool = False
    replicas: int = 1  # JetStream replicas of the slot stream and KV buckets (3 in a cluster)
    # The freshness guard on `risk` nodes (requests with a `card` use streamed features),
    # and what it does with stale ones (`plane up --on-stale`).
    freshness: bool = False
    on_stale: OnStale = OnStale.WAIT
    # Any other NodeConfig / RouterConfig field by name (tests: `max_pending`, ...); the
    # config's own checks run on them as on any value.
    node_overrides: dict[str, Any] = field(default_factory=dict)
    router_overrides: dict[str, Any] = field(default_factory=dict)
    # Per role ("router", "node"): the credentials of a secured server (`plane auth`); their
    # URL is the stack's. A role not named here connects with `connect`.
    roles: dict[str, ConnectOptions] = field(default_factory=dict)
    # Live settings put into PLANE_CONFIG once the plane is up (as the "admin" role): the
    # tenants' `share.<t>`, `max_rate.<t>` of `plane up --auth`.
    settings: dict[str, int] = field(default_factory=dict)
    # Each router in a process of its own (`plane.router_child`; `plane up` but for
    # `--one-process`), logging at `log_level`; `PlaneStack.routers` is then empty.
    router_processes: bool = False
    log_level: str = "info"
    # The server at `connect.url` is this process's own (`plane up` runs it): it dies with
    # us, which the router processes need to know when we do (`plane.router_child`).
    own_server: bool = False

    def node_id(self, i: int, model: str) -> str:
        """The id of the stack's i-th node of `model`."""
        return f"node{i}-{model}"

    def node_ids(self) -> tuple[str, ...]:
        """Every node the stack runs (in its own process: its router processes' `plane up`)."""
        return tuple(self.node_id(i, m) for i in range(self.nodes_per_model) for m in self.models)


class PlaneStack(Lifecycle):
    """`async with PlaneStack(StackConfig(models=("calibrated",), slots=2)) as s: s.url`"""

    def __init__(self, cfg: StackConfig | None = None, *, enrich: Enrich | None = None,
                 tracing: Tracing | None = None) -> None:
        self.cfg = cfg or StackConfig()
        self.enrich = enrich
        self.tracing = tracing or Tracing.off()
        self.metrics = PlaneMetrics()
        self.server: EmbeddedNats | None = None
        self.routers: list[Router] = []
        self.router_children: list[RouterChild] = []
        self.nodes: list[Node] = []
        self.clients: list[Client] = []
        self.metrics_port: int | None = None
        self.metrics_url: str | None = None  # where /metrics is, as bound
        self.url: str = ""
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        st = self._stack
        cfg = self.cfg
        try:
            if cfg.connect.url is None:
                self.server = await st.enter_async_context(EmbeddedNats())
                self.url = self.server.url
            else:
                self.url = cfg.connect.url
            if cfg.router_processes:  # started first: their start-up runs beside the nodes'
                await self._start_router_children()
            bound = st.enter_context(serve_metrics(
                self.metrics, cfg.metrics_port, cfg.metrics_host,
                children=self._router_metrics()))
            self.metrics_port = bound.port if bound is not None else None
            self.metrics_url = bound.url if bound is not None else None
            # The node's modules (torch and triton: seconds) are imported here, once the router
            # processes are started: their own start-up runs meanwhile, on another core.
            first_import = "gpu_node.node" not in sys.modules
            from gpu_node.node import Node

            if first_import:  # its heap out of the collector's reach before any traffic
                freeze_startup_heap()

            first_partition = 0  # on one GPU, each node's slots after the last node's
            for i in range(cfg.nodes_per_model):
                for model in cfg.models:
                    node_cfg = NodeConfig(
                        names=cfg.names, node_id=cfg.node_id(i, model), model=model,
                        slots=cfg.slots, backend=cfg.backend, allow_faults=cfg.allow_faults,
                        first_partition=first_partition,
                        **{"device_share": len(cfg.models) * cfg.nodes_per_model,
                           **cfg.node_overrides},
                    )
                    nc = await self._connect(f"plane-node-{node_cfg.node_id}", "node")
                    enrich = self.enrich if model == "risk" else None
                    if enrich is None and model == "risk" and cfg.freshness:
                        enrich = await guarded_enricher(
                            st, nc, cfg.names, self.metrics.registry if i == 0 else None,
                            GuardConfig(on_stale=cfg.on_stale), replicas=cfg.replicas)
                    node = Node(nc, node_cfg, self.metrics, enrich=enrich, tracing=self.tracing,
                                replicas=cfg.replicas)
                    self.nodes.append(await st.enter_async_context(node))
                    first_partition += len(node.slots)
            # The nodes drain side by side: one after another, each waited for its own
            # running requests (a stream: up to its drain timeout) before the next began.
            st.push_async_callback(self._stop_nodes)
            for child in self.router_children:  # stopped before the nodes, as below
                st.push_async_callback(child.stop)
            for i in range(0 if cfg.router_processes else cfg.routers):
                router_cfg = self._router_config(i)
                nc = await self._connect(f"plane-router-{i}", "router")
                self.routers.append(await st.enter_async_context(
                    Router(nc, router_cfg, self.metrics, replicas=cfg.replicas,
                           tracing=self.tracing)))
            await self.wait_ready()
            if cfg.settings:
                await self._put_settings(cfg.settings)
        except BaseException:
            await st.aclose()
            raise

    async def _stop_nodes(self) -> None:
        """Stop every node at once (each `Node.stop` drains what it runs); their own exits,
        later on the stack, then find them stopped."""
        failed = [r for r in await asyncio.gather(*(node.stop() for node in self.nodes),
                                                    return_exceptions=True)
                  if isinstance(r, BaseException)]
        if failed:
            raise failed[0]  # as one node's exit raised before (the stack unwinds on)

    def _router_config(self, i: int) -> RouterConfig:
        cfg = self.cfg
        return RouterConfig(
            names=cfg.names, router_id=f"router{i}",
            models=cfg.router_models[i] if i < len(cfg.router_models) else None,
            **cfg.router_overrides)

    def _router_metrics(self) -> list[ChildMetrics]:
        """The router processes' /metrics, each router's samples labelled with its id when
        there are several (one alone keeps the labels a router in this process would have)."""
        several = len(self.router_children) > 1
        return [ChildMetrics(c.metrics_url, {"router": c.cfg.router_id} if several else {})
                for c in self.router_children if c.metrics_url is not None]

    async def _start_router_children(self) -> None:
        cfg = self.cfg
        for i in range(cfg.routers):
            opts = replace(cfg.roles.get("router", cfg.connect), url=self.url,
                           name=f"plane-router-{i}")
            child = RouterChild(ServeSpec(opts, None, replicas=cfg.replicas),
                                self._router_config(i), cfg.log_level,
                                metrics=cfg.metrics_port is not None,
                                parent_nodes=cfg.node_ids(),
                                parent_server=self.server is not None or cfg.own_server)
            self._stack.push_async_callback(child.stop)  # on a failed start (idempotent)
            await child.start()
            self.router_children.append(child)

    async def _connect(self, name: str, role: str) -> Client:
        opts = replace(self.cfg.roles.get(role, self.cfg.connect), url=self.url, name=name)
        nc = await connect(router_connection(opts) if role == "router" else opts)
        # Not `nc.close`: with the server gone it raised into the stop (`plane up` exited 1
        # with a traceback after its nats-server died).
        self._stack.push_async_callback(close_now, nc)
        self.clients.append(nc)
        return nc

    async def _put_settings(self, settings: dict[str, int]) -> None:
        nc = await self._connect("plane-settings", "admin")
        kv = await nc.jetstream().key_value(self.cfg.names.config_bucket)
        for key, value in settings.items():
            await kv.put(key, str(value).encode())

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Until every router sees the healthy slots of every node of the models it serves."""
        import asyncio

        want = {n.cfg.model: 0 for n in self.nodes}
        for n in self.nodes:
            want[n.cfg.model] += len(n.slots)
        if self.router_children:
            nc = await self._connect("plane-ready", "admin")
            try:
                await asyncio.gather(*(c.wait_ready(nc, want, timeout_s)
                                       for c in self.router_children))
            finally:
                await nc.close()
        async with asyncio.timeout(timeout_s):
            while True:
                if all(
                    (ms := r.models.get(m)) is not None and ms.healthy_count() >= count
                    for r in self.routers for m, count in want.items() if r.cfg.serves(m)
                ):
                    return
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self._stack.aclose()

