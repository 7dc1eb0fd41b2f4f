"""The `plane` command: thin parsing on top of the packages' own `run_*` functions.

Environment variables are read here, once (click's `envvar=`), and nowhere else.

Only the commands that compute (`up`, `node`) import the node, and with it torch and triton
(seconds): they do it inside themselves, so `plane --help` and every other command start
without them (`tests/test_cli_imports.py`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import click

from freshness.config import GuardConfig, OnStale
from plane.auth.cli import auth
from plane.contract.config import (
    BACKENDS,
    DEVICE_WAITS,
    MAX_DEADLINE_MS,
    ConnectOptions,
    NodeConfig,
    RouterConfig,
)
from plane.contract.errors import ConfigError, PlaneError
from plane.contract.extras import DISTRIBUTION, missing_extra
from plane.contract.lifecycle import exit_now, run
from plane.contract.logs import configure as configure_logs
from plane.contract.models import MODELS
from plane.contract.subjects import InvalidToken, Names
from plane.serve import ServeSpec, run_router, run_status

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2


F = TypeVar("F", bound=Callable[..., Any])


# What each command does with no --nats (and no PLANE_NATS), said in its --help: only
# `plane up` (and `plane risk-demo`) start a server of their own; every other command was
# told "default: embedded server" and then stopped, or failed to connect to "None".
NATS_REQUIRED_HELP = ("NATS URL(s) of the plane, comma separated (env PLANE_NATS). Required: "
                      "without it the command stops with exit 2.")
NATS_UP_HELP = ("NATS URL(s) of a running server, comma separated (env PLANE_NATS). "
                "Default: an embedded nats-server of this plane's own (on --port, or a free "
                "port).")


def connect_options_with(nats_help: str) -> Callable[[F], F]:
    """The NATS connection options every command takes; `nats_help` says what the command
    does without --nats."""
    def add(f: F) -> F:
        return _connect_options(f, nats_help)
    return add


def connect_options(f: F) -> F:
    """The NATS connection options of a command that needs --nats."""
    return _connect_options(f, NATS_REQUIRED_HELP)


def require_nats(nats_url: str | None, *, or_instead: str = "") -> str:
    """The --nats URL of a command that connects to a running plane, or one usage line
    saying to give it (was `cannot connect to NATS at None` from the router and the node);
    `or_instead`: what the command takes in its place (pulse: `--url URL ...`)."""
    if nats_url is None:
        raise click.UsageError(nats_missing(or_instead))
    return nats_url


def nats_missing(or_instead: str = "") -> str:
    """What a command says when it has no --nats (nor PLANE_NATS): every command the same."""
    instead = f", or {or_instead}" if or_instead else ""
    return (f"give --nats URL (or PLANE_NATS) of the plane's NATS server{instead}: only "
            "`plane up` starts one of its own")


def _connect_options(f: F, nats_help: str) -> F:
    opts = [
        click.option("--nats", "nats_url", envvar="PLANE_NATS", default=None, help=nats_help),
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


# `DIR:ROLE`: connect as role ROLE of the `plane auth` directory DIR (compose/ sets it on
# each service, so that no password is written in a command line or a compose file).
AUTH_ENV = "PLANE_AUTH"


def make_connect(nats_url: str | None, user: str | None, password: str | None,
                 token: str | None, creds: str | None, tls_ca: str | None,
                 name: str = "plane") -> ConnectOptions:
    given = user is not None or token is not None or creds is not None
    if not given and (auth := os.environ.get(AUTH_ENV)):
        from plane.auth.store import AuthDir  # reads DIR/auth.json (no bcrypt needed)

        directory, sep, role = auth.rpartition(":")
        if not sep or not directory or not role:
            raise ConfigError(f"{AUTH_ENV} wants DIR:ROLE (a `plane auth` directory and a "
                              f"role or tenant in it), got {auth!r}")
        opts = AuthDir(directory).options(role, nats_url, name=name)
        return replace(opts, tls_ca=tls_ca)
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
        # an optional part not installed (`plane.contract.extras`)
        except ModuleNotFoundError as exc:
            missing = missing_extra(exc, f"plane {ctx.invoked_subcommand or ''}".strip())
            if missing is None:
                raise
            click.echo(f"error: {missing}", err=True)
            ctx.exit(EXIT_USAGE)


@click.group(cls=PlaneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name=DISTRIBUTION, prog_name="plane")
def main() -> None:
    """The plane: GPU inference on NATS JetStream with no request queue.

    \b
    Examples:
      plane up                       # embedded nats-server, router, a node per model
      plane up --metrics-port 9464   # the same, and one /metrics for all of it
      plane up --demo                # example calls, then stop
      plane node --nats nats://127.0.0.1:4222 --model risk --slots 2
      plane pulse --nats nats://127.0.0.1:4222 --rate 200 --duration 10
    """


def _run(coro: Any, *, teardown: bool = True) -> None:
    """Run a command's coroutine; turn our errors into a clear message and a named exit.
    `teardown=False`: once it returned, exit without the interpreter's teardown
    (`exit_now`: the commands that import torch, whose teardown took a second)."""
    try:
        code = run(coro)
    except PlaneError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if not teardown:
        exit_now(code)
    sys.exit(code)


def names_for(prefix: str) -> Names:
    try:
        return Names(prefix)
    except InvalidToken as exc:
        raise click.BadParameter(str(exc)) from None


prefix_option = click.option("--prefix", default="plane", show_default=True,
                             help="Subject prefix of this plane.")
# A TCP port, or 0 for any free one (a bind out of range was an OverflowError traceback).
PORT = click.IntRange(0, 65535)
metrics_option = click.option("--metrics-port", type=PORT, default=None,
                              help="Serve Prometheus metrics on PORT (0: any free port; "
                                   "default: no metrics served).")
metrics_host_option = click.option(
    "--metrics-host", envvar="PLANE_METRICS_HOST", default="127.0.0.1", show_default=True,
    help="Address the metrics server binds (0.0.0.0 in a container Prometheus scrapes).")
replicas_option = click.option(
    "--replicas", type=click.IntRange(1, 5), default=1, show_default=True,
    help="JetStream replicas for the streams and buckets this process creates (3 in a cluster; "
         "above 1, the slots are spread over one stream per replica).")
LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level_option(default: str = "info") -> Callable[[F], F]:
    """Every command's --log-level, one of LOG_LEVELS (a free string was a KeyError traceback
    in `plane.contract.logs.configure`). Any case: the gateway and the bridge took INFO."""
    return click.option("--log-level", default=default, show_default=True,
                        type=click.Choice(LOG_LEVELS, case_sensitive=False))


log_option = log_level_option()


device_waits_option = click.option(
    "--device-waits", type=click.Choice(DEVICE_WAITS), default="loop", show_default=True,
    help="How a slot waits for its device work: launched and awaited on the event loop (no "
         "thread hop per request; on a GPU, where its warm-up check passes), or on the "
         "slot's own thread.")


on_stale_option = click.option(
    "--on-stale", type=click.Choice([m.value for m in OnStale]), default=OnStale.WAIT.value,
    show_default=True,
    help="risk, a request with a card whose features are stale or missing: wait on its slot "
         "(bounded by its deadline) for fresher ones, or degrade at once to the last good "
         "value (for tight deadlines). Either way the answer says so (Plane-Freshness).")


def parse_models(ctx: click.Context, param: click.Parameter,
                 value: str | None) -> tuple[str, ...] | None:
    """`--models M1,M2` (a click callback): the names in the order given, checked before
    anything starts. A name given twice is refused, not merged: in `plane up` each name is
    a node, and `risk,risk` was two nodes' metrics in one registry (a traceback once the
    plane had started); whether it meant two nodes or was a slip, the user says which."""
    if value is None:
        return None
    names = [m.strip() for m in value.split(",") if m.strip()]
    if repeated := sorted({m for m in names if names.count(m) > 1}):
        raise click.BadParameter(f"{', '.join(repeated)} named more than once: name each "
                                 "model once", ctx=ctx, param=param)
    if unknown := sorted(set(names) - MODELS.keys()):
        raise click.BadParameter(f"unknown model(s) {', '.join(unknown)}: the plane's models "
                                 f"are {', '.join(sorted(MODELS))}", ctx=ctx, param=param)
    return tuple(names)


def serving_options(nats_help: str = NATS_REQUIRED_HELP) -> Callable[[F], F]:
    """What every serving command (up, node, router) takes: connection, prefix, metrics,
    replicas, log level."""
    def add(f: F) -> F:
        for option in reversed((connect_options_with(nats_help), prefix_option,
                                metrics_option, metrics_host_option, replicas_option,
                                log_option)):
            f = option(f)
        return f
    return add


@main.command()
@serving_options(NATS_UP_HELP)
@click.option("--models", default="risk,calibrated,tinylm", show_default=True,
              callback=parse_models,
              help="Comma-separated models to serve (one node each; each named once).")
@click.option("--slots", type=int, default=None,
              help="Slots per node (default: the backend's; on a GPU, its SM partitions shared "
                   "among the models, one request on each).")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(BACKENDS))
@click.option("--demo", is_flag=True, help="Make example calls (answers and refusals), then stop.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Port of the embedded nats-server (default: any free port).")
@click.option("--auth", "auth_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Run the embedded server with DIR/nats.conf (`plane auth init DIR`); each "
                   "part connects with its role, and the tenants' settings go to PLANE_CONFIG.")
@device_waits_option
@on_stale_option
@click.option("--one-process", is_flag=True,
              help="Run the router in this process, on the nodes' event loop (less memory; "
                   "under load each delays the other). Default: a process of its own.")
@click.option("--router-per-model", is_flag=True,
              help="A router process for each model, serving that model only: each model's "
                   "decisions on a core of their own, where one router's core is the limit "
                   "(a GPU host, several models; routers of every model would each read "
                   "every model's done-events and add no decisions).")
def up(nats_url: str | None, user: str | None, password: str | None, token: str | None,
       creds: str | None, tls_ca: str | None, prefix: str, metrics_port: int | None,
       metrics_host: str, replicas: int, log_level: str, models: tuple[str, ...],
       slots: int | None,
       backend: str, demo: bool, port: int | None, auth_dir: str | None,
       device_waits: str, on_stale: str, one_process: bool, router_per_model: bool) -> None:
    """Run a whole plane: embedded nats-server (unless --nats), router (in a process of its
    own; with --router-per-model one per model), nodes; with --metrics-port, one /metrics
    for all (none without it). Prints the NATS URL (and the metrics URL) after the start-up
    log.

    \b
    Examples:
      plane up
      plane up --demo
      plane up --port 4222            # a fixed port, as in the README's Python example
      plane up --auth ./auth          # secured: `plane auth init ./auth` first
      plane up --router-per-model     # a router process per model (a GPU host's cores)
      plane up --nats nats://127.0.0.1:4222 --models calibrated --slots 4 --metrics-port 9464
    """
    if port is not None and nats_url is not None:
        raise click.UsageError("--port is the embedded server's: give --port or --nats, not both")
    if auth_dir is not None and nats_url is not None:
        raise click.UsageError("--auth is the embedded server's: give --auth or --nats, not both")
    if one_process and router_per_model:
        raise click.UsageError("--router-per-model runs each model's router in a process of its "
                               "own: give it or --one-process, not both")
    if replicas > 1 and nats_url is None:
        raise click.UsageError("--replicas above 1 needs a JetStream cluster, and plane up's "
                               "embedded nats-server is a lone one: leave --replicas out, or "
                               "give --nats URL of a cluster of at least --replicas servers")
    if not models:
        raise click.BadParameter(f"plane up serves at least one model: give --models (the "
                                 f"plane's models are {', '.join(sorted(MODELS))}), or leave "
                                 "it out to serve its default", param_hint="'--models'")
    from plane.stack import StackConfig  # the node: torch and triton, once it starts
    from plane.up import run_up

    configure_logs(log_level)
    cfg = StackConfig(
        connect=make_connect(nats_url, user, password, token, creds, tls_ca, "plane-up"),
        names=names_for(prefix), models=models, slots=slots, backend=backend,
        metrics_port=metrics_port, metrics_host=metrics_host, replicas=replicas,
        freshness=True, on_stale=OnStale(on_stale),
        node_overrides={"device_waits": device_waits},
        routers=len(models) if router_per_model else 1,
        router_models=tuple(frozenset({m}) for m in models) if router_per_model else (),
        router_processes=not one_process, log_level=log_level,
    )
    _run(run_up(cfg, demo=demo, port=port, auth_dir=auth_dir), teardown=False)


@main.command()
@serving_options()
@click.option("--model", default="risk", show_default=True, type=click.Choice(sorted(MODELS)))
@click.option("--slots", type=int, default=None, help="Slots to claim (default: backend's).")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(BACKENDS))
@click.option("--sms-per-slot", type=int, default=None, help="SMs per slot partition (CUDA).")
@click.option("--node-id", default=None, help="Node name (default: n-<hostname>-<model>).")
@click.option("--allow-faults", is_flag=True, help="Accept fault injection (tests, drills).")
@click.option("--freshness/--no-freshness", default=True, show_default=True,
              help="risk: guard streamed per-card features by their freshness.")
@on_stale_option
@click.option("--gpu-sample-ms", type=click.IntRange(50, 3_600_000), default=1000,
              show_default=True,
              help="CUDA: read NVML (utilisation, clocks, power ...) this often into /metrics "
                   "(100 for `plane breathe --metrics`).")
@click.option("--processes", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Serve the --slots over this many processes (<node-id>-p<i>, metrics on "
                   "--metrics-port + i): one process places ~1,500 requests/s. On CUDA, "
                   "with MPS.")
@click.option("--inline-work-us", type=click.IntRange(0, 10_000), default=None,
              help="A slot whose calls all take at most this long runs them on the event loop, "
                   "not its thread (the hop costs ~30 us each way, and the loop is held for "
                   "the call); 0: always the thread. Default: 50 on a CPU, 0 on a GPU.")
@click.option("--gil-switch-us", type=click.IntRange(0, 100_000), default=None,
              help="This process's GIL switch interval: how soon a busy event loop hands the "
                   "GIL to a slot's thread (0: Python's 5 ms). Default: 200 on a GPU, "
                   "Python's on a CPU.")
@device_waits_option
def node(nats_url: str | None, user: str | None, password: str | None, token: str | None,
         creds: str | None, tls_ca: str | None, prefix: str, metrics_port: int | None,
         metrics_host: str, replicas: int, log_level: str, model: str, slots: int | None,
         backend: str, sms_per_slot: int | None, node_id: str | None, allow_faults: bool,
         freshness: bool, on_stale: str, gpu_sample_ms: int, processes: int,
         inline_work_us: int | None, gil_switch_us: int | None, device_waits: str) -> None:
    """Serve one model on this machine's device, one depth-one subject per slot.

    \b
    Examples:
      plane node --nats nats://127.0.0.1:4222 --model risk --slots 2 --metrics-port 9465
      plane node --nats nats://127.0.0.1:4222 --model risk --slots 16 --processes 4
    """
    require_nats(nats_url)
    configure_logs(log_level)
    cfg = NodeConfig(names=names_for(prefix), model=model, slots=slots, backend=backend,
                     sms_per_slot=sms_per_slot, allow_faults=allow_faults,
                     gpu_sample_period_s=gpu_sample_ms / 1000, inline_work_us=inline_work_us,
                     gil_switch_us=gil_switch_us, device_waits=device_waits)
    if node_id:
        cfg = replace(cfg, node_id=node_id)
    conn = make_connect(nats_url, user, password, token, creds, tls_ca,
                        f"plane-node-{cfg.node_id}")
    spec = ServeSpec(conn, metrics_port, metrics_host, replicas)
    guard = GuardConfig(on_stale=OnStale(on_stale)) if freshness else None
    if processes > 1:
        from plane.node_group import run_group  # members import the node, not this process

        try:
            code = run_group(spec, cfg, processes, guard=guard, log_level=log_level)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        sys.exit(code)
    from plane.up import run_node  # the node: torch and triton

    _run(run_node(spec, cfg, guard=guard), teardown=False)


@main.command()
@serving_options()
@click.option("--router-id", default=None, help="Router name (default: r-<hostname>).")
@click.option("--max-inbox-wait-ms", type=click.IntRange(10, MAX_DEADLINE_MS),
              default=RouterConfig.max_inbox_wait_ms,
              show_default=True,
              help="While the router is behind on its inbox (its CPU is the limit), a request "
                   "that waited longer than this unread is refused at once (429 overloaded, "
                   "final: go elsewhere) instead of decided late. Raise it where deadlines are "
                   "long and bursts should wait rather than be refused.")
@click.option("--models", default=None, metavar="M1,M2", callback=parse_models,
              help="Serve these models only (comma-separated; default: every model): their "
                   "requests, done-events and the other routers' notes on them. Routers split "
                   "by model read none of each other's traffic, so each adds its own CPU's "
                   "worth of decisions; a model no running router serves has no responder.")
def router(nats_url: str | None, user: str | None, password: str | None, token: str | None,
           creds: str | None, tls_ca: str | None, prefix: str, metrics_port: int | None,
           metrics_host: str, replicas: int, log_level: str, router_id: str | None,
           max_inbox_wait_ms: int, models: tuple[str, ...] | None) -> None:
    """Serve `<prefix>.infer.<model>` in the queue group plane-routers.

    \b
    Examples:
      plane router --nats nats://127.0.0.1:4222 --metrics-port 9466
      plane router --nats nats://127.0.0.1:4222 --models risk --router-id r-risk
    """
    require_nats(nats_url)
    configure_logs(log_level)
    served = frozenset(models) if models is not None else None
    try:
        cfg = RouterConfig(names=names_for(prefix), max_inbox_wait_ms=max_inbox_wait_ms,
                           models=served)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if router_id:
        cfg = replace(cfg, router_id=router_id)
    conn = make_connect(nats_url, user, password, token, creds, tls_ca, "plane-router")
    _run(run_router(ServeSpec(conn, metrics_port, metrics_host, replicas), cfg))


metrics_urls_option = click.option(
    "--metrics", "metrics_urls", multiple=True, metavar="URL",
    help="Also read this /metrics (repeat): refusals, first-retry success, accepted p50/p99, "
         "GPU utilisation.")
NO_URL_HELP = ("Without --nats there is nothing to ask: `plane up`'s embedded server is its own "
               "(on a free port, unless `plane up --port`), so the command stops with exit 2.")


@main.command()
@connect_options
@prefix_option
@metrics_urls_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with \"healthy\").")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1, 10), default=1.0,
              show_default=True, help="Seconds for connecting, and again for the answers.")
@click.option("--router", "router_id", default=None, metavar="ID",
              help="Check this router's health alone (a router's own health check): exit 0 "
                   "when it answers and sees a healthy slot.")
def status(nats_url: str | None, user: str | None, password: str | None, token: str | None,
           creds: str | None, tls_ca: str | None, prefix: str, metrics_urls: tuple[str, ...],
           as_json: bool, timeout_s: float, router_id: str | None) -> None:
    """Every router and node once: slots healthy/busy, promises open, in flight, cycle
    p50/p99, GPU utilisation (with --metrics: refusals, first-retry success, accepted
    p50/p99). Health check: exit 0 when a router and a node answer and a router sees a
    healthy slot (with --router ID: when router ID answers and sees one); 1 otherwise (a
    dead server too, within about 2 x --timeout). What the server does not let the user
    ask is named as such. The `router` role of `plane auth` may run it.

    \b
    Examples:
      plane status --nats nats://127.0.0.1:4222 && echo healthy
      plane status --nats nats://127.0.0.1:4222 --json --metrics http://127.0.0.1:9466/metrics
      PLANE_AUTH=/auth:router plane status --nats nats://nats-1:4222 --router router-1
    """
    if nats_url is None:
        raise click.UsageError(NO_URL_HELP)
    conn = make_connect(nats_url, user, password, token, creds, tls_ca, "plane-status")
    configure_logs("warning")  # to stderr: stdout is the command's output
    _run(run_status(conn, names_for(prefix), metrics_urls=metrics_urls, as_json=as_json,
                    timeout_s=timeout_s, router=router_id))


@main.command()
@connect_options
@prefix_option
@metrics_urls_option
@click.option("--interval", "interval_s", type=click.FloatRange(0.2, 60), default=1.0,
              show_default=True, help="Seconds between refreshes.")
def top(nats_url: str | None, user: str | None, password: str | None, token: str | None,
        creds: str | None, tls_ca: str | None, prefix: str, metrics_urls: tuple[str, ...],
        interval_s: float) -> None:
    """A live view of every router and node (Ctrl-C stops): slots healthy/busy, promises
    open, in flight, cycle p50/p99, GPU utilisation; with --metrics, refusals per second,
    first-retry success and accepted p50/p99 over each interval.

    \b
    Example:
      plane top --nats nats://127.0.0.1:4222 --metrics http://127.0.0.1:9466/metrics
    """
    from plane.serve import run_top_command

    if nats_url is None:
        raise click.UsageError(NO_URL_HELP)
    conn = make_connect(nats_url, user, password, token, creds, tls_ca, "plane-top")
    configure_logs("warning")  # to stderr: stdout is the command's output
    _run(run_top_command(conn, names_for(prefix), metrics_urls=metrics_urls,
                         interval_s=interval_s))


@main.command()
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Samples from nvidia-smi --query-gpu=timestamp,index,utilization.gpu "
                   "--format=csv -lms 100 > FILE.")
@click.option("--metrics", "metrics_url", default=None,
              help="Poll a node's /metrics URL (plane_gpu_utilization_ratio; start the node "
                   "with --gpu-sample-ms 100).")
@click.option("--nvml", is_flag=True, help="Read NVML on this machine (needs nvidia-ml-py).")
@click.option("--device", default=None, help="Only this device index (default: every one).")
@click.option("--seconds", type=click.FloatRange(1, 3600), default=30.0, show_default=True,
              help="--metrics/--nvml: how long to sample, at 10 Hz.")
@click.option("--json", "as_json", is_flag=True, help="The verdict and evidence as JSON.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write utilisation over time as a PNG here.")
def breathe(path: str | None, metrics_url: str | None, nvml: bool, device: str | None,
            seconds: float, as_json: bool, out: str | None) -> None:
    """Is the GPU breathing? Verdict on utilisation samples: steady, breathing (periodic
    swings: a hidden queue fills and drains, or a batcher waits), saturated, idle, bursty,
    inconclusive, with the evidence (mean, std, dominant period, time near 100% and near 0).

    \b
    Examples:
      nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv -lms 100 > u.csv
      plane breathe --file u.csv --out breathe.png
      plane breathe --metrics http://127.0.0.1:9465/metrics --seconds 30 --json
      plane breathe --nvml --device 0 --seconds 20
    """
    from plane.observe.breathe_cli import run_breathe  # numpy, and NVML only with --nvml

    if sum((path is not None, metrics_url is not None, nvml)) != 1:
        raise click.UsageError("give one of --file, --metrics, --nvml")
    sys.exit(run_breathe(path=path, metrics_url=metrics_url, nvml=nvml, device=device,
                         seconds=seconds, as_json=as_json, out=out))


main.add_command(auth)
