"""Fault injection for tests and drills: wrap a slot's runner so it can hang, slow down or
raise on command. Also records when each call started, which the health supervisor reads to
tell a long request from a hung partition. A generation announces each token step the same
way (`begin`/`end`), so a fault takes hold mid-stream and a step that hangs is seen."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from gpu_node.compute import SlotRunner
from gpu_node.device_wait import DeviceWork

T = TypeVar("T")

MODES = ("none", "hang", "slow", "raise")


class InjectedFault(RuntimeError):
    """Raised by a slot told to fail (`mode="raise"`)."""


class WatchedRunner:
    """A `SlotRunner` that tracks the call in progress and obeys injected faults."""

    def __init__(self, inner: SlotRunner) -> None:
        self._inner = inner
        self._mode = "none"
        self._extra_s = 0.0
        self._release = threading.Event()
        self._release.set()
        # Read by the supervisor on the event loop; written by the slot thread. Single
        # assignments of floats are atomic under the GIL.
        self.call_started_s: float | None = None
        self.call_expected_s: float = 0.0
        self.last_call_us = 0  # how long the last call took (written as it ends)

    def set_fault(self, mode: str, extra_us: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"fault mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._mode = mode
        self._extra_s = extra_us / 1e6
        if mode == "hang":
            self._release.clear()
        else:
            self._release.set()

    def begin(self, expected_s: float) -> None:
        """A call (or one step of a generation) starts now and should take at most
        `expected_s`; an injected fault takes hold here. Pair with `end`."""
        self.call_expected_s = expected_s
        self.call_started_s = time.monotonic()
        mode = self._mode
        if mode == "none":
            return
        if mode == "hang":
            self._release.wait()
        elif mode == "raise":
            raise InjectedFault("injected fault: this slot was told to fail")
        elif mode == "slow":
            time.sleep(self._extra_s)

    @property
    def faulty(self) -> bool:
        """A fault is injected: calls may hang, fail or be slow."""
        return self._mode != "none"

    def end(self) -> None:
        started = self.call_started_s
        if started is not None:
            self.last_call_us = int((time.monotonic() - started) * 1e6)
        self.call_started_s = None

    def _call(self, fn: Callable[[], T], expected_s: float) -> T:
        try:
            self.begin(expected_s)
            return fn()
        finally:
            self.end()

    def run_risk(self, features: Sequence[float], expected_s: float = 0.005) -> float:
        return self._call(lambda: self._inner.run_risk(features), expected_s)

    def run_calibrated(self, duration_us: int, expected_s: float = 0.005) -> None:
        self._call(lambda: self._inner.run_calibrated(duration_us), expected_s)

    def launches(self, kind: str) -> bool:
        """Whether a request of `kind` may be launched and awaited on the loop: the runner
        launches it, and no fault is injected (a hang or a slow call blocks where it runs:
        the slot's thread)."""
        return kind in self._inner.launches and self._mode == "none"

    def _launch(self, fn: Callable[[], DeviceWork], expected_s: float) -> DeviceWork:
        """Launched, not awaited: the call is in progress until `end`, which the slot calls
        once the work is done (or given up on)."""
        self.begin(expected_s)
        try:
            return fn()
        except BaseException:
            self.end()
            raise

    def start_calibrated(self, duration_us: int, expected_s: float = 0.005) -> DeviceWork:
        return self._launch(lambda: self._inner.start_calibrated(duration_us), expected_s)

    def start_risk(self, features: Sequence[float], expected_s: float = 0.005) -> DeviceWork:
        return self._launch(lambda: self._inner.start_risk(features), expected_s)

    def risk_score(self) -> float:
        return self._inner.risk_score()

    def probe(self, expected_s: float = 0.005) -> bool:
        return self._call(self._inner.probe, expected_s)

    def bind_thread(self) -> None:
        self._inner.bind_thread()
