"""The `plane` command: thin parsing on top of the packages' own `run_*` functions.

Environment variables are read here, once (click's `envvar=`), and nowhere else.

Only the commands that compute (`up`, `node`) import the node, and with it torch and triton
(seconds): they do it inside themselves, so `plane --help` and every other command start
without them (`tests/test_cli_imports.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from plane.config import ConnectOptions, NodeConfig, RouterConfig
from plane.errors import PlaneError
from plane.lifecycle import run
from plane.logs import configure as configure_logs
from plane.models import MODELS
from plane.serve import ServeSpec, run_router, run_status
from plane.subjects import InvalidToken, Names

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2


F = TypeVar("F", bound=Callable[..., Any])


def connect_options(f: F) -> F:
    """The NATS connection options every command takes."""
    opts = [
        click.option("--nats", "nats_url", envvar="PLANE_NATS", default=None,
                     help="NATS URL(s), comma separated (default: embedded server)."),
        click.option("--user", envvar="PLANE_NATS_USER", default=None),
        click.option("--password", envvar="PLANE_NATS_PASSWORD", default=None),
        click.option("--token", envvar="PLANE_NATS_TOKEN", default=None),
        click.option("--creds", envvar="PLANE_NATS_CREDS", default=None,
                     type=click.Path(exists=True, dir_okay=False), help="NATS .creds file"),
        click.option("--tls-ca", envvar="PLANE_NATS_TLS_CA", default=None,
                     type=click.Path(exists=True, dir_okay=False), help="CA file for TLS"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def make_connect(nats_url: str | None, user: str | None, password: str | None,
                 token: str | None, creds: str | None, tls_ca: str | None,
                 name: str = "plane") -> ConnectOptions:
    return ConnectOptions(url=nats_url, user=user, password=password, token=token,
                          creds=creds, tls_ca=tls_ca, name=name)


class PlaneGroup(click.Group):
    """Turns the plane's own errors (bad configuration, say) into one clear line and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PlaneError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_USAGE)


@click.group(cls=PlaneGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """The plane: GPU inference on NATS JetStream with no request queue.

    \b
    Examples:
      plane up                       # embedded nats-server, router, node, metrics
      plane up --demo                # the same, plus example calls, then stop
      plane node --nats nats://127.0.0.1:4222 --model risk --slots 2
      plane pulse --nats nats://127.0.0.1:4222 --rate 200 --duration 10
    """


def _run(coro: Any) -> None:
    """Run a command's coroutine; turn our errors into a clear message and a named exit."""
    try:
        code = run(coro)
    except PlaneError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(code)


def names_for(prefix: str) -> Names:
    try:
        return Names(prefix)
    except InvalidToken as exc:
        raise click.BadParameter(str(exc)) from None


prefix_option = click.option("--prefix", default="plane", show_default=True,
                             help="Subject prefix of this plane.")
metrics_option = click.option("--metrics-port", type=int, default=None,
                              help="Serve Prometheus metrics on PORT (0: any free port).")
metrics_host_option = click.option(
    "--metrics-host", envvar="PLANE_METRICS_HOST", default="127.0.0.1", show_default=True,
    help="Address the metrics server binds (0.0.0.0 in a container Prometheus scrapes).")
replicas_option = click.option(
    "--replicas", type=click.IntRange(1, 5), default=1, show_default=True,
    help="JetStream replicas for the streams and buckets this process creates (3 in a cluster).")
log_option = click.option("--log-level", default="info", show_default=True,
                          type=click.Choice(["debug", "info", "warning", "error"]))


def serving_options(f: F) -> F:
    """What every serving command (up, node, router) takes: connection, prefix, metrics,
    replicas, log level."""
    for option in reversed((connect_options, prefix_option, metrics_option,
                            metrics_host_option, replicas_option, log_option)):
        f = option(f)
    return f


@main.command()
@serving_options
@click.option("--models", default="risk,calibrated", show_default=True,
              help="Comma-separated models to serve (one node each).")
@click.option("--slots", type=int, default=None, help="Slots per node (default: backend's).")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "interpret", "triton"]))
@click.option("--demo", is_flag=True, help="Make example calls (answers and refusals), then stop.")
def up(nats_url: str | None, user: str | None, password: str | None, token: str | None,
       creds: str | None, tls_ca: str | None, prefix: str, metrics_port: int | None,
       metrics_host: str, replicas: int, log_level: str, models: str, slots: int | None,
       backend: str, demo: bool) -> None:
    """Run a whole plane: embedded nats-server (unless --nats), router, nodes, metrics.

    \b
    Examples:
      plane up
      plane up --demo
      plane up --nats nats://127.0.0.1:4222 --models calibrated --slots 4 --metrics-port 9464
    """
    from plane.stack import StackConfig  # the node: torch and triton
    from plane.up import run_up

    configure_logs(log_level)
    model_list = tuple(m.strip() for m in models.split(",") if m.strip())
    cfg = StackConfig(
        connect=make_connect(nats_url, user, password, token, creds, tls_ca, "plane-up"),
        names=names_for(prefix), models=model_list, slots=slots, backend=backend,
        metrics_port=metrics_port, metrics_host=metrics_host, replicas=replicas,
        freshness=True,
    )
    _run(run_up(cfg, demo=demo))


