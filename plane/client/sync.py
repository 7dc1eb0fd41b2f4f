"""The blocking client, for code without an event loop:

    with SyncClient("nats://127.0.0.1:4222") as plane:
        result = plane.invoke("calibrated", {"duration_us": 2000}, deadline_ms=200)
        for piece in plane.stream("tinylm", {"prompt": "hi", "max_tokens": 16}):
            print(piece, end="")

It runs the asyncio `Client` on an event loop in one background thread that it owns (so the
NATS connection keeps answering pings between calls) and waits for each call there. Safe to
share between threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

from plane.client.aio import Client, ClientConfig
from plane.client.connection import open_connection
from plane.client.result import Result
from plane.client.stream import TokenStream
from plane.contract.config import MAX_DEADLINE_MS, ConnectOptions
from plane.contract.messages import Usage
from plane.contract.natsconn import close as close_connection

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
            fut = asyncio.run_coroutine_threadsafe(close_connection(client.nc), loop)
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

    def stream(self, model: str, payload: Any, *, deadline_ms: int | None = None,
               stream_deadline_ms: int | None = None, **kw: Any) -> SyncStream:
        """See `Client.stream`: iterate it (`for piece in plane.stream(...)`) for the text
        pieces; leaving the loop early cancels the stream."""
        client = self._require()
        return SyncStream(self, client.stream(model, payload, deadline_ms=deadline_ms,
                                              stream_deadline_ms=stream_deadline_ms, **kw))

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


# The async stream never waits past its deadline plus its margin, nor, without a deadline,
# past `wait_ms` between two messages; this only bounds a loop thread that stopped.
_STREAM_STEP_S = MAX_DEADLINE_MS / 1000 + _SLACK_S


class SyncStream:
    """A `TokenStream` read from a thread without an event loop: each step runs on the
    `SyncClient`'s loop thread. Iterate it once; `with` closes (cancels) it for sure, and so
    does leaving a `for` loop early (the generator's close)."""

    def __init__(self, owner: SyncClient, stream: TokenStream) -> None:
        self._owner = owner
        self.stream = stream

    def __iter__(self) -> Iterator[str]:
        pieces = self.stream.__aiter__()
        try:
            while True:
                try:
                    yield self._owner._run(_next_piece(pieces), _STREAM_STEP_S)
                except StopAsyncIteration:
                    return
        finally:
            if self._owner._loop is not None:  # close the async generator on its loop
                self._owner._run(_close(pieces, self.stream), _SLACK_S)

    def start(self) -> bool:
        """See `TokenStream.start`."""
        return self._owner._run(self.stream.start(), _STREAM_STEP_S)

    def close(self) -> None:
        """Cancel the stream if it still runs; idempotent."""
        if self._owner._loop is not None:
            self._owner._run(self.stream.aclose(), _SLACK_S)

    @property
    def result(self) -> Result | None:
        return self.stream.result

    @property
    def finish_reason(self) -> str | None:
        return self.stream.finish_reason

    @property
    def usage(self) -> Usage | None:
        return self.stream.usage

    @property
    def text(self) -> str:
        return self.stream.text

    def __enter__(self) -> SyncStream:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


async def _next_piece(pieces: AsyncGenerator[str, None]) -> str:
    return await pieces.__anext__()


async def _close(pieces: AsyncGenerator[str, None], stream: TokenStream) -> None:
    await pieces.aclose()  # its own cleanup: the cancel, when it still runs
    await stream.aclose()
