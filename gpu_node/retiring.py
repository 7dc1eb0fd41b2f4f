"""Slots a live resize removed, still serving for a moment (`Node._reconcile_slots`).

Routers hear of a removal from the node's next heartbeat (sent at once), but a router can
place on the slot in the millisecond before it reads it. A slot that stopped fetching at
once left such a request on its subject: nobody fetched or swept it, and its router
answered it 504 at its deadline (probe F: one 504 on 3 of 5 shrinks under load). So a
removed slot keeps its consumer and runs what lands there for `linger_s` (routers that
hear heartbeats have heard of the removal by then), then withdraws, sweeps what is left
on its subject (answered 503 `unhealthy`: the caller retries elsewhere), and closes. A grow
within that time takes the slot back as it is (same number, same consumer), so a slot
number is never served twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from dataclasses import dataclass, field

import structlog

from gpu_node.slot import Slot

log = structlog.get_logger("plane.node")


class _State(enum.Enum):
    LINGERING = "lingering"  # still fetching and running what routers placed
    ENDING = "ending"  # withdrawing: a grow waits for it, then makes the slot anew
    KEPT = "kept"  # taken back by a grow


@dataclass(slots=True)
class _Retiring:
    slot: Slot
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # cut the linger short
    state: _State = _State.LINGERING
    sweep: bool = True  # at its end, answer what is left on its subject
    task: asyncio.Task[None] | None = None


class Retirements:
    """The removed slots still lingering, by slot number."""

    def __init__(self, *, linger_s: float, wait_s: float) -> None:
        self.linger_s = linger_s
        self.wait_s = wait_s  # a request running at the end of the linger: its time to finish
        self._by_k: dict[int, _Retiring] = {}

    def __len__(self) -> int:
        return len(self._by_k)

    def slots(self) -> list[Slot]:
        return [r.slot for r in self._by_k.values()]

    def retire(self, slot: Slot) -> None:
        """`slot` is no longer advertised: serve on for `linger_s`, then withdraw and close."""
        r = _Retiring(slot)
        r.task = asyncio.create_task(self._run(r), name=f"retire-{slot.model}-{slot.k}")
        self._by_k[slot.k] = r

    async def take_back(self, k: int) -> Slot | None:
        """Slot `k` again, as it is, if it is still lingering; else None once its withdrawal
        is over (its consumer gone: the caller makes the slot anew)."""
        r = self._by_k.get(k)
        if r is None:
            return None
        if r.state is _State.LINGERING:
            r.state = _State.KEPT
            r.ended.set()
        if r.task is not None:
            await r.task
        return r.slot if r.state is _State.KEPT else None

    async def end_all(self, *, sweep: bool = True) -> None:
        """Withdraw every lingering slot now: the node stops, or stands down (`sweep` False:
        the subjects are a newer process's now)."""
        for r in list(self._by_k.values()):
            r.sweep = r.sweep and sweep
            r.ended.set()
        await asyncio.gather(*(r.task for r in list(self._by_k.values()) if r.task is not None),
                             return_exceptions=True)

    async def _run(self, r: _Retiring) -> None:
        slot = r.slot
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.linger_s):
                    await r.ended.wait()
            if r.state is _State.KEPT:
                return
            r.state = _State.ENDING
            await slot.withdraw("resized", wait_s=self.wait_s)
            # Whatever a late router placed that the pull did not deliver: answered 503 so
            # that its caller retries elsewhere now. Not once superseded: the subject is the
            # newer process's. (The consumer is left to its inactivity threshold, or to the
            # next claim of this number, which deletes it first: a newer process with this
            # id may have made its own by that name.)
            if r.sweep:
                await slot.sweep("slot removed by a resize")
            await slot.close()
        except Exception as exc:  # the node goes on: the slot is gone from its adverts
            log.warning("removed slot not closed cleanly", slot=slot.k, error=repr(exc))
        finally:
            if self._by_k.get(slot.k) is r:
                del self._by_k[slot.k]
