"""`plane gateway`: flags to a GatewayConfig, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import click

from plane.cli import (
    connect_options,
    log_option,
    make_connect,
    names_for,
    prefix_option,
    require_nats,
)
from plane.contract.config import MAX_BODY_BYTES, ConnectOptions
from plane.contract.errors import ConfigError
from plane.contract.lifecycle import run as run_on_uvloop
from plane.contract.lifecycle import stop_event
from plane.contract.logs import configure
from plane.gateway.config import GatewayConfig, tenant_tokens_from
from plane.gateway.server import Gateway


async def serve(config: GatewayConfig, connect_opts: ConnectOptions) -> None:
    stop = stop_event()
    async with Gateway(config, connect_opts) as gw:
        click.echo(f"plane gateway on {gw.url}", err=True)
        await stop.wait()


@click.command("gateway")
@connect_options
@prefix_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8080, show_default=True, help="0: any free port.")
@click.option("--max-body-bytes", type=int, default=MAX_BODY_BYTES, show_default=True)
@click.option("--bearer-token", envvar="PLANE_GATEWAY_TOKEN", default=None,
              help="Require 'Authorization: Bearer <token>' on /v1/* (env PLANE_GATEWAY_TOKEN).")
@click.option("--tenant-token", "tenant_tokens", multiple=True, metavar="TENANT=TOKEN",
              envvar="PLANE_GATEWAY_TENANT_TOKENS",
              help="A tenant's bearer token (repeat; env PLANE_GATEWAY_TENANT_TOKENS, space "
                   "separated): its requests go on as that tenant. A tenant may have several "
                   "(to rotate one); a token names one tenant, and is not the --bearer-token.")
@log_option
def gateway(nats_url: str | None, user: str | None, password: str | None, token: str | None,
            creds: str | None, tls_ca: str | None, prefix: str, host: str, port: int,
            max_body_bytes: int, bearer_token: str | None, tenant_tokens: tuple[str, ...],
            log_level: str) -> None:
    """HTTP in front of the plane: POST /v1/infer/{model}; GET /healthz /readyz /metrics
    /openapi.json.

    \b
    Examples:
      plane gateway --nats nats://127.0.0.1:4222 --port 8080
      curl -d '{"duration_us": 1000}' http://127.0.0.1:8080/v1/infer/calibrated
      hey -z 5s -q 20 -c 10 -m POST -d '{"duration_us": 1000}' \\
          http://127.0.0.1:8080/v1/infer/calibrated

    A 429's ticket is held for a retry that cannot send Plane-Ticket back (curl --retry, the
    openai package) and given to the request that repeats it exactly at its Retry-After.
    Clients sending identical bodies with one token from several processes: send an
    Idempotency-Key per request (or Plane-Attempt: 1, 2, ...) to keep their tickets.
    """
    try:
        config = GatewayConfig(host=host, port=port, max_body_bytes=max_body_bytes,
                               bearer_token=bearer_token,
                               tenant_tokens=tenant_tokens_from(tenant_tokens),
                               names=names_for(prefix))
        opts = make_connect(nats_url, user, password, token, creds, tls_ca, name="plane-gateway")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    require_nats(opts.url)  # said as the router's and the node's say it
    configure(log_level)
    run_on_uvloop(serve(config, opts))
