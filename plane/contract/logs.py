"""structlog set-up: one canonical line per request, request ids in contextvars, JSON when
stderr is not a terminal. Called once by the CLI (never at import).

A log call never blocks the event loop. A rendered line goes into a bounded queue, and one
writer thread writes it to stderr. Written from the loop, a line to a pipe nobody reads (a
supervisor that stopped draining it) blocked the loop as soon as the pipe was full: signal
handlers never ran, and SIGTERM and SIGINT did nothing (a router was seen alive 40 s after
both). Now the writer thread blocks, not the loop; while the queue is full, lines are dropped
and counted, and the count is written as soon as a line gets through again. At exit, what is
queued gets EXIT_FLUSH_S to be written; then the process exits all the same.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import structlog

QUEUE_LINES = 10_000
EXIT_FLUSH_S = 1.0


class LineSink:
    """A file for structlog's `WriteLogger` (and stdlib logging) whose `write` never blocks:
    each line is queued for the writer thread, or dropped and counted when the queue is
    full. `notice(n)` renders the line that reports n dropped lines."""

    def __init__(self, out: Callable[[str], object], notice: Callable[[int], str],
                 max_lines: int = QUEUE_LINES) -> None:
        self._out = out
        self._notice = notice
        self._queue: queue.Queue[str] = queue.Queue(max_lines)
        self._lock = threading.Lock()  # for `dropped`: producers may be any thread
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="plane-log-writer",
                                        daemon=True)  # never keeps the process alive
        self._thread.start()

    def write(self, text: str) -> int:
        try:
            self._queue.put_nowait(text)
        except queue.Full:
            with self._lock:
                self.dropped += 1
        return len(text)

    def flush(self) -> None:
        """Nothing to do: the writer thread writes each line as it takes it."""

    def wait_written(self, timeout_s: float) -> bool:
        """Until everything queued so far is written, at most `timeout_s`; True if it was."""
        t_end = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= t_end:
                return False
            time.sleep(0.005)
        return True

    def _run(self) -> None:
        reported = 0
        while True:
            text = self._queue.get()
            dropped = self.dropped
            # A stderr that fails (closed, broken pipe) leaves nowhere to report it.
            with contextlib.suppress(Exception):
                if dropped != reported:
                    self._out(self._notice(dropped - reported))
                    reported = dropped
                self._out(text)
            self._queue.task_done()


def fd_writer(fd: int) -> Callable[[str], None]:
    """Write to a file descriptor with `os.write`: no Python lock is held while it blocks
    (a buffered `sys.stderr` blocked in the writer thread holds its buffer's lock, and the
    interpreter aborts at exit when it cannot take that lock to flush)."""

    def out(text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:  # stderr shared with someone who made it non-blocking
                time.sleep(0.01)

    return out


_sink: LineSink | None = None


def _stderr_sink(renderer: structlog.types.Processor) -> LineSink:
    """The process's one writer to stderr (created on first use, then kept)."""
    global _sink
    if _sink is not None:
        return _sink
    out: Callable[[str], object]
    try:
        out = fd_writer(os.dup(sys.stderr.fileno()))
    except (AttributeError, OSError, ValueError):  # a stderr with no descriptor (captured)
        out = sys.stderr.write

    def notice(n: int) -> str:
        line = renderer(None, "warning", {
            "event": "log lines dropped", "dropped": n, "level": "warning",
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat()})
        return (line.decode() if isinstance(line, bytes) else str(line)) + "\n"

    _sink = LineSink(out, notice)
    atexit.register(_sink.wait_written, EXIT_FLUSH_S)
    return _sink


def wait_written(timeout_s: float) -> bool:
    """Until the log lines queued so far are on stderr (at most `timeout_s`; True if they
    are): for output to stdout that must come after them, such as `plane up`'s banner."""
    return _sink.wait_written(timeout_s) if _sink is not None else True


def configure(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    sink = _stderr_sink(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.WriteLoggerFactory(file=sink),  # type: ignore[arg-type]  # a file in all but name
        # Not cached: a logger cached on first use keeps the configuration it first saw, so a
        # second `configure` in one process (tests run commands in-process) would not reach
        # it. The cost is a bind per log call, and the hot path's calls are sampled before
        # they reach a logger (`plane.contract.canonical`).
        cache_logger_on_first_use=False,
    )
    # Libraries' stdlib logging (asyncio's "exception never retrieved", nats-py) goes through
    # the same queue: its last-resort handler writes to stderr from the loop too.
    logging.basicConfig(stream=sink, level=logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
