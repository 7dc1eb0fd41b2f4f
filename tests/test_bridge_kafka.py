"""The bridge and Kafka as production runs it: TLS and SASL settings, record headers carried
onto JetStream, where a partition starts, dead letters to a Kafka topic, consumer lag.

SASL and TLS cannot be exercised end to end here: tansu 0.6 speaks neither (no listener
option for them). What is checked is that every option reaches librdkafka's settings, that
librdkafka accepts them (a client is built with them), and that bad combinations fail at
start with a message that says what to do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer
from kafka_fixtures import (
    bridge_config,
    kafka_topic,
    produce,
    subject_messages,
    tansu,
    txn_line,
    wait_count,
)
from nats.aio.client import Client

from freshness.bridge import KAFKA_DEAD_REASON, KAFKA_DEAD_SOURCE, KafkaBridge
from freshness.config import BridgeConfig
from freshness.kafka_client import RepeatsHeldBack, consumer_config, leave_group, new_client
from freshness.kafka_config import KafkaSecurity, SaslMechanism, SecurityProtocol, StartFrom
from freshness.records import (
    KAFKA_HEADER_PREFIX,
    carry_kafka_headers,
    kafka_header_name,
    kafka_header_of,
    kafka_headers,
)
from freshness.tansu import EmbeddedTansu
from plane.app import main
from plane.contract.errors import ConfigError
from plane.contract.processes import free_port
from plane.contract.subjects import TRACE_HEADERS, Header, Names

__all__ = ["kafka_topic", "tansu"]  # fixtures, imported for pytest

NAMES = Names()




@pytest.fixture
def pem(tmp_path: Path) -> Path:
    """A CA bundle librdkafka can load: the system's, where there is one."""
    for system in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"):
        if os.path.isfile(system):
            return Path(system)
    pytest.skip("no system CA bundle to load")


# -- security settings ------------------------------------------------------------------------
def test_security_defaults_follow_the_options(pem: Path) -> None:
    assert KafkaSecurity().librdkafka() == {"security.protocol": "PLAINTEXT"}
    scram = KafkaSecurity(sasl_mechanism=SaslMechanism.SCRAM_SHA_512, sasl_username="bridge",
                          sasl_password="s3cret", ssl_ca_file=str(pem))
    assert scram.librdkafka() == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "bridge", "sasl.password": "s3cret",
        "ssl.endpoint.identification.algorithm": "https", "ssl.ca.location": str(pem),
    }
    assert "s3cret" not in repr(scram)
    tls = KafkaSecurity(ssl_ca_file=str(pem), ssl_check_hostname=False)
    assert tls.librdkafka() == {"security.protocol": "SSL", "ssl.ca.location": str(pem),
                                "ssl.endpoint.identification.algorithm": "none"}
    plain = KafkaSecurity(protocol=SecurityProtocol.SASL_PLAINTEXT,
                          sasl_mechanism=SaslMechanism.PLAIN, sasl_username="u",
                          sasl_password="p")
    assert plain.password_in_clear
    assert plain.librdkafka()["security.protocol"] == "SASL_PLAINTEXT"


@pytest.mark.parametrize("mechanism", list(SaslMechanism))
def test_librdkafka_accepts_every_mechanism_over_tls(pem: Path, mechanism: SaslMechanism) -> None:
    """The settings reach a real librdkafka client, which builds (no broker is contacted)."""
    security = KafkaSecurity(sasl_mechanism=mechanism, sasl_username="bridge",
                             sasl_password="s3cret", ssl_ca_file=str(pem))
    cfg = BridgeConfig(kafka_bootstrap="127.0.0.1:1", topics=("tx",), security=security)
    conf = consumer_config(cfg)
    assert conf["sasl.mechanism"] == mechanism.value
    assert conf["security.protocol"] == "SASL_SSL"
    new_client(Consumer, conf).close()


