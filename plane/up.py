"""`plane up` and `plane node`: the work of the commands that compute, separate from their
parsing in `plane.cli`. They run the node, and with it torch and triton (seconds to import),
so `plane.cli` imports this module only inside these two commands; the commands that do not
compute are in `plane.serve`. The node's modules are imported where a node starts
(`PlaneStack.start`, `run_node`): `plane up` starts its router's process first, and that
process starts while this one imports them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from nats.aio.client import Client

from freshness.config import GuardConfig
from freshness.guard import guarded_enricher
from plane.auth.store import STATE_FILE, AuthDir
from plane.client import Client as PlaneClient
from plane.client import ClientConfig
from plane.client.ticket_demo import redeem_one_ticket
from plane.contract import logs
from plane.contract.backoff import NO_RETRY
from plane.contract.config import NodeConfig
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.lifecycle import freeze_startup_heap, stop_event, until_any
from plane.contract.messages import FEATURES, Status
from plane.contract.metrics import PlaneMetrics, serve_metrics
from plane.contract.natsconn import close, connect
from plane.contract.processes import how_it_ended
from plane.contract.subjects import Header, Names
from plane.contract.tracing import Tracing
from plane.serve import ServeSpec
from plane.stack import PlaneStack, StackConfig

DEMO_DEADLINE_MS = 1000  # the demo's calls: each must be a 200 within it


def example_body(model: str) -> dict[str, object]:
    if model == "risk":
        return {"features": [round(0.05 * i, 2) for i in range(FEATURES)]}
    if model == "tinylm":
        return {"prompt": "The plane", "max_tokens": 16}
    return {"duration_us": 2000}


def say(text: str) -> None:
    """`text` and its newline to stdout in one write, flushed: `plane up > log` shows each
    line as it is said (the URL first), not at exit, and no other line can land inside it."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def run_up(cfg: StackConfig, *, demo: bool, port: int | None = None,
                 auth_dir: str | None = None) -> int:
    """Serve a whole plane until a stop signal (or, with `demo`, make example calls). With no
    `--nats` URL it runs nats-server itself, on `port` (None: any free port), with
    `auth_dir`'s config when given (`plane auth init`): then each part connects with its
    role, the rest (demo calls) as admin."""
    auth = AuthDir(auth_dir) if auth_dir is not None else None
    server: EmbeddedNats | None = None
    # Before anything starts: a SIGTERM during the start-up (or the moment its banner says it
    # is up) stops it cleanly once started, instead of killing it with its children.
    stop = stop_event()
    async with contextlib.AsyncExitStack() as started:
        if cfg.connect.url is None:
            server = await started.enter_async_context(
                EmbeddedNats(NatsServerSpec(port=port if port is not None else -1,
                                            extra_args=auth.server_args() if auth else [])))
            cfg = replace(cfg, connect=replace(cfg.connect, url=server.url), own_server=True)
        if auth is not None:
            cfg = replace(cfg, connect=auth.options("admin", cfg.connect.url, name="plane-up"),
                          roles=auth.roles(), settings=auth.tenant_settings())
        code = await _serve(await started.enter_async_context(
            PlaneStack(cfg, tracing=Tracing.from_env("plane"))), cfg, stop, demo=demo,
            credentials=auth.path / STATE_FILE if auth is not None else None, server=server)
    return code


