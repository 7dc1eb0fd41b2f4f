"""A slot's `tinylm` requests: one reply, or a stream (docs/design.md "Streams").

A mixin of `gpu_node.slot.Slot` (the attributes and answering methods it uses are the
slot's, declared below). A generation runs whole on the slot's thread
(`gpu_node.generation`); a stream's tokens come to the event loop through a `TokenPipe` and go
out as token messages; the final `end` is answered like any reply (`_claim_answer`, with the
stream deadline in place of the deadline), after the done-event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog
from nats.aio.client import Client

from gpu_node.current import Current
from gpu_node.faults import WatchedRunner
from gpu_node.generation import GenResult, Progress, SlotGenerator, Stop
from gpu_node.slot_thread import SlotThread
from gpu_node.streaming import EXTEND_ACK_S, StreamMeters, StreamRun, TokenPipe
from plane.contract import replies, streams
from plane.contract.budget import ServiceWindow
from plane.contract.messages import (
    Reason,
    Status,
    StreamEnd,
    StreamFinish,
    TinyLMReply,
    TinyLMRequest,
    Usage,
)
from plane.contract.publish import publish
from plane.contract.subjects import Names
from plane.contract.tracing import trace_headers

log = structlog.get_logger("plane.slot")


class Generating:
    """The tinylm half of `gpu_node.slot.Slot` (a base class of it, kept apart so that the
    slot's request path reads on its own). What it uses of the slot is declared below for the
    type checker only: the slot defines all of it."""

    k: int
    node: str
    nc: Client
    names: Names
    thread: SlotThread
    runner: WatchedRunner
    generator: SlotGenerator | None
    stream_reply: str
    stream_meters: StreamMeters | None
    current: Current | None
    window: ServiceWindow
    failures: int
    sms: int

    if TYPE_CHECKING:  # Slot's methods, declared for the checker; no runtime stand-ins
        async def _claim_answer(self, cur: Current) -> bool: ...

        async def _finish(self, cur: Current, status: Status, service_us: int, body: bytes,
                          headers: dict[str, str]) -> None: ...

        def _busy_from(self) -> float: ...

        def _account(self, started_s: float) -> None: ...

    def stream_running(self) -> tuple[str, StreamRun] | None:
        """(request id, state) of the stream this slot runs now, if any."""
        cur = self.current
        if cur is None or cur.stream is None or cur.answered:
            return None
        return cur.request_id, cur.stream

    def _deadline_s(self, at_ms: int) -> float:
        """A router wall-clock deadline (epoch ms) as a monotonic time, for the thread."""
        return time.monotonic() + (at_ms - replies.now_ms()) / 1000

    async def _generate(self, req: TinyLMRequest) -> TinyLMReply | None:
        """A generation answered with one reply: run to its end on the slot's thread."""
        cur, gen = self.current, self.generator
        assert cur is not None and gen is not None  # _handle: tinylm nodes have a generator
        cur.stop = Stop()
        result = await self.thread.run(gen.generate, req, cur.stop,
                                       self._deadline_s(cur.deadline_at_ms), self.runner)
        cur.gen, cur.work_us = result, result.work_us
        if result.finish is StreamFinish.DEADLINE:
            return None
        slot_us = int((time.monotonic() - cur.fetched_s) * 1e6)
        return TinyLMReply(text=result.text.decode(), finish_reason=result.finish,
                           usage=self._usage(result.prompt_tokens, result.tokens, slot_us))

    def _usage(self, prompt_tokens: int, tokens: int, slot_us: int) -> Usage:
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=tokens, slot_us=slot_us,
                     sm_ms=slot_us * self.sms / 1000)

    def _stream_thread(self, req: TinyLMRequest, stop: Stop, deadline_s: float,
                       pipe: TokenPipe, progress: Progress) -> GenResult:
        """On the slot's thread: the whole generation, each token into `pipe`."""
        assert self.generator is not None
        try:
            return self.generator.generate(req, stop, deadline_s, self.runner, pipe.put,
                                           progress)
        finally:
            pipe.close()

    async def _stream(self, cur: Current, req: TinyLMRequest, t0: int) -> None:
        """`start`, the tokens as the slot's thread makes them (one generation loop there,
        not one thread call per token), then the final `end`. A stop the loop decides (a
        cancel, a caller gone) ends the stream at once, before the thread sees it."""
        run, meters = cur.stream, self.stream_meters
        assert run is not None and meters is not None  # streams run on generating slots only
        cur.stop = run.stop
        loop = asyncio.get_running_loop()
        h = cur.msg.headers or {}
        start = streams.start_headers(cur.request_id, self.node, self.k,
                                      self.names.cancel(self.node, self.k))
        start.update(trace_headers(h))
        await publish(self.nc, cur.reply, b"", start, reply=self.stream_reply)
        pipe = TokenPipe(loop)
        run.wake = pipe.ready.set
        timer = loop.call_later(EXTEND_ACK_S, self._extend_due, run, pipe)
        started_s = self._busy_from()
        progress = Progress()
        fut = self.thread.run(self._stream_thread, req, run.stop,
                              self._deadline_s(run.deadline_at_ms), pipe, progress)
        error = ""
        result: GenResult | None = None
        stopped = False  # by the loop: ended here, the thread's last step still running
        try:
            while True:
                await pipe.ready.wait()
                data, over = pipe.take()
                if data:
                    run.seq += 1
                    run.sent += len(data)
                    await publish(self.nc, cur.reply, data,
                                  streams.token_headers(cur.request_id, run.seq),
                                  reply=self.stream_reply)
                    meters.sent(run, len(data), time.monotonic(), cur.fetched_s)
                if run.extend_due:  # a long stream: the ack wait starts again
                    run.extend_due = False
                    with contextlib.suppress(Exception):  # disconnected: the next one will do
                        await cur.msg.in_progress()
                    timer = loop.call_later(EXTEND_ACK_S, self._extend_due, run, pipe)
                if over:
                    break
                if run.stop.reason is StreamFinish.CANCELLED:
                    stopped = True
                    break
            if stopped:
                fut.add_done_callback(self._stopped_generation_done)
                cur.work_us = int((time.perf_counter() - started_s) * 1e6)  # so far
                # Its phases so far, for the router to learn its rates from.
                cur.gen = progress.so_far(StreamFinish.CANCELLED, len(req.prompt_bytes))
            else:
                try:
                    result = await fut
                except Exception as exc:
                    self.failures += 1  # the supervisor counts it as a missed probe
                    log.warning("stream failed", slot=self.k, request_id=cur.request_id,
                                error=repr(exc))
                    error = f"slot {self.node}/{self.k} failed mid-stream: {exc}; retry elsewhere"
        except BaseException:  # withdrawn (abandon answers), or we cannot publish: stop it
            run.cancel(StreamFinish.ERROR)
            raise
        finally:
            run.wake = None
            timer.cancel()
            self._account(started_s)
        if cur.answered:  # abandoned while it ran
            return
        service_us = (time.perf_counter_ns() - t0) // 1000
        if result is not None:
            cur.gen, cur.work_us = result, result.work_us
            self.window.add(service_us - result.work_us)
        if not await self._claim_answer(cur):
            return
        finish = StreamFinish.CANCELLED if stopped else (
            result.finish if result is not None else None)
        await self._end_stream(cur, finish, error, service_us)

    def _stopped_generation_done(self, fut: asyncio.Future[GenResult]) -> None:
        """The thread's side of a stream the loop already ended: only a failure matters."""
        if fut.cancelled():
            return
        if (exc := fut.exception()) is not None:
            self.failures += 1  # the supervisor counts it as a missed probe
            log.warning("stopped stream's last step failed", slot=self.k, error=repr(exc))

    def _extend_due(self, run: StreamRun, pipe: TokenPipe) -> None:
        run.extend_due = True
        pipe.ready.set()

    async def _end_stream(self, cur: Current, finish: StreamFinish | None, error: str,
                          service_us: int) -> None:
        """The stream's `end` (the caller's to answer is ours: `_claim_answer` said so):
        200 stop/length/cancelled, 504 at the stream deadline, 503 when the slot failed
        (`finish` None)."""
        run = cur.stream
        assert run is not None
        usage = self._usage(run.prompt_tokens, run.sent, service_us)
        if finish is None:
            status = Status.UNAVAILABLE
            end = StreamEnd(finish_reason=StreamFinish.ERROR, usage=usage, error=error,
                            reason=Reason.UNHEALTHY)
        elif finish is StreamFinish.DEADLINE:
            status = Status.DEADLINE
            end = StreamEnd(finish_reason=finish, usage=usage, reason=Reason.DEADLINE,
                            error=f"the stream deadline passed after {run.sent} tokens")
        else:
            status = Status.OK
            end = StreamEnd(finish_reason=finish, usage=usage)
        body, headers = streams.end_message(cur.request_id, run.seq + 1, status, end, service_us,
                                            node=self.node)
        run.seq += 1
        if self.stream_meters is not None:
            self.stream_meters.ended(run, end.finish_reason)
        await self._finish(cur, status, service_us, body, headers)
