"""The freshness guard: per-card features are used only when fresh, else waited for or
degraded, and the answer says which.

For the node serving `risk` (a request with a `card`)::

    guard = CardFeatureGuard(nc_or_js, names, GuardConfig(on_stale=OnStale.WAIT))
    async with guard:                       # watches PLANE_FEATURES and PLANE_CONFIG
        result = await guard.lookup(card, deadline_monotonic_s)
        features = [a + b for a, b in zip(request.features, result.values)]
        headers[Header.FRESHNESS] = result.freshness.value

`lookup` never raises for a missing or stale card and never outlives the deadline (less
`reserve_ms`, and less how late the loop's timers have lately fired: `late_ms`). Its
`GuardResult`:

    values      32 floats (zero-padded): the card's features, added elementwise
    freshness   Freshness.FRESH    the newest value passed the check at once
                Freshness.WAITED   it did after waiting for a fresher update
                Freshness.DEGRADED none came in time (or `on_stale=degrade`): `values` is the
                                   last value that was fresh on arrival, or zeros
    lag_ms      ingest - event time of the newest value seen (-1 when none)
    age_ms      age of the guard's view at use (-1 when not checked or no value)
    waited_ms   time spent waiting
    source      "latest" | "last-good" | "neutral"

The checks (see `freshness.decision`): lag = ingest_time - event_time of the card's newest
value, age = how far behind the pipeline is: now - the newer of the newest ingest stamp the
guard has seen on the bucket and the oldest of the topics' caught-up watermarks there (keys
`_caughtup.<stream>`, written by the feature updaters from the bridges' word: see
`freshness.watermark`), so that a quiet topic whose pipeline is caught up stays fresh and
one whose bridge, broker or updater stalled does not; both at or under the threshold. The
threshold is `GuardConfig.threshold_ms` until PLANE_CONFIG key `freshness_ms` is set, which
then takes effect within milliseconds.
Everything per request is in memory: a lookup of a fresh card costs microseconds.

`risk_enricher(guard)` wraps all this as the node's `Enrich` hook (`PlaneStack(...,
enrich=risk_enricher(guard))`). A guard that starts while a card's newest value is already
stale has no last good value for it (the bucket keeps one value per card): it degrades to
zeros until a fresh value arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry

from freshness.config import GuardConfig, OnStale
from freshness.decision import Action, decide, degrade_source
from freshness.metrics import GuardMetrics
from freshness.provision import ensure_config_bucket, ensure_features_bucket
from freshness.records import CardFeatures, features_decoder
from freshness.watermark import watermark_decoder
from plane.contract.lifecycle import Lifecycle, cancel_and_wait
from plane.contract.messages import FEATURES, Freshness, RiskRequest
from plane.contract.natsconn import Throttle
from plane.contract.provision import at_start
from plane.contract.settings import LiveSettings
from plane.contract.subjects import CAUGHT_UP_KEY_PREFIX, Header, Names, config_key

log = structlog.get_logger("freshness.guard")

FRESHNESS_KEY = config_key("freshness_ms")
_NEUTRAL = (0.0,) * FEATURES
_MAX_LATE_MS = 50.0  # past this the host is too loaded for any deadline: degrade, not wait
# Degraded lookups while PLANE_FEATURES has had no update for this long: the feature
# pipeline is down or absent (no `plane features` ran: every card request of a deployment
# held its slot until its deadline, then degraded, found from outside). Said once a minute.
PIPELINE_QUIET_S = 10.0
QUIET_WARN_EVERY_S = 60.0


class GuardResult(msgspec.Struct, frozen=True, kw_only=True):
    values: list[float]
    freshness: Freshness
    lag_ms: float
    age_ms: float = -1.0
    waited_ms: float = 0.0
    source: str = "latest"


def pad(values: list[float]) -> list[float]:
    """Exactly FEATURES floats: truncated or zero-padded."""
    out = list(values[:FEATURES])
    out.extend(_NEUTRAL[: FEATURES - len(out)])
    return out


def _now_ms() -> float:
    return time.time_ns() / 1e6


class CardFeatureGuard(Lifecycle):
    def __init__(
        self,
        nc_or_js: Client | JetStreamContext,
        names: Names | None = None,
        config: GuardConfig | None = None,
        *,
        metrics: GuardMetrics | None = None,
        replicas: int = 1,
    ) -> None:
        self.names = names or Names()
        self.cfg = config or GuardConfig()
        self.metrics = metrics or GuardMetrics()
        self.replicas = replicas  # of the features bucket, where the guard creates it
        self._js = nc_or_js.jetstream() if isinstance(nc_or_js, Client) else nc_or_js
        self.threshold_ms = float(self.cfg.threshold_ms)
        self._latest: dict[str, CardFeatures] = {}
        self._last_good: dict[str, CardFeatures] = {}
        self._view_ingest_ms = 0.0
        # Each topic's caught-up watermark (epoch ms), by its key in the bucket.
        self._caught_up_ms: dict[str, float] = {}
        self._started_at = time.monotonic()
        self._quiet = Throttle(QUIET_WARN_EVERY_S)
        # How late a timed wait woke past its mark, recently (a decaying max, ms): kept back
        # from the deadline beside `reserve_ms`. On a loaded host the loop's timers fire
        # several ms late, and a wait to the last moment then answered after the deadline.
        self.late_ms = 0.0
        self._changed = asyncio.Event()
        self._settings: LiveSettings | None = None
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # the bucket's current values are loaded

    # -- life cycle ------------------------------------------------------------------------
    async def start(self, timeout_s: float = 10.0) -> None:
        if self._task is not None:
            return
        if self.cfg.watch_live_threshold:
            config_kv = await at_start(lambda: ensure_config_bucket(self._js, self.names),
                                       who="freshness guard")
            self._settings = LiveSettings(self.names)
            self._settings.on_change(self._on_setting)
            await self._settings.start(config_kv)
            live = self._settings.values.get(FRESHNESS_KEY)
            if live is not None:
                self._on_setting(FRESHNESS_KEY, live)
        features_kv = await at_start(
            lambda: ensure_features_bucket(self._js, self.names, replicas=self.replicas),
            who="freshness guard")
        self._task = asyncio.create_task(self._watch(features_kv), name="freshness-guard")
        async with asyncio.timeout(timeout_s):
            await self.ready.wait()

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        settings, self._settings = self._settings, None
        if settings is not None:
            await settings.stop()

    # -- the per-request path --------------------------------------------------------------
    async def lookup(self, card: str, deadline_monotonic_s: float) -> GuardResult:
        """The card's features, checked for freshness; returns by the deadline less
        `reserve_ms` and `late_ms`, whatever happens."""
        cfg = self.cfg
        started = time.monotonic()
        waited = False
        late_ms = self.late_ms  # one figure for the whole lookup: learned at its end
        woke_late_ms: float | None = None
        while True:
            value = self._latest.get(card)
            lag_ms = value.lag_ms if value is not None else None
            age_ms = (
                max(_now_ms() - self.behind_since_ms(), 0.0)
                if cfg.check_age and value is not None else None
            )
            now = time.monotonic()
            remaining_ms = (deadline_monotonic_s - now) * 1000 - cfg.reserve_ms - late_ms
            action = decide(
                lag_ms=lag_ms, age_ms=age_ms, threshold_ms=self.threshold_ms,
                remaining_ms=remaining_ms, has_last_good=card in self._last_good,
                on_stale=cfg.on_stale, min_wait_ms=cfg.min_wait_ms,
            )
            if action is not Action.WAIT:
                break
            waited = True
            changed = self._changed
            try:
                async with asyncio.timeout(remaining_ms / 1000):
                    await changed.wait()
            except TimeoutError:
                late = (time.monotonic() - now) * 1000 - remaining_ms
                woke_late_ms = max(late, woke_late_ms or 0.0)
        if woke_late_ms is not None:
            # A decaying max: a late wake is kept back from the next waits and forgotten
            # over some tens of timed-out ones (x0.9 each), never past a sane bound.
            self.late_ms = min(max(woke_late_ms, late_ms * 0.9, 0.0), _MAX_LATE_MS)
        waited_ms = (time.monotonic() - started) * 1000 if waited else 0.0
        if action is Action.USE:
            assert value is not None
            freshness = Freshness.WAITED if waited else Freshness.FRESH
            result = GuardResult(values=pad(value.values), freshness=freshness,
                                 lag_ms=value.lag_ms, age_ms=age_ms if age_ms else 0.0,
                                 waited_ms=waited_ms)
        else:
            good = self._last_good.get(card)
            source = degrade_source(has_last_good=good is not None)
            values = pad(good.values) if good is not None else list(_NEUTRAL)
            result = GuardResult(
                values=values, freshness=Freshness.DEGRADED,
                lag_ms=lag_ms if lag_ms is not None else -1.0,
                age_ms=age_ms if age_ms is not None else -1.0,
                waited_ms=waited_ms, source=source.value,
            )
        self._observe(result, waited)
        if result.freshness is Freshness.DEGRADED:
            self._say_if_quiet()
        return result

    def behind_since_ms(self) -> float:
        """Epoch ms up to which the pipeline is known to have delivered everything: the
        newest ingest stamp seen, or the oldest topic watermark when that is newer (0:
        nothing known)."""
        marks = self._caught_up_ms
        return max(self._view_ingest_ms, min(marks.values()) if marks else 0.0)

    def _say_if_quiet(self) -> None:
        """Quiet: the pipeline is known caught up only long ago (or not at all, since the
        guard started)."""
        since = self.behind_since_ms()
        ever = since > 0
        quiet_s = ((_now_ms() - since) / 1000 if ever
                   else time.monotonic() - self._started_at)
        if quiet_s < PIPELINE_QUIET_S or self._quiet.allow("quiet") is None:
            return
        log.warning(
            "card requests degrade and the features bucket has had no update (nor caught-up "
            "watermark) for a while: "
            "is the feature pipeline running? (`plane bridge` for Kafka, and `plane "
            "features --topic <topic>` for the bucket). Meanwhile each such request "
            + ("waits on its slot until its deadline: `--on-stale degrade` answers at once"
               if self.cfg.on_stale is OnStale.WAIT else "is answered at once"),
            bucket=self.names.features_bucket, quiet_s=round(quiet_s, 1), any_value=ever)

    def _observe(self, result: GuardResult, waited: bool) -> None:
        m = self.metrics
        m.outcomes.labels(result.freshness.value).inc()
        if result.lag_ms >= 0:
            m.lag_seconds.observe(result.lag_ms / 1000)
        if result.age_ms >= 0:
            m.age_seconds.observe(result.age_ms / 1000)
        if waited:
            m.wait_seconds.observe(result.waited_ms / 1000)

    # -- keeping the view ------------------------------------------------------------------
    def _on_setting(self, key: str, value: int | None) -> None:
        if key != FRESHNESS_KEY:
            return
        if value is None:
            self.threshold_ms = float(self.cfg.threshold_ms)
        elif value <= 0:
            log.warning("freshness_ms ignored: must be > 0", value=value)
            return
        else:
            self.threshold_ms = float(value)
        log.info("freshness threshold", threshold_ms=self.threshold_ms)

    def apply(self, value: CardFeatures) -> None:
        """Take one value into the view (the watch calls this; tests may too)."""
        self._latest[value.card] = value
        if value.lag_ms <= self.threshold_ms:
            self._last_good[value.card] = value
        self._view_ingest_ms = max(self._view_ingest_ms, float(value.ingest_time_ms))
        self._wake()

    def apply_watermark(self, key: str, caught_up_ms: int | None) -> None:
        """A topic's caught-up watermark (None: its key was deleted)."""
        if caught_up_ms is None:
            self._caught_up_ms.pop(key, None)
        else:
            self._caught_up_ms[key] = float(caught_up_ms)
        self._wake()

    def _wake(self) -> None:
        """Waiting lookups decide again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _watch(self, kv: KeyValue) -> None:
        while True:
            try:
                watcher = await kv.watchall()
                try:
                    async for entry in watcher:
                        if entry is None:
                            self.ready.set()
                            continue
                        gone = entry.operation in ("DEL", "PURGE") or not entry.value
                        try:
                            if entry.key.startswith(CAUGHT_UP_KEY_PREFIX):
                                self.apply_watermark(entry.key, None if gone else
                                                     watermark_decoder.decode(
                                                         entry.value or b"").caught_up_ms)
                            elif gone:
                                self._latest.pop(entry.key, None)
                            else:
                                self.apply(features_decoder.decode(entry.value or b""))
                        except msgspec.DecodeError as exc:
                            log.warning("feature value ignored", key=entry.key, error=str(exc))
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker restart, reconnect: watch again
                log.warning("features watch restarting", error=repr(exc))
                await asyncio.sleep(0.5)


async def guarded_enricher(
    stack: contextlib.AsyncExitStack, nc: Client, names: Names,
    registry: CollectorRegistry | None, config: GuardConfig | None = None, *,
    replicas: int = 1,
) -> Callable[[Any, float], Awaitable[tuple[Any, dict[str, str]]]]:
    """A risk node's freshness guard, started on `stack` (stopped with it), as the node's
    enrich hook; its metrics in `registry` (None: a registry of its own, for a second node
    in one process, whose gauges would clash)."""
    metrics = GuardMetrics(registry) if registry is not None else GuardMetrics()
    guard = CardFeatureGuard(nc, names, config or GuardConfig(), metrics=metrics,
                             replicas=replicas)
    return risk_enricher(await stack.enter_async_context(guard))


def risk_enricher(
    guard: CardFeatureGuard,
) -> Callable[[Any, float], Awaitable[tuple[Any, dict[str, str]]]]:
    """The node's hook (`gpu_node.slot.Enrich`): a `RiskRequest` with a `card` gets the
    card's guarded features added elementwise, and the reply a `Plane-Freshness` header.
    Requests without a card pass untouched."""

    async def enrich(req: Any, deadline_monotonic_s: float) -> tuple[Any, dict[str, str]]:
        if not isinstance(req, RiskRequest) or req.card is None:
            return req, {}
        result = await guard.lookup(req.card, deadline_monotonic_s)
        features = [a + b for a, b in zip(req.features, result.values, strict=True)]
        return (msgspec.structs.replace(req, features=features),
                {Header.FRESHNESS: result.freshness.value})

    return enrich
