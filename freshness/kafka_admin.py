"""Kafka topic administration the demo, the tests and the benchmark need (confluent-kafka's
admin client; its calls block, so they run in a worker thread)."""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # re-exported by .admin without __all__

from freshness.kafka_client import client_config, new_client
from freshness.kafka_config import KafkaSecurity
from plane.contract.errors import Unavailable


class KafkaUnreachable(Unavailable, TimeoutError):
    """No Kafka broker answered at `bootstrap` in time: check the address and that a broker
    runs there. A PlaneError, so that a command says it in one line (it was a bare
    TimeoutError's traceback); a TimeoutError still, for callers that wait on it as one."""

    def __init__(self, message: str, *, bootstrap: str) -> None:
        super().__init__(message)
        self.bootstrap = bootstrap


def _ensure(bootstrap: str, topics: list[str], partitions: int, security: KafkaSecurity,
            timeout_s: float) -> None:
    admin = new_client(AdminClient, client_config(bootstrap, security))
    deadline = time.monotonic() + timeout_s
    while True:
        left_s = deadline - time.monotonic()
        try:
            existing = set(admin.list_topics(timeout=max(left_s, 0.1)).topics)
        except KafkaException:
            if left_s <= 0:
                raise KafkaUnreachable(
                    f"no Kafka broker answered at {bootstrap} within {timeout_s:g} s: check "
                    "the address (--kafka or PLANE_KAFKA, HOST:PORT), that a broker runs "
                    "there, and that this host reaches it (its advertised listeners, a "
                    "firewall)", bootstrap=bootstrap) from None
            time.sleep(0.2)
            continue
        new = [NewTopic(t, num_partitions=partitions, replication_factor=1)
               for t in topics if t not in existing]
        if not new:
            return
        for future in admin.create_topics(new, operation_timeout=left_s).values():
            try:
                future.result()
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        return


async def ensure_topics(
    bootstrap: str, topics: list[str], *, partitions: int = 3, timeout_s: float = 15.0,
    security: KafkaSecurity | None = None,
) -> None:
    """Create the topics that do not exist yet (replication factor 1); KafkaUnreachable
    when no broker answers within `timeout_s`."""
    await asyncio.to_thread(_ensure, bootstrap, topics, partitions,
                            security or KafkaSecurity(), timeout_s)
