"""Streams on a node (docs/design.md "Streams"): the hand-off of tokens from a slot's
generation thread to the event loop, a stream's running state, and the node's three
subscriptions that end streams early.

Per token the generation thread appends one byte under a lock and wakes the loop
(`call_soon_threadsafe`) only when it is not already woken for tokens waiting and the last
wake is `TOKEN_GAP_S` ago. The loop publishes whatever has gathered as one token message: one
message per token when steps are slow, per small group when they are fast or the loop lags.

A stream ends early when:
- its caller publishes to `plane.cancel.<node>.<k>` a message naming the stream's request id;
- its caller stops reading: every stream message goes out with a reply subject of the node's
  own (`<inbox>.<k>`), and the server answers that subject with a no-responders status
  (`Status: 503`, `Nats-Subject: <the caller's inbox>`) when nobody is subscribed to the
  caller's inbox any more;
- its caller's connection closes, for a tenant's stream across an import (where no
  no-responders status comes back): the server's advisory names the connection.
Each sets the stream's `Stop.reason`, which the generation thread reads before its next
step, and wakes the stream on the loop, which ends it at once (`end`, then the done-event):
the slot is free for the router as soon as the node hears the cancel, not a step (and a wait
for a CPU) later. The generation's last step runs out on the slot's thread meanwhile, and
the next request's work queues behind it there: the slot never computes two at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpu_node.generation import Stop
from plane.contract.headers import client_key, is_no_responders, requester_account
from plane.contract.messages import StreamFinish, disconnect_decoder
from plane.contract.metrics import PlaneMetrics
from plane.contract.subjects import CLIENT_DISCONNECTS, Header, Names

log = structlog.get_logger("plane.streams")

# A slot message stays unacked for its whole stream; the consumer's ack wait (30 s) must not
# run out under a long one: the node says "in progress" this often.
EXTEND_ACK_S = 10.0
# At most one token message per this long (the first token and the last go at once): each
# message costs the node's loop, the server and the caller CPU, and the loop's turns hold the
# GIL the generation thread needs between its ops. Measured on a 2-core CPU box (tinylm ~205 µs
# a token bare, ~205 µs on a node answering one reply): one message per token slowed the
# node's thread to ~2.2x the bare loop; one per ms (~4 tokens a message) to ~1.46x; one per
# 2 ms (~9 tokens) to ~1.25x. A held token waits at most max(this, one step).
TOKEN_GAP_S = 0.002


class TokenPipe:
    """Tokens from the generation thread to the event loop, gathered while the loop is busy.

    `put` and `close` are called from the thread; `take` and `ready` belong to the loop."""

    __slots__ = ("_closed", "_gap_s", "_lock", "_loop", "_next_s", "_pending", "_woken", "ready")

    def __init__(self, loop: asyncio.AbstractEventLoop, gap_s: float = TOKEN_GAP_S) -> None:
        self._loop = loop
        self._gap_s = gap_s
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._woken = False  # a wake-up is on its way, or the loop has not taken yet
        self._closed = False
        self._next_s = 0.0
        self.ready = asyncio.Event()

    def put(self, token: int) -> None:
        with self._lock:
            self._pending.append(token)
            if self._woken:
                return
            now = time.perf_counter()
            if now < self._next_s:
                return  # the next token (or `close`) takes it along
            self._next_s = now + self._gap_s
            self._woken = True
        self._wake()

    def close(self) -> None:
        """The generation is over (or failed): the loop takes what is left and ends."""
        with self._lock:
            self._closed = True
            if self._woken:
                return
            self._woken = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(self.ready.set)

    def take(self) -> tuple[bytes, bool]:
        """(the tokens gathered since the last take, whether the generation is over)."""
        with self._lock:
            data = bytes(self._pending)
            self._pending.clear()
            self._woken = False
            self.ready.clear()
            return data, self._closed


@dataclass(slots=True)
class StreamRun:
    """One stream in progress on a slot."""

    reply: str  # the caller's inbox
    prompt_tokens: int
    deadline_at_ms: int  # the whole stream's (router wall clock, epoch ms)
    account: str = ""  # the tenant account it came from across an import ("": the plane's)
    client: str = ""  # ... and its connection (`<server id>/<client id>`), when the server said
    stop: Stop = field(default_factory=Stop)
    seq: int = 0  # of the last message sent (start: 0)
    sent: int = 0  # tokens published
    extend_due: bool = False
    first_s: float = 0.0  # monotonic, when the first token message went out
    last_s: float = 0.0  # ... and the last
    first_tokens: int = 0  # tokens in that first message
    # Wakes the loop's side of the stream (its `TokenPipe`): a stop decided on the loop ends
    # the stream there at once, without waiting for the thread to see it.
    wake: Callable[[], None] | None = None

    def cancel(self, why: StreamFinish) -> None:
        if self.stop.reason is None:
            self.stop.reason = why
            if self.wake is not None:
                self.wake()


class StreamingSlot(Protocol):
    """What `StreamControl` needs of a slot."""

    def stream_running(self) -> tuple[str, StreamRun] | None: ...


class StreamControl:
    """The node's one cancel subscription (`plane.cancel.<node>.*`), one inbox for the
    no-responders statuses of its stream messages (`<inbox>.<k>`), routed to slot k, and the
    server's advisories of closed connections (`CLIENT_DISCONNECTS`, imported under `plane
    auth`): a tenant's reader that is gone stops its stream either way.

    Why both: inside the plane's account a token message to a reader that is gone comes back
    as the server's no-responders status. Across a tenant's import it does not (the import
    keeps mapping the reply subject after the tenant's connection closed: checked on
    nats-server 2.15), so there the node learns it from the advisory, matched by the
    connection the router named on the slot message (`Plane-Caller-Client`)."""

    def __init__(self, nc: Client, names: Names, node: str,
                 slots: Callable[[], Sequence[StreamingSlot]]) -> None:
        self.nc, self.names, self.node = nc, names, node
        self._slots = slots  # the node's slots, by k
        self.inbox = nc.new_inbox()
        self._subs: list[Any] = []
        self.cancelled = 0  # streams ended by a cancel
        self.readers_gone = 0  # streams ended because nobody read them any more
        self.refused = 0  # cancels from an account that did not send the stream

    def reply_subject(self, k: int) -> str:
        """What slot k's stream messages carry as their reply subject."""
        return f"{self.inbox}.{int(k)}"

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(self.names.node_cancels(self.node), cb=self._on_cancel),
            await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_no_responders),
            # Without `plane auth` (one account) nothing comes here: the status above does it.
            await self.nc.subscribe(CLIENT_DISCONNECTS, cb=self._on_disconnect),
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    def _running(self, subject: str) -> tuple[str, StreamRun] | None:
        try:
            k = int(subject.rsplit(".", 1)[1])
        except (IndexError, ValueError):
            return None
        slots = self._slots()
        return slots[k].stream_running() if 0 <= k < len(slots) else None

    async def _on_cancel(self, msg: Msg) -> None:
        running = self._running(msg.subject)
        h = msg.headers or {}
        rid = h.get(Header.REQUEST_ID)
        if running is None or rid is None or running[0] != rid:
            return  # not what this slot runs now (ended already, or another request)
        # A tenant may cancel its own streams only (request ids can be guessed); the plane's
        # own roles (the gateway, for an HTTP client gone) send from inside: no account.
        acc = requester_account(h)
        if acc and acc != running[1].account:
            self.refused += 1
            log.warning("cancel from another account ignored", node=self.node,
                        subject=msg.subject, request_id=rid, account=acc)
            return
        running[1].cancel(StreamFinish.CANCELLED)
        self.cancelled += 1
        log.info("stream cancelled", node=self.node, subject=msg.subject, request_id=rid)

    async def _on_no_responders(self, msg: Msg) -> None:
        h = msg.headers or {}
        if not is_no_responders(h):
            return
        running = self._running(msg.subject)
        if running is None or h.get(Header.NATS_SUBJECT) != running[1].reply:
            return  # an earlier stream's reader (this slot runs another now)
        running[1].cancel(StreamFinish.CANCELLED)
        self.readers_gone += 1
        log.info("stream stopped: nobody reads it", node=self.node, subject=msg.subject,
                 request_id=running[0])

    async def _on_disconnect(self, msg: Msg) -> None:
        try:
            ev = disconnect_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        gone = client_key(ev.server.id, ev.client.id)
        for slot in self._slots():
            running = slot.stream_running()
            if running is not None and running[1].client == gone:
                running[1].cancel(StreamFinish.CANCELLED)
                self.readers_gone += 1
                log.info("stream stopped: its caller's connection closed", node=self.node,
                         request_id=running[0], account=ev.client.acc)


class StreamMeters:
    """A slot's stream metrics, label children resolved once (none per token)."""

    __slots__ = ("_ended", "_first", "_metrics", "_model", "_per_token", "_tokens")

    def __init__(self, metrics: PlaneMetrics, model: str) -> None:
        self._metrics, self._model = metrics, model
        self._first = metrics.stream_first_token_seconds.labels(model)
        self._per_token = metrics.stream_token_seconds.labels(model)
        self._tokens = metrics.stream_tokens.labels(model)
        self._ended: dict[str, Any] = {}

    def sent(self, run: StreamRun, tokens: int, now_s: float, fetched_s: float) -> None:
        """A token message of `tokens` tokens went out at `now_s`."""
        if run.first_s == 0.0:
            run.first_s, run.first_tokens = now_s, tokens
            self._first.observe(now_s - fetched_s)
        run.last_s = now_s
        self._tokens.inc(tokens)

    def ended(self, run: StreamRun, finish: str) -> None:
        after_first = run.sent - run.first_tokens
        if after_first > 0:
            self._per_token.observe((run.last_s - run.first_s) / after_first)
        counter = self._ended.get(finish)
        if counter is None:
            counter = self._ended[finish] = self._metrics.streams_ended.labels(self._model, finish)
        counter.inc()