def test_a_setting_librdkafka_refuses_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-cert.pem"
    bad.write_text("not a certificate\n")
    cfg = BridgeConfig(kafka_bootstrap="127.0.0.1:1", topics=("tx",),
                       security=KafkaSecurity(ssl_ca_file=str(bad)))
    with pytest.raises(ConfigError, match="Kafka client settings refused"):
        new_client(Consumer, consumer_config(cfg))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"protocol": SecurityProtocol.SASL_SSL}, "needs --kafka-sasl-mechanism"),
        ({"sasl_mechanism": SaslMechanism.PLAIN, "sasl_username": "u"},
         "needs --kafka-sasl-username and --kafka-sasl-password"),
        ({"sasl_username": "u", "sasl_password": "p"}, "SASL options given with Kafka "
         "security PLAINTEXT"),
        ({"protocol": SecurityProtocol.SSL, "sasl_mechanism": SaslMechanism.SCRAM_SHA_256,
          "sasl_username": "u", "sasl_password": "p"}, "SASL options given with Kafka "
         "security SSL"),
        ({"protocol": SecurityProtocol.PLAINTEXT, "ssl_ca_file": "/etc/hostname"},
         "TLS options given with Kafka security PLAINTEXT"),
        ({"ssl_cert_file": "/etc/hostname"}, "needs its key"),
        ({"ssl_ca_file": "/no/such/ca.pem"}, "Kafka TLS file not found: /no/such/ca.pem"),
    ],
)
def test_bad_security_combinations_say_what_to_do(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KafkaSecurity(**kw)  # type: ignore[arg-type]


def test_bridge_cli_security_flags(pem: Path) -> None:
    runner = CliRunner()
    base = ["bridge", "--kafka", "127.0.0.1:1", "--topic", "t", "--nats", "nats://127.0.0.1:1"]
    result = runner.invoke(main, [*base, "--kafka-sasl-mechanism", "SCRAM-SHA-256",
                                  "--kafka-sasl-username", "u"])
    assert result.exit_code == 2, result.output
    assert "--kafka-sasl-password (or PLANE_KAFKA_SASL_PASSWORD)" in result.output
    result = runner.invoke(main, [*base, "--kafka-security", "plaintext",
                                  "--kafka-tls-ca", str(pem)])
    assert result.exit_code == 2 and "TLS options given" in result.output
    result = runner.invoke(main, [*base, "--start", "sometime"])
    assert result.exit_code == 2 and "earliest" in result.output
    result = runner.invoke(main, [*base, "--dead-letter-topic", "t"])
    assert result.exit_code == 2 and "dead-letter topic cannot be" in result.output
    result = runner.invoke(main, ["bridge", "--help"])
    assert "--kafka-sasl-mechanism" in result.output and "Plane-Kafka-Header-" in result.output


# -- headers ----------------------------------------------------------------------------------
def test_kafka_header_names_and_values_round_trip() -> None:
    assert kafka_header_name("traceparent") == "Plane-Kafka-Header-traceparent"
    assert kafka_header_name("x y:z%") == "Plane-Kafka-Header-x%20y%3Az%25"
    assert kafka_header_name("naïve") == "Plane-Kafka-Header-na%C3%AFve"
    for name in ("traceparent", "x y:z%", "naïve", "Content-Type"):
        assert kafka_header_of(kafka_header_name(name)) == name
    assert kafka_header_of(Header.KAFKA_KEY) is None
    out: dict[str, str] = {}
    carry_kafka_headers(out, [("a", b"1"), ("bin", b"\x00\xff"), ("none", None),
                              ("a", b"2"), ("pad", b" x ")])
    assert out["Plane-Kafka-Header-a"] == "2"  # the last of a repeated name
    assert kafka_headers(out) == {"a": b"2", "bin": b"\x00\xff", "none": b"", "pad": b" x "}
    assert Header.TRACEPARENT not in out
    carry_kafka_headers(out, [("traceparent", b"00-ab-cd-01"), ("tracestate", b"\xff")])
    assert out[Header.TRACEPARENT] == "00-ab-cd-01"
    assert Header.TRACESTATE not in out  # not text: carried only as a Kafka header


async def test_record_headers_travel_onto_jetstream(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("traced", partitions=1)
    headers = [("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
               ("tenant id", b"acme"), ("blob", b"\x00\x01\xfe"), ("Nats-Msg-Id", b"spoof")]
    body = b'{"card":"c1","amount":1.5}'
    async with KafkaBridge(nc, bridge_config(tansu, topic)):
        await produce(tansu.bootstrap, topic, [(b"c1", body, headers),
                                                (b"c2", b"not json", headers)])
        await wait_count(nc, NAMES, NAMES.events(topic), 1, settle_s=0)
        await wait_count(nc, NAMES, NAMES.dead_letter(topic), 1, settle_s=0.1)
    for subject in (NAMES.events(topic), NAMES.dead_letter(topic)):
        (msg,) = await subject_messages(nc, NAMES, subject)
        assert kafka_headers(msg.headers) == dict(headers)
        assert msg.headers["Plane-Kafka-Header-tenant%20id"] == "acme"
        # A Kafka header never overrides the bridge's own.
        assert msg.headers[Header.NATS_MSG_ID].startswith(f"{topic}:0:")
        assert all(k.startswith(KAFKA_HEADER_PREFIX) or k.startswith(("Plane-", "Nats-"))
                   or k in TRACE_HEADERS for k in msg.headers)
        # The W3C trace context also under its own name: the trace goes on from here.
        assert msg.headers[Header.TRACEPARENT] == headers[0][1].decode()


# -- where a partition starts -----------------------------------------------------------------
async def test_start_committed_earliest_latest(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("starts", partitions=2)
    subject = NAMES.events(topic)
    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(50)])
    async with KafkaBridge(nc, bridge_config(tansu, topic, group_id="g1")) as bridge:
        await wait_count(nc, NAMES, subject, 50, settle_s=0.3)
    assert bridge.stats.events == 50

    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(50, 70)])
    async with KafkaBridge(nc, bridge_config(tansu, topic, group_id="g1")) as bridge:
        assert await wait_count(nc, NAMES, subject, 70, settle_s=0.3) == 70
    assert (bridge.stats.events, bridge.stats.duplicates) == (20, 0)  # from the commit

    async with KafkaBridge(nc, bridge_config(tansu, topic, group_id="g1",
                                       start=StartFrom.EARLIEST)) as bridge:
        async with asyncio.timeout(20):
            while bridge.stats.duplicates < 70:
                await asyncio.sleep(0.05)
    assert bridge.stats.events == 0  # replayed from the beginning, all dropped by JetStream

    # tansu 0.6 answers ListOffsets(latest) with the base offset of a partition's last
    # batch plus one, not its end: records of that batch would come through. A last batch of
    # one record each (never bridged: `latest` starts after it) keeps the check exact.
    for p in range(2):
        await produce(tansu.bootstrap, topic, [(None, b"{}", [])], partition=p)
    async with KafkaBridge(nc, bridge_config(tansu, topic, group_id="fresh",
                                       start=StartFrom.LATEST)) as bridge:
        await bridge.wait_assigned()
        await asyncio.sleep(0.5)  # let it take its positions at the end
        await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(70, 75)])
        assert await wait_count(nc, NAMES, subject, 75, settle_s=0.3) == 75
    assert (bridge.stats.events, bridge.stats.duplicates) == (5, 0)  # the backlog skipped


