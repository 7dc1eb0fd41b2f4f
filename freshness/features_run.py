"""`run_features`: the feature updater as a process (`plane features`): connect, keep the
per-card features of each topic current until SIGINT/SIGTERM, finish the rounds in flight.
Signals are handled here, at the application edge, and only set an event."""

from __future__ import annotations

import contextlib

import structlog

from freshness.config import UpdaterConfig
from freshness.features import FeatureUpdater
from plane.contract.config import ConnectOptions
from plane.contract.lifecycle import stop_event
from plane.contract.natsconn import close, connect

log = structlog.get_logger("freshness.features")


async def run_features(configs: list[UpdaterConfig], opts: ConnectOptions) -> int:
    stop = stop_event()
    nc = await connect(opts)
    try:
        async with contextlib.AsyncExitStack() as stack:
            updaters = [await stack.enter_async_context(FeatureUpdater(nc, cfg))
                        for cfg in configs]
            log.info("feature updater started", topics=[c.topic for c in configs],
                     bucket=configs[0].names.features_bucket)
            await stop.wait()
        log.info("feature updater stopped",
                 applied={u.cfg.topic: u.applied for u in updaters},
                 skipped={u.cfg.topic: u.skipped for u in updaters})
    finally:
        await close(nc)
    return 0
