"""OpenAI's HTTP API in front of the plane's generation models, so that the clients users
already have (the `openai` package, curl -N) work unchanged:

    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="<bearer token>")
    for chunk in client.completions.create(model="tinylm", prompt="hello", max_tokens=32,
                                           stream=True):
        print(chunk.choices[0].text, end="")

- `POST /v1/completions` (`prompt`: one string) and `POST /v1/chat/completions` (the
  messages rendered into one prompt, a `role: content` line each, then `assistant:`), with
  `stream: false` (one JSON completion with `usage`) or `stream: true` (Server-Sent Events
  in OpenAI's chunk shape, `data: [DONE]` last; a usage chunk before it when
  `stream_options.include_usage`; `stream_options` without `stream: true` is a 400, as at
  OpenAI). `GET /v1/models` lists the models that stream. A field OpenAI's schema marks
  nullable may be null: not given. A completion's `prompt` absent or null is OpenAI's
  default, `<|endoftext|>`: generation from the document boundary alone (tinylm's END,
  which begins every prompt), the empty prompt.
- `max_tokens` (chat: also `max_completion_tokens`), `temperature`, `top_p` and `seed` are
  the plane's own (`tinylm`: greedy, temperature 0, when none is given, where OpenAI's
  default is 1). What the plane cannot do (`n` > 1, `stop`, `logprobs`, `top_logprobs`,
  `echo`, `best_of`, `suffix`, `logit_bias`, a `response_format` other than text, tools and
  functions) is a 400 naming it; the penalties (`frequency_penalty`, `presence_penalty`) are
  ignored. The body is JSON (a `Content-Type` of msgpack is a 415). A chat message's role is
  one of OpenAI's (`system`, `developer`, `user`, `assistant`, `tool`, `function`), else a
  400.
- Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: a refusal is
  a 429 with `Retry-After` (seconds) and `Retry-After-Ms` (both of which the `openai`
  package honours when it retries) and `code` the plane's reason; a `deadline` or
  `overloaded` refusal says `x-should-retry: false` (no slot frees in time, or the plane is
  past what it can promise: go elsewhere). Bad input is a 400, a model
  the plane does not stream a 404 `model_not_found`. A stream that fails once started (its
  deadline, a node lost, a cancel for it from another NATS client, the gateway's NATS
  connection dropped: 503 `unhealthy` at once) ends with an `error` data
  event, then `[DONE]`; a whole answer so cut is its error status (a cancelled one: 503
  `cancelled` with `x-should-retry: false`), never a 200 with cut text.
- Deadlines, request ids and tickets ride in the plane's headers as on `/v1/infer`
  (`Plane-Deadline-Ms`: the first token's budget for a stream; `Plane-Stream-Deadline-Ms`).
  The `openai` package retries a 429 after its `Retry-After-Ms` but cannot send the ticket
  back: the gateway holds it and gives it to that retry (`plane.gateway.tickets`). Bearer
  tokens name tenants as there. An HTTP client that goes away cancels its generation,
  mid-stream or before its whole answer (both run as a plane stream; a whole answer's
  `Plane-Deadline-Ms` bounds all of it), and is counted as status 499.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import structlog
from aiohttp import web

from plane.client import TokenStream
from plane.client.result import Result
from plane.contract.errors import BadRequest
from plane.contract.headers import read_caller
from plane.contract.messages import FINAL_REFUSALS, Reason, Status, TinyLMReply, Usage
from plane.contract.models import MODELS
from plane.contract.subjects import MSGPACK, Header
from plane.gateway.common import (
    CONFIG_KEY,
    JSON,
    MODEL_KEY,
    NOT_FOUND,
    BodyRefused,
    call_args,
    http_headers,
    observe,
    observe_gone,
    read_body,
)
from plane.gateway.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatRequest,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ErrorEnvelope,
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIUsage,
    PlaneBody,
)
from plane.gateway.sse import (
    CANCELLED_REASON,
    CANCELLED_STATUS,
    ClientGone,
    EventWriter,
    cancelled_elsewhere,
    cancelled_headers,
    event,
    open_stream,
    read_whole,
    stream_deadline_problem,
    stream_headers,
)
from plane.gateway.tickets import attach_ticket, keep_ticket

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
OPENAI_PATHS = (COMPLETIONS, CHAT, MODELS_PATH)
DONE = b"[DONE]"

log = structlog.get_logger("plane.gateway")
_json = msgspec.json.Encoder()


# -- errors ----------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               NOT_FOUND: "invalid_request_error", 408: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error",
               429: "rate_limit_error", 503: "server_error", 504: "timeout_error"}


def is_openai_path(path: str) -> bool:
    """One of OpenAI's routes, or a path under one (`/v1/completions/`, `/v1/models/x`: a
    404 or 405 there is answered in OpenAI's error shape too)."""
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def error_body(status: int, message: str, code: str | None) -> OpenAIError:
    return OpenAIError(message=message, type=ERROR_TYPES.get(status, "server_error"),
                       code=code)


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """`{"error": {"message", "type", "param", "code"}}`: the type from the status, as
    OpenAI's; the code the plane's reason (or the gateway's)."""
    err = error_body(status, message, code)
    out = {**(headers or {}), "Content-Type": JSON}
    if status == 401:
        out["WWW-Authenticate"] = 'Bearer realm="plane"'
    return web.Response(status=status, body=_json.encode(ErrorEnvelope(error=err)),
                        headers=out)


