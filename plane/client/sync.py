"""The blocking client, for code without an event loop:

    with SyncClient("nats://127.0.0.1:4222") as plane:
        result = plane.invoke("calibrated", {"duration_us": 2000}, deadline_ms=200)

It runs the asyncio `Client` on an event loop in one background thread that it owns (so the
NATS connection keeps answering pings between calls) and waits for each call there. Safe to
share between threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from plane.client.aio import Client, ClientConfig
from plane.client.connection import open_connection
from plane.client.result import Result
from plane.contract.config import ConnectOptions

T = TypeVar("T")

# How long past a call's own deadline we wait for the loop thread before giving up on it.
_SLACK_S = 5.0


class SyncClient:
    def __init__(self, opts: ConnectOptions | str, config: ClientConfig | None = None) -> None:
        self._opts = opts if isinstance(opts, ConnectOptions) else ConnectOptions(
            url=opts, name="plane-client")
        self._config = config or ClientConfig()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Client | None = None

    def open(self) -> SyncClient:
        """Start the loop thread and connect; idempotent."""
        if self._client is not None:
            return self
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="plane-client", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            nc = self._run(open_connection(self._opts, self._config.connect_attempts), 30.0)
        except BaseException:
            self.close()
            raise
        self._client = Client(nc, self._config)
        return self

    def close(self) -> None:
        """Drain the connection, stop the loop thread; idempotent."""
        loop, thread, client = self._loop, self._thread, self._client
        self._loop = self._thread = self._client = None
        if loop is None:
            return
        if client is not None:
            fut = asyncio.run_coroutine_threadsafe(client.nc.drain(), loop)
            try:
                fut.result(timeout=_SLACK_S)
            except TimeoutError:
                fut.cancel()
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=_SLACK_S)
        loop.close()

    def invoke(self, model: str, payload: Any, *, deadline_ms: int | None = None,
               **kw: Any) -> Result:
        """See `Client.invoke`: a 200 `Result`, or a typed error."""
        client = self._require()
        return self._run(client.invoke(model, payload, deadline_ms=deadline_ms, **kw),
                         self._wait_s(model, deadline_ms))

    def call(self, model: str, payload: Any, *, deadline_ms: int | None = None,
             **kw: Any) -> Result:
        """See `Client.call`: the final answer whatever its status."""
        client = self._require()
        return self._run(client.call(model, payload, deadline_ms=deadline_ms, **kw),
                         self._wait_s(model, deadline_ms))

    def _wait_s(self, model: str, deadline_ms: int | None) -> float:
        if deadline_ms is None:
            deadline_ms = self._config.deadline_ms(model)
        ms = deadline_ms if deadline_ms is not None else self._config.wait_ms
        return ms / 1000 + _SLACK_S

    def _require(self) -> Client:
        if self._client is None:
            raise RuntimeError("SyncClient is not open: use `with SyncClient(...)` or .open()")
        return self._client

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            raise

    def __enter__(self) -> SyncClient:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
