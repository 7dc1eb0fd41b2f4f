"""`run_bridge`: the bridge as a process (connect, bridge until SIGINT/SIGTERM, stop in
stages). Signals are handled here, at the application edge, and only set an event."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import structlog

from freshness.bridge import KafkaBridge
from freshness.config import BridgeConfig
from freshness.metrics import BridgeMetrics
from plane.config import ConnectOptions
from plane.metrics import PlaneMetrics, serve_metrics
from plane.natsconn import connect

log = structlog.get_logger("freshness.run")


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


async def run_bridge(
    config: BridgeConfig, opts: ConnectOptions, *, metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> None:
    stop = asyncio.Event()
    stop_on_signals(stop)
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
                    stopped.cancel()
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await stopped
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
    finally:
        await nc.drain()