# -- dead letters to Kafka, consumer lag ------------------------------------------------------
def _consume_all(bootstrap: str, topic: str, n: int) -> list[tuple[bytes | None, bytes | None,
                                                                   dict[str, bytes]]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "dlq-reader",
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    out = []
    try:
        for _ in range(300):
            for m in consumer.consume(n, 0.1):
                if m.error() is None:
                    hs = {k: v or b"" for k, v in (m.headers() or [])}
                    out.append((m.key(), m.value(), hs))
            if len(out) >= n:
                break
    finally:
        leave_group(consumer, 10.0)  # not a bare close(): see leave_group
    return out  # type: ignore[return-value]


async def test_dead_letters_also_go_to_a_kafka_topic(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("payments", partitions=1)
    dlq = await kafka_topic("payments.dead", partitions=1)
    records = [(b"k1", b'{"card":"c1","amount":1}', []),
               (b"k2", b"not json", [("trace", b"t-2")]),
               (b"k3", b'{"amount":3}', [])]
    async with KafkaBridge(nc, bridge_config(tansu, topic, dead_letter_topic=dlq)) as bridge:
        await produce(tansu.bootstrap, topic, records)
        await wait_count(nc, NAMES, NAMES.dead_letter(topic), 2, settle_s=0.2)
    assert (bridge.stats.dead, bridge.stats.dead_to_kafka, bridge.stats.events) == (2, 2, 1)
    got = await asyncio.to_thread(_consume_all, tansu.bootstrap, dlq, 2)
    assert [(k, v) for k, v, _ in got] == [(b"k2", b"not json"), (b"k3", b'{"amount":3}')]
    assert got[0][2]["trace"] == b"t-2"
    assert got[0][2][KAFKA_DEAD_REASON].startswith(b"not JSON")
    assert got[0][2][KAFKA_DEAD_SOURCE] == f"{topic}:0:1".encode()
    assert got[1][2][KAFKA_DEAD_REASON].startswith(b"invalid")


class _ClosingSpy(Consumer):  # type: ignore[misc]
    """A consumer that notes when its `close()` has begun."""

    closing = False

    def close(self) -> None:
        self.closing = True
        super().close()


async def test_a_consumer_gives_its_partitions_back_before_it_closes(
    tansu: EmbeddedTansu, kafka_topic
) -> None:
    """librdkafka's close() revokes what is still assigned, and confluent-kafka's unassign
    there holds the GIL and can wait forever on a group already shutting down (a frozen
    process). `leave_group` has the revoke served by a poll while the group still runs."""
    topic = await kafka_topic("left", partitions=2)
    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(10)])
    revoked: list[tuple[list[int], bool]] = []
    consumer = _ClosingSpy({"bootstrap.servers": tansu.bootstrap, "group.id": "leaver",
                            "auto.offset.reset": "earliest", "session.timeout.ms": 2400,
                            "heartbeat.interval.ms": 400})
    consumer.subscribe([topic], on_revoke=lambda c, parts: revoked.append(
        ([tp.partition for tp in parts], c.closing)))

    def assigned() -> list[int]:
        for _ in range(300):
            consumer.poll(0.05)
            if consumer.assignment():
                break
        return sorted(tp.partition for tp in consumer.assignment())

    assert await asyncio.to_thread(assigned) == [0, 1]
    await asyncio.to_thread(leave_group, consumer, 10.0)
    assert revoked == [([0, 1], False)]  # revoked once, before close() began
    assert consumer.closing
    with pytest.raises(RuntimeError):  # and closed
        consumer.assignment()