async def _serve(stack: PlaneStack, cfg: StackConfig, stop: asyncio.Event, *, demo: bool,
                 credentials: Path | None = None, server: EmbeddedNats | None = None) -> int:
    """Print where the plane is (the URL first) and how to call it; serve or demo.
    `credentials`: the auth state the server runs with (the calls below need a login).
    `server`: the embedded nats-server, when it runs one; it stops whole if it dies."""
    names = cfg.names
    body = json.dumps(example_body(cfg.models[0]))
    lines = [f"plane is up: NATS {stack.url}"]
    if credentials is not None:
        # Where the logins are, not the logins: a banner ends up in logs.
        lines.append(f"credentials: required; every role's and tenant's user and password are "
                     f"in {credentials}: add --user and --password to the calls below (a "
                     f"tenant's to call as that tenant)")
    if stack.metrics_url:
        lines.append(f"metrics:     {stack.metrics_url}")
    lines += [
        "call it from any NATS client, for example:",
        f"  nats --server {stack.url} req {names.infer(cfg.models[0])} '{body}' "
        f"-H {Header.DEADLINE_MS}:50",
        f"  .venv/bin/plane pulse --nats {stack.url} --model {cfg.models[0]} "
        "--rate 100 --duration 5",
        f"  Python: async with Client.connect({stack.url!r}) as plane: "
        f"await plane.invoke({cfg.models[0]!r}, {body})",
    ]
    # After the start-up's log lines (they go to stderr through a writer thread), in one
    # write: `print`'s text and its newline are two writes, and with PYTHONUNBUFFERED (as
    # container images often set it) and both streams on one terminal or file, a log line
    # landed between them, in the middle of the URL's line.
    await asyncio.to_thread(logs.wait_written, 1.0)
    say("\n".join(lines))
    if demo:
        nc = await connect(replace(cfg.connect, url=stack.url, name="plane-demo"))
        try:
            return await demo_calls(nc, names, cfg.models)
        finally:
            await nc.close()
    say("Ctrl-C stops everything.")
    await until_any(stop, *(c.lost for c in stack.router_children),
                    *([server.lost] if server is not None else []))
    if not stop.is_set() and server is not None and server.lost.is_set():
        # Not restarted in place: its JetStream state (the slot stream, placements in
        # flight, the live settings) died with it, and a fresh server on the same port would
        # serve a plane that only looks whole. Stopped whole, and exit 1: whatever runs us
        # (systemd, a container's restart policy) starts the whole plane again.
        say(f"stopping: the embedded nats-server exited on its own "
            f"({how_it_ended(server.exit_code)}) and its JetStream state with it: start "
            "`plane up` again (a supervisor does), or run nats-server yourself and pass "
            "--nats URL")
        return 1
    if not stop.is_set():  # a router's process exited on its own (its log says why)
        say("stopping: the router's process exited")
        return 1
    say("stopping ...")
    return 0


async def demo_calls(nc: Client, names: Names, models: tuple[str, ...]) -> int:
    """Real answers, then a refusal turned into an answer (more long requests at once than
    there are slots; the first refusal's ticket redeemed). Says what happened and "OK" only
    when every call met its contract: 0 then, else 1 (so `make demo` fails)."""
    client = PlaneClient(nc, ClientConfig(names=names))
    misses: list[str] = []
    statuses: Counter[int] = Counter()
    for model in models:
        body = example_body(model)
        t0 = time.perf_counter()
        r = await client.call(model, body, deadline_ms=DEMO_DEADLINE_MS, policy=NO_RETRY)
        ms = (time.perf_counter() - t0) * 1000
        statuses[r.status] += 1
        say(f"{model:>10}: {r.status} {r.body.decode()} in {ms:.2f} ms "
            f"(node {r.headers.get(Header.NODE)}, slot {r.headers.get(Header.SLOT)}, "
            f"{r.headers.get(Header.SERVICE_US)} us on the slot)")
        if r.status != Status.OK:
            misses.append(f"{model} answered {r.status} ({r.reason})")
        elif ms > DEMO_DEADLINE_MS:
            misses.append(f"{model} answered after its {DEMO_DEADLINE_MS} ms deadline")
    if "calibrated" in models:
        story = await redeem_one_ticket(client)
        say("\n".join(line.strip() for line in story.render()))
        if not story.ok:
            misses.append("the refusal's ticket was not redeemed with a 200")
    say("answers by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    if misses:
        say("demo: NOT OK: " + "; ".join(misses))
        return 1
    say("demo: OK (every call answered 200 within its deadline"
        + (", a refusal redeemed with its ticket)" if "calibrated" in models else ")"))
    return 0


DEFAULT_GUARD = GuardConfig()


async def run_node(spec: ServeSpec, cfg: NodeConfig, *,
                   guard: GuardConfig | None = DEFAULT_GUARD) -> int:
    """Serve one node until a stop signal; `guard`: the freshness guard's settings on a
    `risk` node (None: no guard, `--no-freshness`)."""
    from gpu_node.node import Node  # torch and triton (see the module's docstring)

    freeze_startup_heap()  # what that import brought, before any request can arrive

    metrics = PlaneMetrics()
    stop = stop_event()  # before its start-up log says it serves (see `run_up`)
    nc = await connect(spec.connect)
    try:
        with serve_metrics(metrics, spec.metrics_port, spec.metrics_host):
            async with contextlib.AsyncExitStack() as stack:
                enrich = None
                if guard is not None and cfg.model == "risk":
                    enrich = await guarded_enricher(stack, nc, cfg.names, metrics.registry,
                                                    guard, replicas=spec.replicas)
                await stack.enter_async_context(
                    Node(nc, cfg, metrics, replicas=spec.replicas, enrich=enrich,
                         tracing=Tracing.from_env("plane-node")))
                await stop.wait()
    finally:
        await close(nc)  # drains; closes when the server is gone
    return 0