# The `openai` package retries a 5xx by itself unless told not to: a generation cancelled by
# someone else was meant to stop, so its 503 says so.
NO_RETRY_HEADER = {"x-should-retry": "false"}


def from_result(result: Result) -> web.Response:
    """A plane answer other than 200, in OpenAI's shape, with the plane's headers (the
    Retry-After of a 429, the request id)."""
    headers = http_headers(result.headers)
    if result.status == Status.BUSY:
        headers["x-should-retry"] = "false" if result.reason in FINAL_REFUSALS else "true"
    return error_response(result.status, result.error_message(), code=result.reason,
                          headers=headers)


def _usage(usage: Usage | None) -> OpenAIUsage:
    p, c = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
    return OpenAIUsage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


# -- the two APIs: what differs between completions and chat ------------------------------------
class _Shape:
    """Completions: the request type, the id prefix, and each answer's shape."""

    request_type: type[CompletionRequest] | type[ChatRequest] = CompletionRequest
    prefix = "cmpl-"

    def __init__(self) -> None:
        self.decoder = msgspec.json.Decoder(self.request_type)

    def whole(self, rid: str, created: int, model: str, reply: TinyLMReply) -> bytes:
        return _json.encode(Completion(
            id=rid, created=created, model=model, usage=_usage(reply.usage),
            choices=[CompletionChoice(text=reply.text, finish_reason=reply.finish_reason)]))

    def first(self, rid: str, created: int, model: str) -> bytes | None:
        return None

    def piece(self, rid: str, created: int, model: str, text: str) -> bytes:
        return _json.encode(Completion(id=rid, created=created, model=model,
                                       choices=[CompletionChoice(text=text)]))

    def last(self, rid: str, created: int, model: str, finish: str | None) -> bytes:
        return _json.encode(Completion(id=rid, created=created, model=model, choices=[
            CompletionChoice(text="", finish_reason=finish)]))

    def usage(self, rid: str, created: int, model: str, usage: Usage | None) -> bytes:
        return _json.encode(Completion(id=rid, created=created, model=model, choices=[],
                                       usage=_usage(usage)))


