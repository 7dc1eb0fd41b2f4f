"""Real-broker fixtures for the freshness tests: tansu (Kafka) on a free loopback port,
stopped by PID; `kcat` to produce records the way an outside producer would; helpers that
read everything a JetStream subject holds.

A test module imports the fixtures it uses by name (`from kafka_fixtures import tansu`):
pytest finds fixtures in the module's namespace.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from freshness.kafka_admin import ensure_topics
from freshness.tansu import EmbeddedTansu, TansuSpec
from plane.subjects import Names

REPO = Path(__file__).resolve().parent.parent
PLANE = str(Path(sys.executable).parent / "plane")
# Short Kafka sessions: a group join on tansu takes about half of it.
SESSION_TIMEOUT_MS = 2400


def kcat_or_skip() -> str:
    """kcat's path; skips locally when it is missing, fails in CI (CI=true)."""
    found = shutil.which("kcat")
    if found is None:
        msg = "kcat not installed: run `sudo scripts/setup-system.sh`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return found


@pytest.fixture
async def tansu() -> AsyncIterator[EmbeddedTansu]:
    """tansu behind the librdkafka shim, so that kcat and aiokafka can both use it."""
    async with EmbeddedTansu(TansuSpec(librdkafka_compat=True)) as kafka:
        yield kafka


@pytest.fixture
def kafka_topic(tansu: EmbeddedTansu) -> Callable[..., Awaitable[str]]:
    async def make(name: str = "transactions", partitions: int = 3) -> str:
        await ensure_topics(tansu.bootstrap, [name], partitions=partitions)
        return name

    return make


async def kcat_produce(bootstrap: str, topic: str, lines: Sequence[str]) -> None:
    """Produce one record per line with kcat; `key:value` lines carry a key."""
    kcat = kcat_or_skip()
    proc = await asyncio.create_subprocess_exec(
        kcat, "-P", "-b", bootstrap, "-t", topic, "-K:", "-X", "linger.ms=5",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    data = ("\n".join(lines) + "\n").encode()
    _out, err = await asyncio.wait_for(proc.communicate(data), 60)
    assert proc.returncode == 0, f"kcat failed ({proc.returncode}): {err.decode()[-2000:]}"


def txn_line(i: int, card: str | None = None) -> str:
    card = card or f"card{i % 17}"
    return f'{card}:{{"card":"{card}","amount":{i}.5,"merchant":"m{i % 5}","features":[{i}]}}'


async def subject_messages(nc: Client, names: Names, subject: str) -> list[Msg]:
    """Every message the events stream holds on `subject` (an ephemeral pull consumer)."""
    js = nc.jetstream()
    info = await js.stream_info(names.events_stream, subjects_filter=subject)
    total = (info.state.subjects or {}).get(subject, 0)
    if total == 0:
        return []
    sub = await js.pull_subscribe(
        subject, stream=names.events_stream,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                              inactive_threshold=10.0),
    )
    out: list[Msg] = []
    try:
        while len(out) < total:
            out += await sub.fetch(min(1000, total - len(out)), timeout=5)
    finally:
        await sub.unsubscribe()
    return out


async def subject_count(nc: Client, names: Names, subject: str) -> int:
    try:
        info = await nc.jetstream().stream_info(names.events_stream, subjects_filter=subject)
    except NotFoundError:  # the bridge has not created the stream yet
        return 0
    return (info.state.subjects or {}).get(subject, 0)


async def wait_count(
    nc: Client, names: Names, subject: str, n: int, *, timeout_s: float = 30.0,
    settle_s: float = 0.5,
) -> int:
    """Wait until `subject` holds at least `n` messages, then `settle_s` more (so that an
    extra message, a duplicate, would show); returns the final count."""
    async with asyncio.timeout(timeout_s):
        # Polling the broker's state: there is no event to wait on.
        while await subject_count(nc, names, subject) < n:
            await asyncio.sleep(0.05)
    await asyncio.sleep(settle_s)
    return await subject_count(nc, names, subject)


async def start_bridge_process(
    nats_url: str, bootstrap: str, topic: str, *extra: str
) -> asyncio.subprocess.Process:
    """`plane bridge` as a child process (so that a test can SIGKILL it)."""
    return await asyncio.create_subprocess_exec(
        PLANE, "bridge", "--kafka", bootstrap, "--topic", topic, "--nats", nats_url,
        "--log-level", "warning", "--session-timeout-ms", str(SESSION_TIMEOUT_MS), *extra,
        cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
