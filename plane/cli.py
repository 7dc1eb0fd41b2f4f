"""The `plane` command: thin parsing on top of the packages' own `run_*` functions.

Environment variables are read here, once (click's `envvar=`), and nowhere else.
"""

from __future__ import annotations

import click

from plane.config import ConnectOptions

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2


def connect_options(f):  # type: ignore[no-untyped-def]
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """The plane: GPU inference on NATS JetStream with no request queue.

    \b
    Examples:
      plane up                       # embedded nats-server, router, node, metrics
      plane up --demo                # the same, plus example calls, then stop
      plane node --nats nats://127.0.0.1:4222 --model risk --slots 2
      plane pulse --nats nats://127.0.0.1:4222 --rate 200 --duration 10
    """


# ---- commands (one line each; each module owns its command) -------------------------------