async def test_consumer_lag_per_partition(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    topic = await kafka_topic("lagged", partitions=3)
    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(300)])
    async with KafkaBridge(nc, bridge_config(tansu, topic)) as bridge:
        await wait_count(nc, NAMES, NAMES.events(topic), 300, settle_s=1.2)
        registry = bridge.metrics.registry

        def lag(p: int) -> float | None:
            return registry.get_sample_value("plane_bridge_consumer_lag_records",
                                             {"topic": topic, "partition": str(p)})

        assert [lag(p) for p in range(3)] == [0.0, 0.0, 0.0]
        assert bridge.stats.first_record_s is not None
        assert registry.get_sample_value("plane_bridge_first_record_seconds") == (
            bridge.stats.first_record_s)


async def test_two_bridges_share_a_group_exactly_once(
    nc: Client, tansu: EmbeddedTansu, kafka_topic
) -> None:
    """A second bridge in the group takes partitions from the first (a rebalance while
    records flow); every record lands once, and each bridge reports lag only for its own."""
    topic = await kafka_topic("shared", partitions=4)
    subject = NAMES.events(topic)
    await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(1000)])
    async with KafkaBridge(nc, bridge_config(tansu, topic)) as first:
        await wait_count(nc, NAMES, subject, 1, settle_s=0)
        async with KafkaBridge(nc, bridge_config(tansu, topic)) as second:
            await second.wait_assigned()
            await produce(tansu.bootstrap, topic, [txn_line(i) for i in range(1000, 2000)])
            assert await wait_count(nc, NAMES, subject, 2000, settle_s=1.0) == 2000
            assert second.stats.events > 0

            def labels(b: KafkaBridge) -> set[str]:
                return {s.labels["partition"]
                        for m in b.metrics.registry.collect()
                        if m.name == "plane_bridge_consumer_lag_records" for s in m.samples}

            assert labels(first).isdisjoint(labels(second))
            assert labels(first) | labels(second) == {"0", "1", "2", "3"}
    assert first.stats.events + second.stats.events + first.stats.duplicates \
        + second.stats.duplicates >= 2000
    msgs = await subject_messages(nc, NAMES, subject)
    ids = [(m.headers[Header.KAFKA_PARTITION], m.headers[Header.KAFKA_OFFSET]) for m in msgs]
    assert len(ids) == len(set(ids)) == 2000


async def test_tansu_chooses_another_port_when_its_port_is_taken_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A port chosen free, then bound by something else (a connection's local port: bound,
    not listening) before tansu binds it: tansu exits, and the next try has another port."""
    import freshness.tansu as tansu_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        ports = iter([busy])
        monkeypatch.setattr(tansu_module, "free_port",
                            lambda: next(ports, None) or free_port())
        async with EmbeddedTansu() as kafka:
            assert kafka.port != busy
            _, w = await asyncio.open_connection("127.0.0.1", kafka.port)
            w.close()
            # The first try did meet the taken port (its log says so), the second started.
            assert any(b"AddrInUse" in line for line in kafka.log_tail)


def test_librdkafka_repeats_are_held_back_and_counted() -> None:
    """With a broker down librdkafka logged each failed connect, ~38 lines a second for as
    long as it lasted (found from outside): one line per facility per interval now, saying
    how many like it were held back."""
    held = RepeatsHeldBack(every_s=0.2)

    def line(facility: str) -> logging.LogRecord:
        return logging.LogRecord("freshness.librdkafka", logging.ERROR, __file__, 1,
                                 "%s [%s] %s", (facility, "rdkafka#consumer-1", "refused"),
                                 None)

    assert held.filter(line("FAIL"))
    assert not any(held.filter(line("FAIL")) for _ in range(5))
    assert held.filter(line("CONNECT"))  # another facility: its own count
    time.sleep(0.25)
    later = line("FAIL")
    assert held.filter(later) and "(5 like it not logged)" in str(later.msg)
