"""Live settings from the KV bucket `PLANE_CONFIG`: change one number there and running nodes
and routers follow within about a second (a KV watch: in practice milliseconds).

Keys (values are decimal integers):
  deadline_ms.<model>   default deadline of a model (routers), and its budget (nodes)
  slots.<node>          slots a node claims (nodes)
  probe_ms              health-probe period (nodes)
  freshness_ms          freshness threshold (freshness guard)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from nats.js.kv import KeyValue

from plane.lifecycle import cancel_and_wait
from plane.subjects import Names, config_key

log = structlog.get_logger("plane.settings")

Listener = Callable[[str, int | None], None]


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
            try:
                value = int(raw.decode())
            except ValueError:
                log.warning("config value ignored: not an integer", key=key, value=raw[:40])
                return
            self.values[key] = value
        log.info("live setting", key=key, value=value)
        for listener in self._listeners:
            listener(key, value)
