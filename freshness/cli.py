"""`plane bridge` and `plane risk-demo`: thin parsing on top of `freshness.run`.

Enter through `plane.cli` (the `plane` command), which adds these commands to its group.
"""

from __future__ import annotations

import sys

import click

from freshness.config import BridgeConfig, OnStale
from freshness.demo import DemoPlan, run_risk_demo
from freshness.kafka_config import KafkaSecurity, SaslMechanism, SecurityProtocol, StartFrom
from freshness.run import run_bridge
from plane.cli import (
    EXIT_OK,
    EXIT_USAGE,
    connect_options,
    connect_options_with,
    log_level_option,
    log_option,
    make_connect,
    metrics_host_option,
    metrics_option,
    replicas_option,
)
from plane.contract.errors import ConfigError
from plane.contract.lifecycle import run as run_on_uvloop
from plane.contract.logs import configure
from plane.contract.subjects import Names

EXIT_FAILED = 1


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--kafka", "kafka", envvar="PLANE_KAFKA", required=True, metavar="HOST:PORT",
              help="Kafka bootstrap servers, comma separated.")
@click.option("--topic", "topics", multiple=True, required=True,
              help="Kafka topic to bridge (repeat for several).")
@click.option("--group", "group_id", default="plane-bridge", show_default=True,
              help="Kafka consumer group (offsets are committed there).")
@click.option("--start", type=click.Choice([s.value for s in StartFrom]), default="committed",
              show_default=True,
              help="Where to start each partition: the group's committed offset (the "
                   "beginning where none), or the beginning / the end whatever was committed.")
@click.option("--dead-letter-topic", default=None, metavar="TOPIC",
              help="Also send bad records to this Kafka topic (NATS always gets them).")
@click.option("--kafka-security", type=click.Choice([p.value for p in SecurityProtocol],
                                                    case_sensitive=False), default=None,
              help="Kafka security protocol (default: SASL_SSL with a SASL mechanism, SSL "
                   "with TLS files, else PLAINTEXT).")
@click.option("--kafka-sasl-mechanism", type=click.Choice([m.value for m in SaslMechanism],
                                                          case_sensitive=False), default=None)
@click.option("--kafka-sasl-username", envvar="PLANE_KAFKA_SASL_USERNAME", default=None)
@click.option("--kafka-sasl-password", envvar="PLANE_KAFKA_SASL_PASSWORD", default=None,
              help="Better from PLANE_KAFKA_SASL_PASSWORD than on the command line.")
@click.option("--kafka-tls-ca", envvar="PLANE_KAFKA_TLS_CA", default=None,
              type=click.Path(dir_okay=False), help="CA file for the brokers' certificates.")
@click.option("--kafka-tls-cert", default=None, type=click.Path(dir_okay=False),
              help="Client certificate (mutual TLS).")
@click.option("--kafka-tls-key", default=None, type=click.Path(dir_okay=False),
              help="The client certificate's private key.")
@click.option("--kafka-tls-no-verify-hostname", is_flag=True, default=False,
              help="Do not check the broker's host name against its certificate.")
@click.option("--max-in-flight", default=1024, show_default=True,
              help="JetStream acknowledgements outstanding at once.")
@click.option("--max-batch", default=1000, show_default=True,
              help="Records per round (offsets are committed once per round).")
@click.option("--session-timeout-ms", default=10_000, show_default=True,
              help="Kafka group session timeout (a dead bridge's partitions move after it).")
@click.option("--metadata-refresh-ms", type=click.IntRange(100, 3_600_000), default=2_000,
              show_default=True,
              help="How often the topics' metadata is asked for: how soon a topic created "
                   "again (a Kafka broker that lost its log) or given partitions is taken up.")
@click.option("--caught-up-interval-ms", type=click.IntRange(10, 60_000), default=50,
              show_default=True,
              help="While a topic is quiet, how often the bridge checks that it has reached "
                   "the end of every partition it holds and says so, which keeps a caught-up "
                   "topic fresh for the freshness guard: keep it well under freshness_ms.")
