"""Live settings from the KV bucket `PLANE_CONFIG`: change one number there and running nodes
and routers follow within about a second (a KV watch: in practice milliseconds).

Keys, and the range each value must be in:
  deadline_ms.<model>   1..600000     default deadline of a model (routers), and its budget
                                      (nodes); the router's longest deadline, MAX_DEADLINE_MS
  slots.<node>          1..256        slots a node claims (nodes); a node also refuses more
                                      than its backend can run (`gpu_node.node.slot_limit`)
  probe_ms              10..60000     health-probe period (nodes): faster only burns CPU
  freshness_ms          1..3600000    freshness threshold (freshness guard)
  share.<tenant>        1..1000       the tenant's weight in fair shares of slot time
                                      (routers; default 1)
  max_rate.<tenant>     1..1000000    requests per second the tenant may send, per router
  max_slots.<tenant>    1..256        slots the tenant may hold at once, per router

A value is plain ASCII decimal (no sign, space, underscore or other scripts' digits). One that
is not, or is out of range, or a key of no setting above, is refused with a warning naming the
key, the value and the range, and the previous value stays in force: a typo must not take a
model offline (`deadline_ms.calibrated=-5` withdrew every slot), size a TTL in weeks, or start
hundreds of consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import structlog
from nats.js.kv import KeyValue

from plane.contract.config import FALLBACK_DEADLINE_MS, MAX_DEADLINE_MS
from plane.contract.headers import decimal, shown
from plane.contract.lifecycle import cancel_and_wait
from plane.contract.subjects import Names, config_key

log = structlog.get_logger("plane.contract.settings")

Listener = Callable[[str, int | None], None]

MAX_SLOTS = 256  # per node: each slot is a JetStream consumer and a thread
# Setting (the key up to its first dot) -> the range its value must be in.
RANGES: dict[str, tuple[int, int]] = {
    "deadline_ms": (1, MAX_DEADLINE_MS),
    "slots": (1, MAX_SLOTS),
    "probe_ms": (10, 60_000),
    "freshness_ms": (1, 3_600_000),
    "share": (1, 1000),
    "max_rate": (1, 1_000_000),
    "max_slots": (1, MAX_SLOTS),
}


def refused(key: str, text: str, low: int | None, high: int | None, why: str) -> None:
    """The one warning line for a live value not taken (here, and a node's own checks)."""
    log.warning("live setting refused", key=key, value=shown(text),
                range=f"{low}..{high}" if low is not None else None, why=why)


def parse_value(key: str, raw: bytes) -> int | None:
    """The value of `key`, checked; None (after a warning) when it is refused."""
    text = raw.decode("utf-8", "replace")
    bounds = RANGES.get(key.split(".", 1)[0])
    if bounds is None:
        refused(key, text, None, None, f"no such setting; known: {', '.join(RANGES)}")
        return None
    low, high = bounds
    try:
        return decimal(text, what=key, low=low, high=high)
    except ValueError as exc:
        refused(key, text, low, high, str(exc))
        return None


class LiveSettings:
    def __init__(self, names: Names) -> None:
        self.names = names
        self.values: dict[str, int] = {}
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self._kv: KeyValue | None = None
        self.ready = asyncio.Event()

    def deadline_ms(self, model: str) -> int | None:
        return self.values.get(config_key("deadline_ms", model))

    def deadline_or_default(self, model: str, defaults: Mapping[str, int]) -> int:
        """The model's deadline when the caller gives none: the live setting, else the
        configured default, else FALLBACK_DEADLINE_MS (routers and nodes alike)."""
        return self.deadline_ms(model) or defaults.get(model, FALLBACK_DEADLINE_MS)

    def get(self, setting: str, scope: str | None = None) -> int | None:
        return self.values.get(config_key(setting, scope))

    def on_change(self, listener: Listener) -> None:
        """`listener(key, value or None)` runs on the event loop after each change."""
        self._listeners.append(listener)

    async def start(self, kv: KeyValue) -> None:
        if self._task is not None:
            return
        self._kv = kv
        self._task = asyncio.create_task(self._watch())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self.ready.wait()

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _watch(self) -> None:
        assert self._kv is not None
        while True:
            try:
                watcher = await self._kv.watchall()
                try:
                    async for entry in watcher:
                        if entry is None:  # initial values delivered
                            self.ready.set()
                            continue
                        self._apply(entry.key, entry.value, entry.operation)
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py untyped
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker restart, reconnect: watch again
                log.warning("config watch restarting", error=repr(exc))
                await asyncio.sleep(0.5)

    def _apply(self, key: str, raw: bytes | None, op: str | None) -> None:
        value: int | None
        if op in ("DEL", "PURGE") or raw is None:
            value = None
            self.values.pop(key, None)
        else:
            value = parse_value(key, raw)
            if value is None:
                return  # refused: the previous value stays
            self.values[key] = value
        log.info("live setting", key=key, value=value)
        for listener in self._listeners:
            listener(key, value)
