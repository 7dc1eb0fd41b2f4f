"""Create (or update) the streams and buckets the plane relies on. Idempotent: every command
calls it at start, so whichever process comes first sets the broker up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from plane.contract.config import MAX_SLOTS
from plane.contract.errors import ConfigError, Unavailable
from plane.contract.subjects import MAX_SLOT_SHARDS, Names

log = structlog.get_logger("plane.contract.provision")
T = TypeVar("T")

# nats-server's error code for a stream whose subjects another stream holds.
SUBJECTS_OVERLAP = 10065
# A slot message never lives longer than this (the per-message TTL is the deadline; this is
# the backstop for a message published without one).
SLOT_MAX_AGE_S = 600.0
# JetStream's "temporarily unavailable" (no meta leader yet).
JS_TEMPORARILY_UNAVAILABLE = 10008
# A lone server's answer to a stream or bucket of more than one replica: "replicas > 1 not
# supported in non-clustered mode".
REPLICAS_NOT_CLUSTERED = 10074
# A process that starts while one of the plane's replicated streams has no leader (a cluster
# elects one 4-9 s after a server died) finds JetStream's API silent for it: its start asks
# again for this long before it gives up, with an error that says what to check.
START_WITHIN_S = 30.0
START_RETRY_S = 0.5


@dataclass(frozen=True, kw_only=True)
class ProvisionPlan:
    names: Names
    replicas: int = 1
    slots_storage: StorageType = StorageType.MEMORY
    advert_ttl_s: float = 5.0
    # How many streams the slots are spread over; None: one on a single server, one per
    # replica in a cluster (see `slot_shards`).
    slot_shards: int | None = None


def slot_shards(plan: ProvisionPlan) -> int:
    """One slot stream on a single server. In a cluster, one per replica: each stream has
    its own leader (JetStream elects them apart), so a dead server stops the slots of the
    streams it led, for the 4-9 s of their elections, not every slot of the plane (one shared
    stream led from it was a 6-7 s outage of the whole plane: `tests/test_cluster.py`)."""
    if plan.slot_shards is not None:
        if not 1 <= plan.slot_shards <= MAX_SLOT_SHARDS:
            raise ValueError(f"slot_shards must be between 1 and {MAX_SLOT_SHARDS}")
        return plan.slot_shards
    return 1 if plan.replicas <= 1 else min(plan.replicas, MAX_SLOT_SHARDS)


def slot_stream_configs(plan: ProvisionPlan) -> list[StreamConfig]:
    """The depth-one streams: WorkQueue, one message per subject, refuse the second.

    One stream `<PREFIX>_SLOTS` holds every slot subject, or shard i (`<PREFIX>_SLOTS_<i>`)
    holds slot k of every node where k mod shards = i: a subject token cannot be matched in
    part, so each shard lists its slot numbers (up to `MAX_SLOTS`). By slot number, not by
    node, so that each node (and each model, even with one node) keeps slots in every shard
    while one shard's leader is being elected. Routers and nodes never compute which stream
    holds a slot: a node asks the broker (`stream_of_subject`) and advertises it."""
    n = plan.names
    shards = slot_shards(plan)
    if shards == 1:
        layout = [(n.slots_stream, [n.slots_all()])]
    else:
        layout = [(n.slot_shard_stream(i), [n.slots_numbered(k)
                                            for k in range(i, MAX_SLOTS, shards)])
                  for i in range(shards)]
    return [
        StreamConfig(
            name=name,
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
        for name, subjects in layout
    ]


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> bool:
    """Create the stream; if it exists with another config, raise its replicas to ours (see
    `_raise_replicas`) and leave the rest as the first creator set it. False when another
    stream already holds its subjects (the layout is someone else's: leave it)."""
    try:
        await js.add_stream(cfg)
    except BadRequestError as exc:
        if exc.err_code == SUBJECTS_OVERLAP:
            return False
        assert cfg.name is not None
        await _raise_replicas(js, (await js.stream_info(cfg.name)).config, cfg.num_replicas or 1)
    return True


async def _raise_replicas(js: JetStreamContext, have: StreamConfig, replicas: int) -> None:
    """Raise a stream's replicas to `replicas`, never lower them (a single-replica process
    must not downgrade a cluster's stream)."""
    if replicas > (have.num_replicas or 1):
        have.num_replicas = replicas
        await js.update_stream(have)
    elif replicas < (have.num_replicas or 1):
        log.info("stream keeps its replicas", stream=have.name, replicas=have.num_replicas)


async def ensure_slot_stream(js: JetStreamContext, plan: ProvisionPlan) -> None:
    """The slot streams as the plan lays them out, unless the broker holds the slot subjects
    in another layout already: the first creator's stands (the shared stream of an older
    version or of a process started without `--replicas`, another shard count), with its
    replicas raised to ours as for any stream; nodes find theirs by subject either way."""
    for cfg in slot_stream_configs(plan):
        if not await _ensure_stream(js, cfg):
            log.info("slot streams keep their layout", wanted=cfg.name)
            for _, info in await slot_stream_infos(js, plan.names):
                if isinstance(info, Exception):
                    raise info
                await _raise_replicas(js, info.config, plan.replicas)
            return


async def slot_stream_infos(js: JetStreamContext,
                            names: Names) -> list[tuple[str, StreamInfo | Exception]]:
    """Each of the plane's slot streams that exists, asked at once: its info, or what asking
    raised (in a cluster, most often no leader yet). One that does not exist (another layout,
    a shard count below the most) is left out."""
    async def one(name: str) -> tuple[str, StreamInfo | Exception] | None:
        try:
            return name, await js.stream_info(name)
        except NotFoundError:
            return None
        except Exception as exc:
            return name, exc

    found = await asyncio.gather(*(one(n) for n in names.slot_streams()))
    return [f for f in found if f is not None]


async def stream_of_subject(js: JetStreamContext, subject: str) -> str:
    """The slot stream that holds `subject`, as the broker says."""
    try:
        return await js.find_stream_name_by_subject(subject)
    except NotFoundError:
        raise NotFoundError(description=f"no stream holds {subject}: provision the plane's "
                            "streams (every plane command does at start)") from None


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


def jetstream_busy(exc: BaseException) -> bool:
    """Whether `exc` says JetStream cannot answer yet (a stream's or the meta leader being
    elected: no answer in time, no responders, 503), not that what was asked is wrong."""
    if isinstance(exc, TimeoutError | NoRespondersError | ServiceUnavailableError):
        return True  # (nats-py's TimeoutError is a TimeoutError)
    return isinstance(exc, APIError) and (
        exc.code == 503 or exc.err_code == JS_TEMPORARILY_UNAVAILABLE)


def replicas_need_a_cluster(exc: BaseException) -> ConfigError | None:
    """The error to raise for `exc` when it is a lone server refusing replicas (`--replicas`
    above 1 against a server with no cluster: one server cannot keep copies on others), else
    None. What a user must change is the flag or the server, so it says both."""
    if not (isinstance(exc, APIError) and exc.err_code == REPLICAS_NOT_CLUSTERED):
        return None
    return ConfigError(
        "the NATS server runs JetStream without a cluster, and a lone server keeps one copy "
        f"of a stream (it answered {exc.description!r}): give --replicas 1 (the default), or "
        "connect to a JetStream cluster of at least --replicas servers")


async def at_start(make: Callable[[], Awaitable[T]], *, who: str,
                   what: str = "provisioning the plane's streams and buckets",
                   within_s: float = START_WITHIN_S) -> T:
    """`make()`, a process's provisioning at its start, asked again while JetStream cannot
    answer yet (`jetstream_busy`), for `within_s` at most; then an error that says what to
    check. A process started during a cluster's election used to stop at once on a bare
    TimeoutError. Replicas a lone server cannot keep are a ConfigError saying what to change
    (`replicas_need_a_cluster`); any other error is raised as it comes."""
    give_up_s = time.monotonic() + within_s
    while True:
        try:
            return await make()
        except Exception as exc:
            if (need_cluster := replicas_need_a_cluster(exc)) is not None:
                raise need_cluster from None
            if not jetstream_busy(exc):
                raise
            left_s = give_up_s - time.monotonic()
            if left_s <= 0:
                raise Unavailable(
                    f"JetStream did not answer the {who} ({what}) for {within_s:g} s "
                    f"(last: {exc!r}). A cluster elects a "
                    f"stream's leader 4-9 s after a server dies; longer, check that JetStream "
                    f"is enabled, that most of the cluster's servers run, and that this "
                    f"process's NATS user may use $JS.API") from exc
            log.warning("start waits for JetStream", process=who, doing=what,
                        error=repr(exc), left_s=round(left_s, 1))
            await asyncio.sleep(min(START_RETRY_S, left_s))


async def ensure_all_at_start(js: JetStreamContext, plan: ProvisionPlan, *, who: str,
                              within_s: float = START_WITHIN_S) -> tuple[KeyValue, KeyValue]:
    """`ensure_all` for a router's or node's start (`at_start`)."""
    return await at_start(lambda: ensure_all(js, plan), who=who, within_s=within_s)


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