@click.option("--prefix", default="plane", show_default=True, help="Subject prefix.")
@metrics_option
@metrics_host_option
@replicas_option
@log_option
@connect_options
def bridge(kafka: str, topics: tuple[str, ...], group_id: str, start: str,
           dead_letter_topic: str | None, kafka_security: str | None,
           kafka_sasl_mechanism: str | None, kafka_sasl_username: str | None,
           kafka_sasl_password: str | None, kafka_tls_ca: str | None,
           kafka_tls_cert: str | None, kafka_tls_key: str | None,
           kafka_tls_no_verify_hostname: bool, max_in_flight: int,
           max_batch: int, session_timeout_ms: int, metadata_refresh_ms: int,
           caught_up_interval_ms: int, prefix: str,
           metrics_port: int | None,
           metrics_host: str, replicas: int, log_level: str,
           nats_url: str | None, user: str | None, password: str | None, token: str | None,
           creds: str | None, tls_ca: str | None) -> None:
    """Bridge Kafka topics into JetStream (`<prefix>.events.<topic>`), exactly once.

    \b
    Examples:
      plane bridge --kafka 127.0.0.1:9092 --topic transactions --nats nats://127.0.0.1:4222
      plane bridge --kafka k1:9092,k2:9092 --topic a --topic b --nats nats://n1:4222
      PLANE_KAFKA_SASL_PASSWORD=... plane bridge --kafka b-1.msk:9096 --topic tx \\
        --kafka-sasl-mechanism SCRAM-SHA-512 --kafka-sasl-username bridge --nats ...
    Bad records go to `<prefix>.dead.<topic>` with a Plane-Dead-Reason header (and to
    --dead-letter-topic in Kafka when given). Kafka record headers travel as
    `Plane-Kafka-Header-<name>`.
    """
    configure(log_level)
    try:
        if nats_url is None:
            raise ConfigError("plane bridge needs --nats URL (or PLANE_NATS)")
        security = KafkaSecurity(
            protocol=SecurityProtocol(kafka_security.upper()) if kafka_security else None,
            sasl_mechanism=(SaslMechanism(kafka_sasl_mechanism.upper())
                            if kafka_sasl_mechanism else None),
            sasl_username=kafka_sasl_username, sasl_password=kafka_sasl_password,
            ssl_ca_file=kafka_tls_ca, ssl_cert_file=kafka_tls_cert, ssl_key_file=kafka_tls_key,
            ssl_check_hostname=not kafka_tls_no_verify_hostname)
        config = BridgeConfig(kafka_bootstrap=kafka, topics=topics, names=Names(prefix),
                              group_id=group_id, security=security, start=StartFrom(start),
                              dead_letter_topic=dead_letter_topic,
                              max_in_flight=max_in_flight,
                              max_batch=max_batch, session_timeout_ms=session_timeout_ms,
                              heartbeat_interval_ms=max(100, session_timeout_ms // 6),
                              metadata_refresh_ms=metadata_refresh_ms,
                              caught_up_interval_ms=caught_up_interval_ms, replicas=replicas)
        connect = make_connect(nats_url, user, password, token, creds, tls_ca,
                               name="plane-bridge")
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    run_on_uvloop(run_bridge(config, connect, metrics_port=metrics_port,
                           metrics_host=metrics_host))
    sys.exit(EXIT_OK)


@click.command("risk-demo", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--duration", "duration_s", default=8.0, show_default=True,
              help="Seconds of traffic before everything stops.")
@click.option("--rate", "rate_per_s", default=100.0, show_default=True,
              help="Transactions per second produced to Kafka.")
@click.option("--cards", default=50, show_default=True, help="Distinct cards.")
@click.option("--lag-ms", "lag_ms", default=0.0, show_default=True,
              help="Inject upstream lag: records carry an event time this much in the past.")
@click.option("--lag-fraction", default=0.0, show_default=True,
              help="Fraction of records that carry --lag-ms (0: none, 1: all).")
@click.option("--freshness-ms", "freshness_ms", default=100, show_default=True,
              help="Freshness threshold, written to PLANE_CONFIG (live-configurable).")
@click.option("--on-stale", type=click.Choice([m.value for m in OnStale]), default="wait",
              show_default=True, help="Stale data: wait (bounded) for fresher, or degrade.")
@click.option("--deadline-ms", default=50, show_default=True,
              help="Deadline of each scoring request.")
@click.option("--kafka", "kafka", envvar="PLANE_KAFKA", default=None, metavar="HOST:PORT",
              help="Use this Kafka instead of starting tansu.")
@click.option("--topic", default="transactions", show_default=True)
@log_level_option("warning")
@connect_options_with("NATS URL(s) of a running server, comma separated (env "
                      "PLANE_NATS). Default: a nats-server of the demo's own on a free "
                      "loopback port.")
def risk_demo(duration_s: float, rate_per_s: float, cards: int, lag_ms: float,
              lag_fraction: float, freshness_ms: int, on_stale: str, deadline_ms: int,
              kafka: str | None, topic: str, log_level: str, nats_url: str | None,
              user: str | None, password: str | None, token: str | None, creds: str | None,
              tls_ca: str | None) -> None:
    """A runnable risk pipeline: Kafka -> bridge -> features -> plane -> NATS and Kafka.

    \b
    With no flags it starts nats-server and tansu (a Kafka-compatible broker) on free
    loopback ports, produces card transactions, bridges them into JetStream, keeps per-card
    features fresh in KV, scores each transaction through the plane with a deadline, and
    publishes the scores to NATS (`plane.scored.<topic>`) and to Kafka (`<topic>.scored`).
    Then a burst of requests: one refused (429 with a ticket) comes back after its
    Retry-After-Ms and gets its answer. It prints what happened (answers by status, deadline
    misses), then stops everything it started; exit 0 and "OK" only when every record was
    scored once, every answer was a 200 within its deadline, and the ticket was redeemed.
    \b
    Examples:
      plane risk-demo
      plane risk-demo --duration 20 --rate 500
      plane risk-demo --lag-ms 300 --lag-fraction 0.5 --on-stale degrade
    """
    configure(log_level)
    try:
        plan = DemoPlan(duration_s=duration_s, rate_per_s=rate_per_s, cards=cards,
                        lag_ms=lag_ms, lag_fraction=lag_fraction, freshness_ms=freshness_ms,
                        on_stale=OnStale(on_stale), deadline_ms=deadline_ms, kafka=kafka,
                        topic=topic)
        connect = (make_connect(nats_url, user, password, token, creds, tls_ca,
                                name="plane-risk-demo") if nats_url else None)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    report = run_on_uvloop(run_risk_demo(plan, connect))
    click.echo(report.render())
    sys.exit(EXIT_OK if report.ok else EXIT_FAILED)