@main.command()
@serving_options
@click.option("--model", default="risk", show_default=True, type=click.Choice(sorted(MODELS)))
@click.option("--slots", type=int, default=None, help="Slots to claim (default: backend's).")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "interpret", "triton"]))
@click.option("--sms-per-slot", type=int, default=None, help="SMs per slot partition (CUDA).")
@click.option("--node-id", default=None, help="Node name (default: n-<hostname>).")
@click.option("--allow-faults", is_flag=True, help="Accept fault injection (tests, drills).")
@click.option("--freshness/--no-freshness", default=True, show_default=True,
              help="risk: guard streamed per-card features by their freshness.")
def node(nats_url: str | None, user: str | None, password: str | None, token: str | None,
         creds: str | None, tls_ca: str | None, prefix: str, metrics_port: int | None,
         metrics_host: str, replicas: int, log_level: str, model: str, slots: int | None,
         backend: str, sms_per_slot: int | None, node_id: str | None, allow_faults: bool,
         freshness: bool) -> None:
    """Serve one model on this machine's device, one depth-one subject per slot.

    \b
    Example:
      plane node --nats nats://127.0.0.1:4222 --model risk --slots 2 --metrics-port 9465
    """
    from plane.up import run_node  # the node: torch and triton

    configure_logs(log_level)
    extra = {"node_id": node_id} if node_id else {}
    cfg = NodeConfig(names=names_for(prefix), model=model, slots=slots, backend=backend,
                     sms_per_slot=sms_per_slot, allow_faults=allow_faults, **extra)  # type: ignore[arg-type]
    conn = make_connect(nats_url, user, password, token, creds, tls_ca,
                        f"plane-node-{cfg.node_id}")
    _run(run_node(ServeSpec(conn, metrics_port, metrics_host, replicas), cfg,
                  freshness=freshness))


@main.command()
@serving_options
@click.option("--router-id", default=None, help="Router name (default: r-<hostname>).")
def router(nats_url: str | None, user: str | None, password: str | None, token: str | None,
           creds: str | None, tls_ca: str | None, prefix: str, metrics_port: int | None,
           metrics_host: str, replicas: int, log_level: str, router_id: str | None) -> None:
    """Serve `<prefix>.infer.<model>` in the queue group plane-routers.

    \b
    Example:
      plane router --nats nats://127.0.0.1:4222 --metrics-port 9466
    """
    configure_logs(log_level)
    extra = {"router_id": router_id} if router_id else {}
    cfg = RouterConfig(names=names_for(prefix), **extra)  # type: ignore[arg-type]
    conn = make_connect(nats_url, user, password, token, creds, tls_ca, "plane-router")
    _run(run_router(ServeSpec(conn, metrics_port, metrics_host, replicas), cfg))


@main.command()
@connect_options
@prefix_option
def status(nats_url: str | None, user: str | None, password: str | None, token: str | None,
           creds: str | None, tls_ca: str | None, prefix: str) -> None:
    """Health check: exit 0 when a router and a node answer $SRV.PING, else 1.

    \b
    Example:
      plane status --nats nats://127.0.0.1:4222 && echo healthy
    """
    conn = make_connect(nats_url, user, password, token, creds, tls_ca, "plane-status")
    _run(run_status(conn, names_for(prefix)))