class _ChatShape(_Shape):
    request_type = ChatRequest
    prefix = "chatcmpl-"

    def whole(self, rid: str, created: int, model: str, reply: TinyLMReply) -> bytes:
        return _json.encode(ChatCompletion(
            id=rid, created=created, model=model, usage=_usage(reply.usage),
            choices=[ChatChoice(message=AssistantMessage(content=reply.text),
                                finish_reason=reply.finish_reason)]))

    def _chunk(self, rid: str, created: int, model: str, delta: Delta,
               finish: str | None = None) -> bytes:
        return _json.encode(ChatChunk(id=rid, created=created, model=model, choices=[
            ChunkChoice(delta=delta, finish_reason=finish)]))

    def first(self, rid: str, created: int, model: str) -> bytes | None:
        return self._chunk(rid, created, model, Delta(role="assistant", content=""))

    def piece(self, rid: str, created: int, model: str, text: str) -> bytes:
        return self._chunk(rid, created, model, Delta(content=text))

    def last(self, rid: str, created: int, model: str, finish: str | None) -> bytes:
        return self._chunk(rid, created, model, Delta(), finish)

    def usage(self, rid: str, created: int, model: str, usage: Usage | None) -> bytes:
        return _json.encode(ChatChunk(id=rid, created=created, model=model, choices=[],
                                      usage=_usage(usage)))


SHAPES: dict[str, _Shape] = {COMPLETIONS: _Shape(), CHAT: _ChatShape()}


# -- handlers ----------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    try:
        response, model = await _generate(request, SHAPES[request.path])
    except asyncio.CancelledError:  # the HTTP client left (its stream was cancelled)
        observe_gone(request, request.get(MODEL_KEY, "_unknown"), started)
        raise
    keep_ticket(request, response, time.monotonic())
    observe(request, model, response, started)
    return response


async def _generate(request: web.Request, shape: _Shape) -> tuple[web.StreamResponse, str]:
    try:
        caller = read_caller(request.headers)
    except BadRequest as exc:
        return error_response(400, str(exc), code=Reason.BAD_REQUEST), "_unknown"
    try:
        raw = await read_body(request, request.app[CONFIG_KEY])
    except BodyRefused as exc:
        response = error_response(exc.status, str(exc), code=exc.reason)
        if exc.close:
            response.force_close()
        return response, "_unknown"
    if (caller.content_type or "").startswith(MSGPACK):
        return error_response(415, "the OpenAI routes take a JSON body (Content-Type: "
                              "application/json); msgpack goes to /v1/infer/{model}",
                              code="unsupported_media_type"), "_unknown"
    try:
        asked = shape.decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return error_response(400, f"invalid request: {exc}", code=Reason.BAD_REQUEST), "_unknown"
    except RecursionError:  # msgspec walks every value, even of a field it then ignores
        return error_response(400, "invalid request: JSON nested too deeply",
                              code=Reason.BAD_REQUEST), "_unknown"
    model = asked.model
    spec = MODELS.get(model)
    if spec is not None:
        request[MODEL_KEY] = model  # for the count of a request its client left
    if spec is None or not spec.streams:
        served = ", ".join(sorted(m for m, s in MODELS.items() if s.streams))
        return error_response(NOT_FOUND, f"model {model!r} does not exist here; this plane "
                              f"generates with: {served}", code="model_not_found"), "_unknown"
    if bad := asked.unsupported():
        return error_response(400, f"not supported by the plane: {', '.join(bad)}",
                              code="unsupported_parameter"), model
    if asked.stream_options is not None and not asked.stream:  # as OpenAI answers it
        return error_response(400, "stream_options is only allowed with \"stream\": true: "
                              "drop it, or ask for a stream", code=Reason.BAD_REQUEST), model
    if (tokens := asked.tokens()) is not None and tokens < 1:
        return error_response(400, f"{asked.tokens_field()} must be at least 1, got {tokens}",
                              code=Reason.BAD_REQUEST), model
    if problem := stream_deadline_problem(caller):
        return error_response(400, problem, code=Reason.BAD_REQUEST), model
    try:
        prompt = asked.render()
    except BadRequest as exc:
        return error_response(400, f"invalid request: {exc}", code=Reason.BAD_REQUEST), model
    if problem := asked.too_long(prompt):  # OpenAI's code for it, which its clients know
        return error_response(400, problem, code="context_length_exceeded"), model
    body = _json.encode(PlaneBody(prompt=prompt, max_tokens=tokens,
                                  temperature=asked.temperature, seed=asked.seed,
                                  top_p=asked.top_p))
    args = call_args(caller, request)
    attach_ticket(request, caller, raw, args, time.monotonic())
    created = int(time.time())  # a wall-clock stamp, as OpenAI's
    # Generated as a stream either way (a whole answer gathered here): an HTTP client that
    # leaves (aiohttp cancels its handler) cancels it, and its slot frees within a token
    # step. As one plain request, a client gone left its slot generating for nobody up to
    # max_tokens (found from outside). A whole answer's Plane-Deadline-Ms bounds all of it.
    whole_ms = caller.stream_deadline_ms if asked.stream else (
        caller.stream_deadline_ms or caller.deadline_ms)
    stream = await open_stream(request, model, body, args, whole_ms)
    if not stream.started:
        assert stream.result is not None
        return from_result(stream.result), model
    if asked.stream:
        return await _events(request, stream, shape, created, model, asked.include_usage), model
    return await _whole(stream, shape, created, model), model


