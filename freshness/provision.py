"""The stream and buckets of the freshness path, created or brought up to date at start
(idempotent: bridge, updater and guard each call what they need)."""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from plane.contract.provision import ensure_config_bucket, ensure_kv
from plane.contract.subjects import Names

__all__ = ["ensure_config_bucket", "ensure_events_stream", "ensure_features_bucket",
           "events_stream_config"]


def events_stream_config(
    names: Names, *, duplicate_window_s: float = 600.0, max_age_s: float = 24 * 3600.0,
    replicas: int = 1,
) -> StreamConfig:
    """File storage: bridged events and dead letters survive a broker restart."""
    return StreamConfig(
        name=names.events_stream,
        subjects=[names.events_all(), names.dead_letter_all()],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=duplicate_window_s,
        max_age=max_age_s,
        num_replicas=replicas,
    )


async def ensure_events_stream(
    js: JetStreamContext, cfg: StreamConfig, *, update: bool = True
) -> None:
    """Create the stream if missing; with `update` (the bridge, which owns its settings),
    also bring an existing one to `cfg`."""
    try:
        info = await js.stream_info(cfg.name or "")
    except NotFoundError:
        with contextlib.suppress(BadRequestError):  # created meanwhile by another process
            await js.add_stream(cfg)
        return
    differs = set(info.config.subjects or []) != set(cfg.subjects or []) or (
        info.config.duplicate_window != cfg.duplicate_window
    )
    if update and differs:
        await js.update_stream(cfg)


async def ensure_features_bucket(js: JetStreamContext, names: Names, *,
                                 replicas: int = 1) -> KeyValue:
    """Per-card features: written by the feature updater, watched by risk nodes' guards;
    whichever starts first creates it (with `replicas`: 3 in a cluster, as the rest)."""
    return await ensure_kv(
        js, KeyValueConfig(bucket=names.features_bucket, history=1, storage=StorageType.FILE,
                           replicas=replicas)
    )
