"""`run_bridge`: the bridge as a process (connect, bridge until SIGINT/SIGTERM, stop in
stages). Signals are handled here, at the application edge, and only set an event."""

from __future__ import annotations

import asyncio

import structlog

from freshness.bridge import KafkaBridge
from freshness.config import BridgeConfig
from freshness.metrics import BridgeMetrics
from plane.contract.config import ConnectOptions
from plane.contract.lifecycle import cancel_and_wait, stop_event
from plane.contract.metrics import PlaneMetrics, serve_metrics
from plane.contract.natsconn import close, connect

log = structlog.get_logger("freshness.run")


async def run_bridge(
    config: BridgeConfig, opts: ConnectOptions, *, metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> None:
    stop = stop_event()
    plane_metrics = PlaneMetrics()
    metrics = BridgeMetrics(plane_metrics.registry)
    nc = await connect(opts)
    try:
        with serve_metrics(plane_metrics, metrics_port, metrics_host):
            async with KafkaBridge(nc, config, metrics=metrics) as bridge:
                stopped = asyncio.create_task(stop.wait())
                running = asyncio.create_task(bridge.wait())
                try:
                    await asyncio.wait({stopped, running}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    await cancel_and_wait(stopped)
                    await cancel_and_wait(running)
    finally:
        await close(nc)