async def _whole(stream: TokenStream, shape: _Shape, created: int, model: str) -> web.Response:
    """A started stream, read to its end, as one OpenAI answer."""
    reply = await read_whole(stream)
    result = stream.result
    assert result is not None
    if reply is None and (why := cancelled_elsewhere(stream)) is not None:
        return error_response(CANCELLED_STATUS, why, CANCELLED_REASON,
                              {**cancelled_headers(stream), **NO_RETRY_HEADER})
    if reply is None:
        return from_result(result)
    rid = shape.prefix + stream.start_headers.get(Header.REQUEST_ID, stream.request_id)
    # The start's Plane-Node and Plane-Slot with the end's status and Plane-Service-Us, as
    # a whole answer on /v1/infer (`sse.whole_answer`) has them.
    return web.Response(status=200, body=shape.whole(rid, created, model, reply),
                        headers=http_headers({**stream.start_headers, **result.headers}))


async def _events(request: web.Request, stream: TokenStream, shape: _Shape, created: int,
                  model: str, include_usage: bool) -> web.StreamResponse:
    rid = shape.prefix + stream.start_headers.get(Header.REQUEST_ID, stream.request_id)
    writer = EventWriter(request, stream_headers(stream))
    try:
        await writer.open()
        if (first := shape.first(rid, created, model)) is not None:
            await writer.send(event(first))
        async with contextlib.aclosing(aiter(stream)) as pieces:
            async for piece in pieces:
                await writer.send(event(shape.piece(rid, created, model, piece)))
        result = stream.result
        assert result is not None
        if (why := cancelled_elsewhere(stream)) is not None:  # no OpenAI finish_reason says it
            await writer.send(event(_json.encode(ErrorEnvelope(error=error_body(
                CANCELLED_STATUS, why, CANCELLED_REASON)))))
        elif result.ok:
            await writer.send(event(shape.last(rid, created, model, stream.finish_reason)))
            if include_usage:
                await writer.send(event(shape.usage(rid, created, model, stream.usage)))
        else:  # ended by its deadline or a lost node, after the 200 went out
            await writer.send(event(_json.encode(ErrorEnvelope(error=error_body(
                result.status, result.error_message(), result.reason)))))
        await writer.send(event(DONE))
        await writer.close()
    except (ClientGone, asyncio.CancelledError) as exc:  # a write failed, or it was cancelled
        log.info("http client went away mid-stream; stream cancelled",
                 request_id=stream.request_id, pieces=len(stream.pieces))
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        await stream.aclose()  # the cancel, unless it ended
    return writer.response


async def models(request: web.Request) -> web.Response:
    cards = [ModelCard(id=m) for m, spec in sorted(MODELS.items()) if spec.streams]
    return web.Response(body=_json.encode(ModelList(data=cards)), content_type=JSON)


def add_routes(app: web.Application) -> None:
    app.router.add_post(COMPLETIONS, generate)
    app.router.add_post(CHAT, generate)
    app.router.add_get(MODELS_PATH, models)
