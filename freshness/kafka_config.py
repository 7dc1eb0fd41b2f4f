"""How the bridge reaches Kafka: security (TLS, SASL) and where it starts, validated on
construction and turned into librdkafka settings (confluent-kafka) in one place.

    KafkaSecurity(sasl_mechanism=SaslMechanism.SCRAM_SHA_512, sasl_username="bridge",
                  sasl_password="...", ssl_ca_file="/etc/ssl/msk-ca.pem")

gives `security.protocol=SASL_SSL` (MSK with SCRAM, Confluent Cloud with PLAIN). The protocol
follows from the options unless given: a SASL mechanism means SASL over TLS, TLS files alone
mean TLS, nothing means plaintext. SASL without TLS (`SASL_PLAINTEXT`) must be asked for by
name: PLAIN then sends the password in clear.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from plane.contract.errors import ConfigError


class SecurityProtocol(enum.StrEnum):
    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"

    @property
    def sasl(self) -> bool:
        return self in (SecurityProtocol.SASL_PLAINTEXT, SecurityProtocol.SASL_SSL)

    @property
    def tls(self) -> bool:
        return self in (SecurityProtocol.SSL, SecurityProtocol.SASL_SSL)


class SaslMechanism(enum.StrEnum):
    PLAIN = "PLAIN"
    SCRAM_SHA_256 = "SCRAM-SHA-256"
    SCRAM_SHA_512 = "SCRAM-SHA-512"


class StartFrom(enum.StrEnum):
    """Where the bridge starts reading a partition it is assigned.

    `committed`: the group's committed offset (where the last bridge of the group stopped);
    the beginning where there is none. `earliest` / `latest`: the beginning / the end of each
    partition the first time this process is assigned it, whatever the group committed
    (replay everything / skip the backlog); later assignments of the same partition (after a
    rebalance) resume from the committed offset as usual.
    """

    COMMITTED = "committed"
    EARLIEST = "earliest"
    LATEST = "latest"


@dataclass(frozen=True, kw_only=True)
class KafkaSecurity:
    """TLS and SASL towards the Kafka brokers. Files are checked when the object is built,
    so that a typo fails at start with its path, not as a TLS error on every reconnect."""

    protocol: SecurityProtocol | None = None  # None: follows from the other options
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_ca_file: str | None = None  # CA bundle for the brokers' certificates (default: system)
    ssl_cert_file: str | None = None  # client certificate (mutual TLS)
    ssl_key_file: str | None = None  # its private key
    ssl_key_password: str | None = None
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        protocol = self.effective_protocol
        has_user = self.sasl_username is not None or self.sasl_password is not None
        if protocol.sasl:
            if self.sasl_mechanism is None:
                raise ConfigError(
                    f"Kafka security {protocol.value} needs --kafka-sasl-mechanism "
                    "(PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)")
            if not self.sasl_username or not self.sasl_password:
                raise ConfigError(
                    f"SASL {self.sasl_mechanism.value} needs --kafka-sasl-username and "
                    "--kafka-sasl-password (or PLANE_KAFKA_SASL_PASSWORD)")
        elif self.sasl_mechanism is not None or has_user:
            raise ConfigError(
                f"SASL options given with Kafka security {protocol.value}: use SASL_SSL "
                "(or SASL_PLAINTEXT), or drop the SASL options")
        tls_files = (self.ssl_ca_file, self.ssl_cert_file, self.ssl_key_file)
        if not protocol.tls and (any(f is not None for f in tls_files)
                                 or self.ssl_key_password is not None):
            raise ConfigError(
                f"TLS options given with Kafka security {protocol.value}: use SSL or "
                "SASL_SSL, or drop the TLS options")
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ConfigError("a Kafka client certificate needs its key, and a key its "
                              "certificate (--kafka-tls-cert with --kafka-tls-key)")
        for path in tls_files:
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"Kafka TLS file not found: {path}")

    @property
    def effective_protocol(self) -> SecurityProtocol:
        if self.protocol is not None:
            return self.protocol
        if self.sasl_mechanism is not None:
            return SecurityProtocol.SASL_SSL
        if any(f is not None for f in (self.ssl_ca_file, self.ssl_cert_file,
                                       self.ssl_key_file)):
            return SecurityProtocol.SSL
        return SecurityProtocol.PLAINTEXT

    @property
    def password_in_clear(self) -> bool:
        """PLAIN over a connection without TLS: the password crosses the network as is."""
        return (self.effective_protocol is SecurityProtocol.SASL_PLAINTEXT
                and self.sasl_mechanism is SaslMechanism.PLAIN)

    def librdkafka(self) -> dict[str, str]:
        """The librdkafka settings (`security.protocol`, `sasl.*`, `ssl.*`)."""
        protocol = self.effective_protocol
        conf = {"security.protocol": protocol.value}
        if protocol.sasl:
            assert self.sasl_mechanism is not None  # checked in __post_init__
            conf["sasl.mechanism"] = self.sasl_mechanism.value
            conf["sasl.username"] = self.sasl_username or ""
            conf["sasl.password"] = self.sasl_password or ""
        if protocol.tls:
            conf["ssl.endpoint.identification.algorithm"] = (
                "https" if self.ssl_check_hostname else "none")
            optional = {
                "ssl.ca.location": self.ssl_ca_file,
                "ssl.certificate.location": self.ssl_cert_file,
                "ssl.key.location": self.ssl_key_file,
                "ssl.key.password": self.ssl_key_password,
            }
            conf.update({k: v for k, v in optional.items() if v is not None})
        return conf

    def __repr__(self) -> str:  # never print a password
        return (f"KafkaSecurity(protocol={self.effective_protocol.value}, "
                f"sasl_mechanism={self.sasl_mechanism}, sasl_username={self.sasl_username!r}, "
                f"ssl_ca_file={self.ssl_ca_file!r}, ssl_cert_file={self.ssl_cert_file!r})")
