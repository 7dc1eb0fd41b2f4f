"""Give memory back after a flood. A burst of requests fills buffers (the socket's, the
parser's, each subscription's queue of messages) that Python frees when it has passed but
glibc's allocator keeps: a long-running router's RSS stepped up ~10% after one 20,000-request
burst and stayed there. Once a flood has been handled and the process is quiet again, ask
the allocator to return its free pages (`malloc_trim`, glibc only; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger("plane.router.memory")


def _glibc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


@dataclass(slots=True)
class FloodMemory:
    """Watches how many requests a process holds; after a flood (more than `flood` at once)
    has drained and `quiet_s` have passed with few in hand, trims once."""

    flood: int = 256
    quiet_s: float = 1.0
    few: int = 8
    trim: Callable[[], object] | None = None
    _high: int = 0
    _quiet_since_s: float | None = None
    trims: int = 0

    def __post_init__(self) -> None:
        if self.trim is None:
            self.trim = _glibc_trim()

    def observe(self, in_hand: int, now_s: float) -> None:
        self._high = max(self._high, in_hand)
        if self._high < self.flood:
            return
        if in_hand > self.few:
            self._quiet_since_s = None
            return
        if self._quiet_since_s is None:
            self._quiet_since_s = now_s
            return
        if now_s - self._quiet_since_s < self.quiet_s:
            return
        self._high = 0
        self._quiet_since_s = None
        if self.trim is not None:
            gc.collect()
            self.trim()
            self.trims += 1
            log.info("memory returned after a flood")
