"""Create (or update) the streams and buckets the plane relies on. Idempotent: every command
calls it at start, so whichever process comes first sets the broker up."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from plane.contract.subjects import Names

log = structlog.get_logger("plane.contract.provision")

# A slot message never lives longer than this (the per-message TTL is the deadline; this is
# the backstop for a message published without one).
SLOT_MAX_AGE_S = 600.0


@dataclass(frozen=True, kw_only=True)
class ProvisionPlan:
    names: Names
    replicas: int = 1
    slots_storage: StorageType = StorageType.MEMORY
    advert_ttl_s: float = 5.0


def slot_stream_config(plan: ProvisionPlan, node: str | None = None) -> StreamConfig:
    """The depth-one stream: WorkQueue, one message per subject, refuse the second."""
    n = plan.names
    subjects = [n.slots_all()] if node is None else [n.node_slots(node)]
    return StreamConfig(
        name=n.slots_stream if node is None else n.slot_stream_for(node),
        subjects=subjects,
        retention=RetentionPolicy.WORK_QUEUE,
        storage=plan.slots_storage,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        allow_msg_ttl=True,
        max_age=SLOT_MAX_AGE_S,
        num_replicas=plan.replicas,
    )


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create the stream; if it exists with another config, raise its replicas to ours but
    never lower them (a single-replica process must not downgrade a cluster's stream), and
    leave the rest as the first creator set it."""
    try:
        await js.add_stream(cfg)
    except BadRequestError:
        assert cfg.name is not None
        have = (await js.stream_info(cfg.name)).config
        if (cfg.num_replicas or 1) > (have.num_replicas or 1):
            have.num_replicas = cfg.num_replicas
            await js.update_stream(have)
        elif (cfg.num_replicas or 1) < (have.num_replicas or 1):
            log.info("stream keeps its replicas", stream=cfg.name, replicas=have.num_replicas)


async def ensure_slot_stream(js: JetStreamContext, plan: ProvisionPlan) -> None:
    await _ensure_stream(js, slot_stream_config(plan))


async def ensure_buckets(js: JetStreamContext, plan: ProvisionPlan) -> tuple[KeyValue, KeyValue]:
    """The node-advert bucket (short TTL) and the live-settings bucket."""
    n = plan.names
    nodes = await ensure_kv(
        js,
        KeyValueConfig(
            bucket=n.nodes_bucket,
            history=1,
            ttl=plan.advert_ttl_s,
            storage=StorageType.MEMORY,
            replicas=plan.replicas,
        ),
    )
    config = await ensure_config_bucket(js, n, replicas=plan.replicas)
    return nodes, config


async def ensure_config_bucket(js: JetStreamContext, names: Names, *,
                               replicas: int = 1) -> KeyValue:
    """The live-settings bucket (`plane.contract.settings`), the same from every process."""
    return await ensure_kv(js, KeyValueConfig(bucket=names.config_bucket, history=5,
                                              storage=StorageType.FILE, replicas=replicas))


async def ensure_kv(js: JetStreamContext, cfg: KeyValueConfig) -> KeyValue:
    """Bind to bucket `cfg.bucket`, creating it with `cfg` when it is missing (another
    process creating it at the same moment is fine)."""
    try:
        return await js.key_value(cfg.bucket)
    except (BucketNotFoundError, NotFoundError, BadRequestError):
        try:
            return await js.create_key_value(cfg)
        except BadRequestError:  # created meanwhile by another process
            return await js.key_value(cfg.bucket)


async def ensure_all(js: JetStreamContext, plan: ProvisionPlan) -> tuple[KeyValue, KeyValue]:
    await ensure_slot_stream(js, plan)
    return await ensure_buckets(js, plan)


class Reprovisioner:
    """Provisions again after a reconnect or a publish that found no slot stream, one run at a
    time: every request that finds no stream asks for it, and hundreds of concurrent
    provisioners (150/s for the seconds a cluster has no leader) would flood JetStream's API
    just as it recovers. A call while a run is under way returns at once; that run asks
    until JetStream answers (`tries` x `wait_s`)."""

    def __init__(self, js: JetStreamContext, plan: ProvisionPlan, *, who: str = "",
                 tries: int = 50, wait_s: float = 0.2) -> None:
        self._js, self._plan, self._who = js, plan, who
        self._tries, self._wait_s = tries, wait_s
        self._running = False
        self.attempts = 0  # ensure_all calls made, over all runs

    async def again(self) -> KeyValue | None:
        """The node-advert bucket once provisioned; None when JetStream never answered or
        another run is already under way."""
        if self._running:
            return None
        self._running = True
        log.warning("re-provisioning", process=self._who)
        try:
            for _ in range(self._tries):
                self.attempts += 1
                try:
                    nodes_kv, _ = await ensure_all(self._js, self._plan)
                    return nodes_kv
                except Exception as exc:
                    log.info("re-provisioning waits for JetStream", error=repr(exc))
                    await asyncio.sleep(self._wait_s)
            log.error("re-provisioning gave up: JetStream did not answer",
                      tries=self._tries, within_s=self._tries * self._wait_s)
            return None
        finally:
            self._running = False
