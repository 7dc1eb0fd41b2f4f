"""Per-card features in a real deployment, not only in `plane risk-demo`: `plane bridge` and
`plane features` as processes beside a plane, and `--on-stale` on the serving commands.
Found from outside: nothing but the demo ran the feature updater, so in `plane up` + `plane
bridge` every card request held its slot until its deadline and was answered degraded, and
`plane node`/`plane up` could not be told to degrade at once. Real nats-server and tansu."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kafka_fixtures import kafka_topic, produce, start_bridge_process, tansu
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.errors import KeyNotFoundError
from structlog.testing import capture_logs

from freshness import guard as guard_module
from freshness.config import GuardConfig, OnStale, UpdaterConfig
from freshness.features import FeatureUpdater, UpdaterRunning
from freshness.guard import FRESHNESS_KEY, CardFeatureGuard
from freshness.provision import ensure_config_bucket, ensure_features_bucket
from freshness.tansu import EmbeddedTansu
from plane.contract.embedded import EmbeddedNats
from plane.contract.subjects import Header, Names
from tests.plane_fixtures import RISK_BODY, header, plane, status, wait_until

__all__ = ["kafka_topic", "tansu"]  # fixtures, imported for pytest

NAMES = Names()
REPO = Path(__file__).resolve().parent.parent
PLANE = str(Path(sys.executable).parent / "plane")
TOPIC = "transactions"


@contextlib.asynccontextmanager
async def command(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A `plane` command as a child process, stopped by its PID (SIGTERM) at the end."""
    proc = await asyncio.create_subprocess_exec(
        PLANE, *args, cwd=REPO, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await proc.communicate()


def card_request(card: str | None) -> bytes:
    """A risk request; with a card, the guard adds that card's features."""
    body: dict[str, object] = {"features": [0.01 * i for i in range(32)]}
    if card is not None:
        body["card"] = card
    return json.dumps(body).encode()


def card_line(card: str, amount: float) -> str:
    return f'{card}:{{"card":"{card}","amount":{amount},"merchant":"m1","features":[0.5]}}'


async def call(nc: Client, body: bytes, deadline_ms: int) -> Msg:
    return await nc.request(NAMES.infer("risk"), body, timeout=5,
                            headers={Header.DEADLINE_MS: str(deadline_ms)})


async def test_bridged_card_transactions_reach_the_guard_through_plane_features(
    nats_server: EmbeddedNats, nc: Client, tansu: EmbeddedTansu, kafka_topic: Any
) -> None:
    """The deployment as compose runs it: a plane with its risk node's guard on (as `plane
    up`), `plane bridge`, and now `plane features`. A card whose transactions were bridged is
    answered fresh, with its features added; one without any is still degraded."""
    await kafka_topic(TOPIC, partitions=1)
    # The freshness threshold is raised (live, as an operator would): the check is that the
    # features arrive at all, not how fast this shared host moves them (age at use counts
    # from the newest ingest; a quiet test stream is older than 100 ms within moments).
    config = await ensure_config_bucket(nc.jetstream(), NAMES)
    await config.put(FRESHNESS_KEY, b"60000")
    async with plane(nats_server.url, models=("risk",), slots=1, freshness=True), \
            command("features", "--topic", TOPIC, "--nats", nats_server.url) as features:
        bridge = await start_bridge_process(nats_server.url, tansu.bootstrap, TOPIC)
        try:
            await produce(tansu.bootstrap, TOPIC, [card_line("c1", 120.5),
                                                   card_line("c2", 9.0)])
            kv = await ensure_features_bucket(nc.jetstream(), NAMES)

            async def has_c1() -> bool:
                with contextlib.suppress(KeyNotFoundError):
                    return bool((await kv.get("c1")).value)
                return False

            await wait_until(has_c1, 60, "card c1's features in PLANE_FEATURES")
            # The node's guard watches the bucket: the value is there within moments.
            fresh: Msg | None = None
            async with asyncio.timeout(10):
                while fresh is None:
                    m = await call(nc, card_request("c1"), 200)
                    if header(m, Header.FRESHNESS) == "fresh":
                        fresh = m
                    else:
                        await asyncio.sleep(0.1)
            assert status(fresh) == 200
            nobody = await call(nc, card_request("nobody"), 200)
            assert status(nobody) == 200 and header(nobody, Header.FRESHNESS) == "degraded"
            # c1's features went into the score: not the score of the same body without them.
            no_card = await call(nc, card_request(None), 200)
            assert json.loads(fresh.data)["score"] != json.loads(no_card.data)["score"]
        finally:
            bridge.send_signal(signal.SIGTERM)
            await bridge.communicate()
    assert features.returncode == 0  # stopped cleanly by its SIGTERM


async def test_a_second_feature_updater_of_a_topic_refuses_to_start(nc: Client) -> None:
    """Two would each write a card's whole value from their own view of it, and lose each
    other's events: the second says so, and the first goes on."""
    cfg = UpdaterConfig(topic=TOPIC, names=NAMES)
    async with FeatureUpdater(nc, cfg) as first:
        with pytest.raises(UpdaterRunning, match="run one per topic"):
            await FeatureUpdater(nc, cfg).start()
        assert first._task is not None and not first._task.done()
    # Stopped, it leaves no pull behind for long: the next one starts.
    await asyncio.sleep(cfg.fetch_timeout_s * 3)
    async with FeatureUpdater(nc, cfg):
        pass


async def test_plane_node_on_stale_degrade_answers_a_card_without_data_at_once(
    nats_server: EmbeddedNats, nc: Client
) -> None:
    """`plane node --on-stale degrade`: a card request with no features is answered at once
    (the default, `wait`, holds the slot until the deadline less its reserve)."""
    url = nats_server.url
    async with command("router", "--nats", url, "--log-level", "warning") as router, \
            command("node", "--nats", url, "--model", "risk", "--slots", "1",
                    "--on-stale", "degrade", "--log-level", "warning") as node:

        async def served() -> bool:
            assert router.returncode is None and node.returncode is None, "a command exited"
            with contextlib.suppress(TimeoutError, NoRespondersError):  # not up yet
                return status(await call(nc, RISK_BODY, 1000)) == 200
            return False

        await wait_until(served, 120, "plane node and plane router to serve risk")
        m = await call(nc, card_request("no-such-card"), 400)
        assert status(m) == 200 and header(m, Header.FRESHNESS) == "degraded"
        # Waiting would have held it ~395 ms; degrading takes the scoring only.
        assert int(header(m, Header.SERVICE_US) or 0) < 200_000


async def test_stack_on_stale_reaches_the_guard(nats_server: EmbeddedNats, nc: Client) -> None:
    """`plane up --on-stale` is the stack's `on_stale`: the same answer at once."""
    async with plane(nats_server.url, models=("risk",), slots=1, freshness=True,
                     on_stale=OnStale.DEGRADE):
        assert status(await call(nc, RISK_BODY, 1000)) == 200  # a warm slot
        m = await call(nc, card_request("no-such-card"), 400)
        assert status(m) == 200 and header(m, Header.FRESHNESS) == "degraded"
        assert int(header(m, Header.SERVICE_US) or 0) < 200_000


async def test_the_guard_says_when_the_feature_pipeline_is_quiet(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Degraded card lookups with nothing written to the bucket for a while: one warning
    naming what to run (and, with `wait`, what each such request costs)."""
    monkeypatch.setattr(guard_module, "PIPELINE_QUIET_S", 0.0)
    cfg = GuardConfig(on_stale=OnStale.DEGRADE)
    with capture_logs() as logs:
        async with CardFeatureGuard(nc, NAMES, cfg) as guard:
            for _ in range(3):
                await guard.lookup("c1", time.monotonic() + 0.05)
    quiet = [e for e in logs if "feature pipeline running" in e["event"]]
    assert len(quiet) == 1, quiet  # once a minute, not per request
    assert "plane features --topic" in quiet[0]["event"]
    assert quiet[0]["any_value"] is False
