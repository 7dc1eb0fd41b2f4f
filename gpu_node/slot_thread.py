"""A slot's own thread: runs the slot's blocking calls (the device, a generation), one at a
time, in order, never on the event loop.

`loop.run_in_executor` on a one-thread `ThreadPoolExecutor` costs a work item, a
`concurrent.futures.Future` with its condition, the executor's idle-thread bookkeeping and a
chain of callbacks into an asyncio future: ~64 µs of CPU per call on this project's 2-core
host against ~24 µs for what is here (a `SimpleQueue` put; the result set on an asyncio
future with one `call_soon_threadsafe`), and about as much again in latency
(`benchmarks/slot_thread_hop.py`). The node makes one such call per request.

The thread is a daemon: a call stuck in a driver (a hung kernel, which the health supervisor
answers for) must not keep the process from exiting.

Before its first call the thread runs the slot's `on_start` hook once (a CUDA slot makes its
stream the thread's current one: `gpu_node.partitions.CudaLane.bind_thread`). A hook that
fails is logged; the calls run all the same (a CUDA slot then switches streams per call).

While it has no call to run, the thread may run an `idle` hook of the slot's (a generating
slot keeps its model warm: `gpu_node.generation.SlotGenerator.keep_warm`): the hook says how
long to wait for a call before it runs again, or None to wait for one with no timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

T = TypeVar("T")
log = structlog.get_logger("gpu_node.slot_thread")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]
# Run on the thread while it has no call: how long to wait for one before running it again
# (None: wait until one comes).
Idle = Callable[[], float | None]


class SlotThread:
    def __init__(self, name: str, idle: Idle | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        self._name = name
        self._idle = idle
        self._on_start = on_start
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        """Whether the thread exists yet (it starts with the first call)."""
        return self._thread is not None

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` on the thread, after the calls before it; its result (or exception)
        on the returned future. A call whose future is cancelled before it starts is
        skipped; one already running runs to its end (its result is dropped)."""
        if self._closed:
            raise RuntimeError(f"slot thread {self._name} is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """No more calls: those not started are cancelled; the thread ends after the one it
        runs now (call from the loop that made the calls)."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].cancel()
        self._jobs.put(None)

    def _next(self) -> _Job | None:
        """The next call (None: shut down), running the idle hook while there is none."""
        idle, jobs = self._idle, self._jobs
        while idle is not None and (wait_s := idle()) is not None:
            try:
                return jobs.get(timeout=wait_s)
            except queue.Empty:
                continue
        return jobs.get()

    def _work(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # slower calls, not failed ones: say so and go on
                log.warning("slot thread start hook failed", thread=self._name,
                            error=f"{type(exc).__name__}: {exc}")
        while (job := self._next()) is not None:
            loop, fut, fn, args = job
            if fut.cancelled():  # a read of a flag: safe from this thread
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, as an executor would
                _settle(loop, fut, None, exc)
            else:
                _settle(loop, fut, result, None)


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], result: Any,
            exc: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
        loop.call_soon_threadsafe(_set, fut, result, exc)


def _set(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # cancelled while it ran
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
