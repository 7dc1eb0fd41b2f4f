"""`plane up` and `plane node`: the work of the commands that compute, separate from their
parsing in `plane.cli`. They import the node, and with it torch and triton (seconds), so
`plane.cli` imports this module only inside these two commands; the commands that do not
compute are in `plane.serve`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
import time
from dataclasses import replace

from nats.aio.client import Client

from freshness.config import GuardConfig
from freshness.guard import CardFeatureGuard, risk_enricher
from freshness.metrics import GuardMetrics
from gpu_node.node import Node
from plane.auth.store import AuthDir
from plane.config import NodeConfig
from plane.embedded import EmbeddedNats, NatsServerSpec
from plane.lifecycle import stop_event
from plane.messages import FEATURES
from plane.metrics import PlaneMetrics, serve_metrics
from plane.natsconn import close, connect
from plane.serve import ServeSpec
from plane.stack import PlaneStack, StackConfig
from plane.subjects import Header, Names


def example_body(model: str) -> dict[str, object]:
    if model == "risk":
        return {"features": [round(0.05 * i, 2) for i in range(FEATURES)]}
    return {"duration_us": 2000}


def line_buffered_stdout() -> None:
    """`plane up > log` shows each line as it is printed (the URL first), not at exit: a
    redirected stdout is block-buffered by default."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)


async def run_up(cfg: StackConfig, *, demo: bool, port: int | None = None,
                 auth_dir: str | None = None) -> int:
    """Serve a whole plane until a stop signal (or, with `demo`, make example calls). With no
    `--nats` URL it runs nats-server itself, on `port` (None: any free port), with
    `auth_dir`'s config when given (`plane auth init`): then each part connects with its
    role, the rest (demo calls) as admin."""
    line_buffered_stdout()
    auth = AuthDir(auth_dir) if auth_dir is not None else None
    async with contextlib.AsyncExitStack() as started:
        if cfg.connect.url is None:
            server = await started.enter_async_context(
                EmbeddedNats(NatsServerSpec(port=port if port is not None else -1,
                                            extra_args=auth.server_args() if auth else [])))
            cfg = replace(cfg, connect=replace(cfg.connect, url=server.url))
        if auth is not None:
            cfg = replace(cfg, connect=auth.options("admin", cfg.connect.url, name="plane-up"),
                          roles=auth.roles(), settings=auth.tenant_settings())
        code = await _serve(await started.enter_async_context(PlaneStack(cfg)), cfg, demo=demo)
    return code


async def _serve(stack: PlaneStack, cfg: StackConfig, *, demo: bool) -> int:
    """Print where the plane is (the URL first) and how to call it; serve or demo."""
    names = cfg.names
    body = json.dumps(example_body(cfg.models[0]))
    print(f"plane is up: NATS {stack.url}")
    if stack.metrics_port:
        print(f"metrics:     http://127.0.0.1:{stack.metrics_port}/metrics")
    print("call it from any NATS client, for example:")
    print(f"  nats --server {stack.url} req {names.infer(cfg.models[0])} '{body}' "
          f"-H {Header.DEADLINE_MS}:50")
    print(f"  .venv/bin/plane pulse --nats {stack.url} --model {cfg.models[0]} "
          "--rate 100 --duration 5")
    print(f"  Python: async with Client.connect({stack.url!r}) as plane: "
          f"await plane.invoke({cfg.models[0]!r}, {body})")
    if demo:
        nc = await connect(replace(cfg.connect, url=stack.url, name="plane-demo"))
        try:
            await demo_calls(nc, names, cfg.models)
        finally:
            await nc.close()
        return 0
    print("Ctrl-C stops everything.")
    await stop_event().wait()
    print("stopping ...")
    return 0


async def demo_calls(nc: Client, names: Names, models: tuple[str, ...]) -> None:
    """Real answers, then real refusals: more long requests at once than there are slots."""
    for model in models:
        body = json.dumps(example_body(model)).encode()
        t0 = time.perf_counter()
        msg = await nc.request(names.infer(model), body, timeout=5)
        ms = (time.perf_counter() - t0) * 1000
        h = msg.headers or {}
        print(f"{model:>10}: {h.get(Header.STATUS)} {msg.data.decode()} in {ms:.2f} ms "
              f"(node {h.get(Header.NODE)}, slot {h.get(Header.SLOT)}, "
              f"{h.get(Header.SERVICE_US)} us on the slot)")
    if "calibrated" in models:
        burst = 6
        print(f"burst: {burst} calibrated requests of 100 ms at once (more than the slots):")
        body = json.dumps({"duration_us": 100_000}).encode()
        msgs = await asyncio.gather(*(
            nc.request(names.infer("calibrated"), body, timeout=5,
                       headers={Header.DEADLINE_MS: "1000"}) for _ in range(burst)))
        for i, msg in enumerate(msgs):
            h = msg.headers or {}
            extra = (f"Retry-After-Ms {h.get(Header.RETRY_AFTER_MS)} reason "
                     f"{h.get(Header.REASON)} ticket {h.get(Header.TICKET)}"
                     if h.get(Header.STATUS) == "429" else f"on slot {h.get(Header.SLOT)}")
            print(f"  #{i}: {h.get(Header.STATUS)} {extra}")


async def run_node(spec: ServeSpec, cfg: NodeConfig, *, freshness: bool = True) -> int:
    metrics = PlaneMetrics()
    nc = await connect(spec.connect)
    try:
        with serve_metrics(metrics, spec.metrics_port, spec.metrics_host):
            async with contextlib.AsyncExitStack() as stack:
                enrich = None
                if freshness and cfg.model == "risk":
                    guard = CardFeatureGuard(nc, cfg.names, GuardConfig(),
                                             metrics=GuardMetrics(metrics.registry))
                    enrich = risk_enricher(await stack.enter_async_context(guard))
                await stack.enter_async_context(
                    Node(nc, cfg, metrics, replicas=spec.replicas, enrich=enrich))
                await stop_event().wait()
    finally:
        await close(nc)  # drains; closes when the server is gone
    return 0
