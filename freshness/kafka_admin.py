"""Kafka topic administration the demo and the tests need (aiokafka's admin client)."""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError


async def ensure_topics(
    bootstrap: str, topics: list[str], *, partitions: int = 3, timeout_s: float = 15.0
) -> None:
    """Create the topics that do not exist yet (replication factor 1)."""
    async with asyncio.timeout(timeout_s):
        while True:
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
            try:
                await admin.start()
                existing = set(await admin.list_topics())
                new = [NewTopic(t, num_partitions=partitions, replication_factor=1)
                       for t in topics if t not in existing]
                if new:
                    with contextlib.suppress(TopicAlreadyExistsError):
                        await admin.create_topics(new)
                return
            except KafkaConnectionError:
                await asyncio.sleep(0.2)
            finally:
                await admin.close()
