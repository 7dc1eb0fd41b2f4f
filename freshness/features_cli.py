"""`plane features`: thin parsing on top of `freshness.features_run`. Needs no Kafka client
(it reads JetStream only), so it is part of the base install."""

from __future__ import annotations

import sys

import click

from freshness.config import UpdaterConfig
from freshness.features_run import run_features
from plane.cli import (
    EXIT_USAGE,
    connect_options,
    log_option,
    make_connect,
    names_for,
    prefix_option,
    replicas_option,
    require_nats,
)
from plane.contract.errors import ConfigError
from plane.contract.lifecycle import run
from plane.contract.logs import configure


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--topic", "topics", multiple=True, required=True,
              help="Kafka topic whose bridged transactions become per-card features, as "
                   "given to `plane bridge --topic` (repeat for several).")
@prefix_option
@replicas_option
@log_option
@connect_options
def features(topics: tuple[str, ...], prefix: str, replicas: int, log_level: str,
             nats_url: str | None, user: str | None, password: str | None, token: str | None,
             creds: str | None, tls_ca: str | None) -> None:
    """Keep per-card features current in the KV bucket PLANE_FEATURES, from the
    transactions `plane bridge` brings into JetStream: what the risk node's freshness guard
    reads for a request with a "card". Run one per plane (a second refuses to start).

    \b
    Examples:
      plane features --topic transactions --nats nats://127.0.0.1:4222
      PLANE_AUTH=/auth:bridge plane features --topic transactions --nats nats://nats-1:4222

    Without it, every risk request with a card finds no features: it waits for them until
    its deadline (or, with `plane node --on-stale degrade`, not at all) and is answered
    `Plane-Freshness: degraded`.
    """
    require_nats(nats_url)
    configure(log_level)
    try:
        names = names_for(prefix)
        configs = [UpdaterConfig(topic=t, names=names, replicas=replicas)
                   for t in dict.fromkeys(topics)]
        connect = make_connect(nats_url, user, password, token, creds, tls_ca,
                               name="plane-features")
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(run(run_features(configs, connect)))
