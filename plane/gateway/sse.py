"""A plane stream as Server-Sent Events: `POST /v1/infer/{model}` with `Plane-Stream: 1` (or
`Accept: text/event-stream` for a model that streams).

    curl -N -H 'Plane-Stream: 1' -d '{"prompt": "hello", "max_tokens": 32}' \\
        http://127.0.0.1:8080/v1/infer/tinylm

    event: start
    data: {"request_id":"...","node":"node0-tinylm","slot":0}

    event: token
    data: {"seq":1,"text":"w"}
    ...
    event: end
    data: {"status":200,"finish_reason":"length","usage":{...},"request_id":"..."}

The HTTP status is the first message's: the gateway waits for it before it sends a header. A
refusal (400, 429 with Retry-After and Plane-Ticket, 503) is the stream's only message and
goes out as the ordinary JSON answer of `POST /v1/infer/{model}`; a `start` makes it a 200
`text/event-stream`, and whatever ends the stream after that (the node's `end`, a router's
503/504 for a node that died, the gateway's own 503 `unhealthy` the moment its NATS
connection drops) is its `end` event, with the status inside. An HTTP client that
goes away mid-stream cancels it (`TokenStream.aclose`): its slot frees within a token step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import msgspec
import structlog
from aiohttp import web

from plane.client import TokenStream
from plane.client.aio import CallOptions
from plane.client.result import header_int
from plane.contract.backoff import NO_RETRY
from plane.contract.headers import CallerHeaders
from plane.contract.messages import Status, StreamFinish, TinyLMReply, Usage, msgpack_encoder
from plane.contract.models import MODELS
from plane.contract.subjects import MSGPACK, Header
from plane.gateway.common import CLIENT_KEY, JSON, error_json, http_headers

EVENT_STREAM = "text/event-stream"
# A generation cancelled by someone other than its HTTP client (a cancel for its request id
# on its `Plane-Cancel-Subject`, from another NATS client of the plane's or its tenant's
# account): the gateway cancels only for a client gone, which reads nothing more. Its text is
# cut, so it is not a 200: an OpenAI client knows no `cancelled` finish and would take the
# cut text for a whole one (`finish_reason` is "stop" or "length" in a whole answer). 503:
# the plane's status for a generation it started and did not finish (a node lost mid-stream
# is a 503 too); not a 4xx, the client asked for nothing wrong. The plane's own SSE route
# keeps its `end` event, finish `cancelled`, as the stream's reader sees it on NATS.
CANCELLED_STATUS = Status.UNAVAILABLE
CANCELLED_REASON = StreamFinish.CANCELLED.value

log = structlog.get_logger("plane.gateway")
_json = msgspec.json.Encoder()


class StartEvent(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    node: str | None
    slot: int | None


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    text: str


class EndEvent(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    finish_reason: str | None
    usage: Usage | None
    request_id: str
    error: str | None = None
    reason: str | None = None


def event(data: bytes, name: str | None = None) -> bytes:
    """One SSE event. `data` is one line (compact JSON, or `[DONE]`)."""
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + data + b"\n\n"


def wants_stream(caller: CallerHeaders, request: web.Request, model: str) -> bool:
    """`Plane-Stream: 1` asks the plane (which refuses it, 400, for a model that does not
    stream); `Accept: text/event-stream` (what a browser's EventSource sends) streams only
    a model that can."""
    if caller.stream:
        return True
    spec = MODELS.get(model)
    return spec is not None and spec.streams and EVENT_STREAM in request.headers.get(
        "Accept", "")


class ClientGone(Exception):
    """The HTTP client closed its connection mid-stream."""


class EventWriter:
    """A `text/event-stream` response: sent once the stream started, written event by event;
    a write to a client that went away raises `ClientGone`."""

    def __init__(self, request: web.Request, headers: Mapping[str, str]) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers={
            **headers, "Content-Type": EVENT_STREAM, "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})  # proxies (nginx) must not hold events back

    async def open(self) -> None:
        try:
            await self.response.prepare(self.request)
        except ConnectionResetError as exc:
            raise ClientGone(str(exc)) from exc

    async def send(self, chunk: bytes) -> None:
        try:
            await self.response.write(chunk)
        except ConnectionResetError as exc:  # aiohttp: "Cannot write to closing transport"
            raise ClientGone(str(exc)) from exc

    async def close(self) -> None:
        with contextlib.suppress(ConnectionResetError):  # gone as it ended: nothing to do
            await self.response.write_eof()


def stream_headers(stream: TokenStream) -> dict[str, str]:
    """The HTTP headers of a started stream: its start's, as a reply's are mapped."""
    return http_headers(stream.start_headers)


def stream_deadline_problem(caller: CallerHeaders) -> str | None:
    """Why a stream's deadlines cannot be kept, in the caller's own header values (None: they
    can): the whole stream's must be at least the first token's (`TokenStream` refuses it
    too, but in its argument names)."""
    whole, first = caller.stream_deadline_ms, caller.deadline_ms
    if whole is not None and first is not None and whole < first:
        return (f"{Header.STREAM_DEADLINE_MS} ({whole}) is shorter than {Header.DEADLINE_MS} "
                f"({first}), the budget for the first token: give the whole stream at least "
                "as long")
    return None


async def open_stream(request: web.Request, model: str, body: bytes, args: CallOptions,
                      stream_deadline_ms: int | None) -> TokenStream:
    """A stream to `model`, started (or refused: `started` is False, `result` says why).
    The gateway never retries: the HTTP caller sees each refusal and decides."""
    stream = request.app[CLIENT_KEY].stream(
        model, body, policy=NO_RETRY, raise_errors=False,
        stream_deadline_ms=stream_deadline_ms, **args)
    try:
        await stream.start()
    except BaseException:
        await stream.aclose()
        raise
    return stream


def cancelled_elsewhere(stream: TokenStream) -> str | None:
    """Why a stream that ended 200 is no whole answer, for its HTTP caller (None: it is, or
    it did not end 200): it was cancelled by someone else (`CANCELLED_STATUS`)."""
    result = stream.result
    if result is None or not result.ok or stream.finish_reason != StreamFinish.CANCELLED:
        return None
    tokens = stream.usage.completion_tokens if stream.usage else len(stream.pieces)
    return (f"the generation was cancelled on the plane after {tokens} tokens, by a cancel"
            f" for its request id ({stream.request_id}) on its stream's "
            f"{Header.CANCEL_SUBJECT}, not by this client: its text is not whole; send the "
            "request again for a whole answer")


def cancelled_headers(stream: TokenStream) -> dict[str, str]:
    """The HTTP headers of a stream cancelled elsewhere: the start's and the end's, with the
    status and reason it is answered with."""
    assert stream.result is not None
    return http_headers({**stream.start_headers, **stream.result.headers,
                         Header.STATUS: str(int(CANCELLED_STATUS)),
                         Header.REASON: CANCELLED_REASON}, content_type=JSON)


async def read_whole(stream: TokenStream) -> TinyLMReply | None:
    """A started stream read to its end, as one answer (`{"text", "finish_reason", "usage"}`,
    what a request without `Plane-Stream` gets); None when it did not end 200
    (`stream.result` says how) or was cancelled by someone else (`cancelled_elsewhere` says
    how). Cancelled with the handler (an HTTP client gone), it cancels the stream: its slot
    frees within a token step."""
    try:
        async with contextlib.aclosing(aiter(stream)) as pieces:
            async for _ in pieces:
                pass
    finally:
        await stream.aclose()  # the cancel, when the HTTP client left (handler cancelled)
    assert stream.result is not None
    if not stream.result.ok or cancelled_elsewhere(stream) is not None:
        return None
    return TinyLMReply(text=stream.text, finish_reason=stream.finish_reason or "stop",
                       usage=stream.usage or Usage(prompt_tokens=0, completion_tokens=0,
                                                   slot_us=0, sm_ms=0.0))


async def whole_answer(request: web.Request, model: str, body: bytes, args: CallOptions,
                       deadline_ms: int | None) -> web.Response:
    """A generation asked for as one reply, run as a plane stream and gathered here: an HTTP
    client that leaves cancels it (as one plain request, its slot generated on to
    `max_tokens` for nobody). The answer is the plain request's: the body the node would
    have sent (JSON, or msgpack when asked), the start's `Plane-Node` and `Plane-Slot`, the
    end's status and `Plane-Service-Us`; `deadline_ms` (Plane-Deadline-Ms) bounds the whole
    answer, as a plain request's does. A refusal is answered as any request's; a generation
    cancelled by someone else is a 503 `cancelled` (`CANCELLED_STATUS`)."""
    stream = await open_stream(request, model, body, args, deadline_ms)
    reply = await read_whole(stream) if stream.started else None
    result = stream.result
    assert result is not None
    if reply is None and (why := cancelled_elsewhere(stream)) is not None:
        return web.Response(status=CANCELLED_STATUS, body=error_json(why, CANCELLED_REASON),
                            headers=cancelled_headers(stream))
    if reply is None:
        return web.Response(status=result.status, body=result.body,
                            headers=http_headers(result.headers))
    msgpack = args.get("content_type") == MSGPACK
    data = msgpack_encoder.encode(reply) if msgpack else _json.encode(reply)
    return web.Response(status=result.status, body=data, headers=http_headers(
        {**stream.start_headers, **result.headers}, content_type=MSGPACK if msgpack else None))


async def plane_events(request: web.Request, stream: TokenStream) -> web.StreamResponse:
    """Serve a started stream as the plane's own events (start, token..., end)."""
    writer = EventWriter(request, stream_headers(stream))
    start = stream.start_headers
    try:
        await writer.open()
        await writer.send(event(_json.encode(StartEvent(
            request_id=start.get(Header.REQUEST_ID, stream.request_id),
            node=start.get(Header.NODE), slot=header_int(start, Header.SLOT))), "start"))
        async with contextlib.aclosing(aiter(stream)) as pieces:
            async for piece in pieces:
                await writer.send(event(_json.encode(TokenEvent(seq=stream.seq, text=piece)),
                                        "token"))
        await writer.send(event(_json.encode(end_event(stream)), "end"))
        await writer.close()
    except (ClientGone, asyncio.CancelledError) as exc:  # a write failed, or it was cancelled
        log.info("http client went away mid-stream; stream cancelled",
                 request_id=stream.request_id, pieces=len(stream.pieces))
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        await stream.aclose()  # the cancel, unless it ended
    return writer.response


def end_event(stream: TokenStream) -> EndEvent:
    result = stream.result
    assert result is not None
    error = reason = None
    if not result.ok:
        error, reason = result.error_message(), result.reason
    return EndEvent(status=result.status, finish_reason=stream.finish_reason,
                    usage=stream.usage, request_id=stream.request_id, error=error,
                    reason=reason)
