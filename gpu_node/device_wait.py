"""Device work awaited on the event loop, with no thread hand-off per request.

A slot's device work is launched where its request runs, on the event loop (a launch does not
block), and its end is awaited there: a precise timer to the work's predicted end, then a
short poll of its completion (a CUDA event's `query`; on a CPU, where `calibrated` stands
for device time, the clock). Before, the slot's own thread made the call and waited in the
driver (or in `time.sleep`): two thread hand-offs a request, the job to the thread and its
result back through the loop's self-pipe, each the wake of a thread that, on a loaded host,
first waits for a core. On this project's 2-core host that wait was most of a short
request's overhead on its slot: 4 slots of 2 ms at 0.9x of their closed-loop capacity refused
84-95% of newcomers at their first try, and 2-27% with the wait here; at 2x they answered
858-866 requests a second, and 1,014-1,042 (BENCHMARKS.md, "Thirty-second session").

The timer: asyncio's and uvloop's own fire on whole milliseconds, uvloop's up to one early (an
`asyncio.sleep(0.002)` measured 1.1-2.3 ms here), which would shorten or stretch 2 ms of work
by half. A Linux timerfd, which the loop reads as it reads a socket, fires at its
microsecond. Without one (another OS, a sandbox that refuses it) the loop's own timer is
used, checked against the clock: never early, up to a millisecond late (`precise` says which).
Imports only the standard library: `scripts/gpu_check.py` runs it on a bare GPU box.

What stays on the slot's thread: compute that holds a CPU (the torch backend's `risk`, a
generation's steps), a runner with a fault injected (a hang must not take the loop), and
every call when the node is told `--device-waits thread`.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import math
import os
import time
from typing import Protocol

# The kinds of request whose device work a runner may launch (`SlotRunner.launches`).
RISK, CALIBRATED = "risk", "calibrated"

# After the predicted end, how often a slot looks whether its device work is done: first
# after POLL_FIRST_S, then twice as long each time, up to POLL_MAX_S (work that overran its
# prediction by a lot is a hang in the making: the health supervisor's business).
POLL_FIRST_S = 0.000_02
POLL_MAX_S = 0.001
# A wait aims this much before the work's predicted end: a low quantile (LEAD_QUANTILE) of
# how late the loop has lately resumed a timer's waiter, learned a step (LEAD_STEP_S) at a
# time, at most LEAD_MAX_S. The timerfd fires at its microsecond, but the waiter resumes only
# after the rest of the loop's turn (the other slots' and the router's messages read in the
# same turn): at 2x of 4 slots of 2 ms work in `plane up` the fd was read 71 us late at the
# p50 and the waiter resumed 165 us late (p90 443), on every request, on a slot that could
# have taken its next one. Woken before the end, the wait lets the loop turn until it.
LEAD_QUANTILE = 0.25
LEAD_STEP_S = 0.000_004
LEAD_MAX_S = 0.000_3


class DeviceWork(Protocol):
    """Work launched on a device: when it should end (monotonic s), and whether it has."""

    end_s: float

    def done(self) -> bool: ...


class TimedWork:
    """Work that ends at a time: a CPU's stand-in for device time (`calibrated`)."""

    __slots__ = ("end_s",)

    def __init__(self, duration_s: float) -> None:
        self.end_s = time.monotonic() + duration_s

    def done(self) -> bool:
        return time.monotonic() >= self.end_s


class EventWork:
    """Work on a CUDA stream, done when the event recorded after it has passed."""

    __slots__ = ("_event", "end_s")

    def __init__(self, event: object, duration_s: float) -> None:
        self._event = event
        self.end_s = time.monotonic() + duration_s

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[attr-defined]


# -- timerfd (Linux), through ctypes: `os.timerfd_create` is Python 3.13's ----------------------
_CLOCK_MONOTONIC = 1  # the clock of `time.monotonic` on Linux
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _timerfd() -> int:
    """A non-blocking CLOCK_MONOTONIC timerfd, or -1 where there is none."""
    if _LIBC is None:
        return -1
    fd = int(_LIBC.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC))
    return fd if fd >= 0 else -1


def _arm(fd: int, at_s: float) -> None:
    """Fire at `at_s` (rounded up to the nanosecond: never before it)."""
    ns = math.ceil(at_s * 1e9)
    spec = _Itimerspec()
    spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
    if _LIBC is None or _LIBC.timerfd_settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec),
                                              None) != 0:
        raise OSError(ctypes.get_errno(), "timerfd_settime failed")


class LoopTimer:
    """One waiter at a time (a slot runs one request at a time), woken at a monotonic time
    with microsecond precision on the loop that first uses it. `close` on that loop."""

    def __init__(self) -> None:
        self._fd = -2  # not opened yet; -1: none to be had
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._at_s = 0.0
        self.lead_s = 0.0  # how early to aim a wait for work's end (LEAD_QUANTILE, learned)

    @property
    def precise(self) -> bool:
        """Whether a timerfd backs it (after its first use)."""
        return self._fd >= 0

    async def sleep_until(self, at_s: float) -> None:
        """Return at monotonic time `at_s` or just after; never before."""
        if time.monotonic() >= at_s:
            return
        if self._fd == -2:
            self._open()
        if self._fd < 0:
            while (left := at_s - time.monotonic()) > 0:  # noqa: ASYNC110 (a timer, not a flag)
                await asyncio.sleep(math.ceil(left * 1000) / 1000)
            return
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._waiter, self._at_s = waiter, at_s
        _arm(self._fd, at_s)
        try:
            await waiter
        finally:
            if self._waiter is waiter:  # (a cancelled sleep ends after the next one began)
                self._waiter = None
        self._learn(time.monotonic() - at_s)

    def _learn(self, late_s: float) -> None:
        """One step of a quantile estimate (it moves up by LEAD_QUANTILE of a step when the
        loop was later than it, down by the rest when earlier: it settles where
        LEAD_QUANTILE of the wakes were earlier), kept within [0, LEAD_MAX_S]."""
        if late_s < self.lead_s:
            lead = self.lead_s - LEAD_STEP_S * (1.0 - LEAD_QUANTILE)
        else:
            lead = self.lead_s + LEAD_STEP_S * LEAD_QUANTILE
        self.lead_s = min(max(lead, 0.0), LEAD_MAX_S)

    def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        fd = _timerfd()
        if fd >= 0:
            try:
                self._loop.add_reader(fd, self._fired)
            except (NotImplementedError, OSError):  # a loop that cannot watch an fd
                os.close(fd)
                fd = -1
        self._fd = fd

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if time.monotonic() >= self._at_s:
            waiter.set_result(None)
        else:  # an earlier arming's expiry, read late: the waiter's own is still to come
            _arm(self._fd, self._at_s)

    def close(self) -> None:
        fd, self._fd = self._fd, -2
        if fd >= 0:
            assert self._loop is not None
            if not self._loop.is_closed():
                self._loop.remove_reader(fd)
            os.close(fd)


async def finished(work: DeviceWork, timer: LoopTimer) -> None:
    """Until `work` is done: the loop's usual lateness before its predicted end (the
    timer's lead), then turns of the loop (other tasks run) until that end, then polls a
    little further apart each time."""
    await timer.sleep_until(work.end_s - timer.lead_s)
    while time.monotonic() < work.end_s and not work.done():  # noqa: ASYNC110 (a clock)
        await asyncio.sleep(0)
    poll_s = POLL_FIRST_S
    while not work.done():
        await timer.sleep_until(time.monotonic() + poll_s)
        poll_s = min(2 * poll_s, POLL_MAX_S)
