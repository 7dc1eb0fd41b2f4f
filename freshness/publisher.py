"""JetStream publishes with a window of outstanding acknowledgements (`AckWindow`).

nats-py's `publish_async` costs, per message, a task (`asyncio.wait_for` on its semaphore),
an `os.urandom` call for the reply token, a future with a done-callback, and a JSON decode
into a dataclass for the ack: at the bridge's rates that, not the broker, was the limit.
Here a publish is one core publish with a reply subject `<inbox>.<n>`; the acks come back
on one subscription, are decoded with msgspec, and are counted into the batch they belong
to. A batch is done when every message in it has an ack or a refusal (no stream for its
subject, an error ack: the server came back with an empty store); what has no ack when the
caller stops waiting, or was refused, is the caller's to retry (with the same Nats-Msg-Id, so
never stored twice). Refusals counted as "no ack yet", every round of a broker that came
back empty waited out its whole publish timeout (2 s), and the bridge caught up at a few
records a second (found from outside).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class _ApiError(msgspec.Struct, frozen=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class Ack(msgspec.Struct, frozen=True):
    """A JetStream publish acknowledgement (or its refusal: `error` set)."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(Ack)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish."""

    subject: str
    payload: bytes
    headers: dict[str, str]


@dataclass(eq=False)
class Batch:
    """Messages published together; `acks[i]` is message i's ack once it came."""

    size: int
    acks: list[Ack | None] = field(init=False)
    remaining: int = field(init=False)  # messages with neither an ack nor a refusal yet
    failed: set[int] = field(default_factory=set)  # refused: retried by the caller
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.acks = [None] * self.size
        self.remaining = self.size
        if self.size == 0:
            self.done.set()

    def settle(self, i: int, ack: Ack) -> None:
        if self.acks[i] is None and i not in self.failed:
            self.acks[i] = ack
            self._one_less()

    def fail(self, i: int) -> None:
        """Message i was refused (no stream for its subject, an error ack): no ack will come,
        and the caller retries it at once rather than after its whole wait."""
        if self.acks[i] is None and i not in self.failed:
            self.failed.add(i)
            self._one_less()

    def _one_less(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()

    async def wait(self, timeout_s: float) -> bool:
        """Until every message has its ack (True), at most `timeout_s` (False)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.done.wait()
        return self.done.is_set()


class AckWindow:
    """`await window.start()`, then `batch = await window.publish(messages)`; at most
    `max_in_flight` acknowledgements outstanding over all batches. `stop()` is idempotent."""

    def __init__(self, nc: Client, max_in_flight: int) -> None:
        self._nc = nc
        self.max_in_flight = max_in_flight
        self._prefix = ""
        self._sub: Subscription | None = None
        self._next = 0
        self._pending: dict[int, tuple[Batch, int]] = {}
        self._room = asyncio.Event()
        self._room.set()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        if self._sub is not None:
            return
        self._prefix = self._nc.new_inbox() + "."
        # No pending limits: at most `max_in_flight` acks are ever due on it.
        self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_ack,
                                             pending_msgs_limit=-1, pending_bytes_limit=-1)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        self.forget_all()
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def publish(self, messages: Sequence[Outgoing]) -> Batch:
        """Publish in order; returns at once when the window has room, else as it frees.
        A message the client could not send (disconnected, buffer full) has no ack: retry it
        after `Batch.wait`."""
        batch = Batch(len(messages))
        publish = self._nc.publish
        for i, m in enumerate(messages):
            while len(self._pending) >= self.max_in_flight:
                self._room.clear()
                await self._room.wait()
            n = self._next
            self._next = n + 1
            self._pending[n] = (batch, i)
            try:
                await publish(m.subject, m.payload, reply=f"{self._prefix}{n}",
                              headers=m.headers)
            except nats.errors.Error:
                self._pending.pop(n, None)
        return batch

    def forget(self, batch: Batch) -> None:
        """Stop waiting for the acks `batch` still lacks (a late one is ignored)."""
        for n in [n for n, (b, _) in self._pending.items() if b is batch]:
            del self._pending[n]
        self._room.set()

    def forget_all(self) -> None:
        self._pending.clear()
        self._room.set()

    async def _on_ack(self, msg: Msg) -> None:
        try:
            n = int(msg.subject[len(self._prefix):])
        except ValueError:
            return
        entry = self._pending.pop(n, None)
        if entry is None:
            return
        if len(self._pending) < self.max_in_flight:
            self._room.set()
        batch, i = entry
        if not msg.data:  # a status message (no responders: no stream, ...)
            batch.fail(i)
            return
        try:
            ack = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError:
            batch.fail(i)
            return
        if ack.error is None:
            batch.settle(i, ack)
        else:
            batch.fail(i)
