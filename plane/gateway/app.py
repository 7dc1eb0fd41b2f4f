"""HTTP to NATS and back, one to one: `POST /v1/infer/{model}` becomes a request on
`plane.infer.<model>`; the reply's Plane-Status becomes the HTTP status and its headers the
HTTP headers. A 429 carries Retry-After in whole seconds (RFC 9110), Retry-After-Ms, and
X-Server-Time (the plane's clock, epoch ms). Also GET /healthz, /readyz (a router answers),
/metrics and /openapi.json (`plane.gateway.openapi`).

Every error is JSON, `{"error": "...", "reason": "..."}`, whoever makes it: the plane, the
gateway (an unknown model is a 404 `not-found`), or aiohttp itself (404 and 405 for a path or
method it has no route for: `json_errors` rewrites its plain-text bodies).

The gateway never retries: the HTTP caller sees each refusal and decides (the ticket comes
back to it in Plane-Ticket and goes out again when it sends that header). For a caller that
cannot send it (the `openai` package, curl --retry) the gateway holds the ticket of each 429
and gives it to the retry, a request that repeats the refused one exactly at its
Retry-After-Ms or its Retry-After (`plane.gateway.tickets`). Clients of one token that send
identical bodies send an Idempotency-Key per request (or Plane-Attempt) to keep theirs.

Streams: `Plane-Stream: 1` (or `Accept: text/event-stream`) on a model that streams answers
with Server-Sent Events (`plane.gateway.sse`); `POST /v1/completions` and
`/v1/chat/completions` speak OpenAI's API (`plane.gateway.openai_compat`). A generation asked
for as one reply runs as a plane stream too, gathered into the plain reply, so that an HTTP
client that leaves cancels it (`sse.whole_answer`).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from plane.client import Client
from plane.contract.backoff import NO_RETRY
from plane.contract.canonical import CanonicalLog
from plane.contract.errors import BadRequest
from plane.contract.headers import read_caller
from plane.contract.messages import Reason, Status
from plane.contract.models import MODELS
from plane.contract.subjects import MSGPACK, InvalidToken, check_token
from plane.gateway import openai_compat
from plane.gateway.common import (
    CANONICAL_KEY,
    CLIENT_KEY,
    CONFIG_KEY,
    HTTP_REASONS,
    JSON,
    METRICS_KEY,
    NOT_FOUND,
    OPENAPI_KEY,
    PROBE_KEY,
    TENANT_KEY,
    BodyRefused,
    Handler,
    call_args,
    error_json,
    gateway_error,
    http_headers,
    observe,
    observe_gone,
    read_body,
)
from plane.gateway.config import GatewayConfig
from plane.gateway.metrics import GatewayMetrics
from plane.gateway.openapi import build_openapi
from plane.gateway.ready import RouterProbe
from plane.gateway.sse import (
    open_stream,
    plane_events,
    stream_deadline_problem,
    wants_stream,
    whole_answer,
)
from plane.gateway.tickets import TICKETS_KEY, HeldTickets, attach_ticket, keep_ticket

__all__ = ["build_app", "http_headers"]

log = structlog.get_logger("plane.gateway")
_json = msgspec.json.Encoder()


async def infer(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    model = request.match_info["model"]
    try:
        response = await _infer(request, model)
    except asyncio.CancelledError:  # the HTTP client left (a stream of its was cancelled)
        observe_gone(request, model, started)
        raise
    keep_ticket(request, response, time.monotonic())
    observe(request, model, response, started)
    return response


async def _infer(request: web.Request, model: str) -> web.StreamResponse:
    config, client = request.app[CONFIG_KEY], request.app[CLIENT_KEY]
    try:
        caller = read_caller(request.headers)  # before anything of the caller's is echoed
    except BadRequest as exc:
        return gateway_error(Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc), exc.request_id)
    rid = caller.request_id
    try:
        check_token("model", model)
    except InvalidToken as exc:
        return gateway_error(Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc), rid)
    if model not in MODELS:
        return gateway_error(NOT_FOUND, HTTP_REASONS[NOT_FOUND], f"unknown model {model!r}; "
                             f"this plane serves: {', '.join(sorted(MODELS))}", rid)
    try:
        body = await read_body(request, config)
    except BodyRefused as exc:
        response = gateway_error(exc.status, exc.reason, str(exc), rid)
        if exc.close:
            response.force_close()
        return response
    args = call_args(caller, request)
    as_stream = wants_stream(caller, request, model)
    if as_stream and (problem := stream_deadline_problem(caller)):
        return gateway_error(Status.BAD_REQUEST, Reason.BAD_REQUEST, problem, rid)
    attach_ticket(request, caller, body, args, time.monotonic())
    if as_stream:
        stream = await open_stream(request, model, body, args, caller.stream_deadline_ms)
        if stream.started:
            return await plane_events(request, stream)
        result = stream.result  # its one message: a refusal, answered as any request's
    elif MODELS[model].streams:  # a whole generation: run as a stream, so a client gone stops it
        return await whole_answer(request, model, body, args, caller.deadline_ms)
    else:
        result = await client.call(model, body, policy=NO_RETRY, **args)
    assert result is not None
    ctype = MSGPACK if args.get("content_type") == MSGPACK and result.ok else None
    return web.Response(status=result.status, body=result.body,
                        headers=http_headers(result.headers, content_type=ctype))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready while the NATS connection is up and a router answers (`RouterProbe`): with no
    router every request would be a 503."""
    connected = request.app[CLIENT_KEY].nc.is_connected
    router = connected and await request.app[PROBE_KEY].router_answers()
    return web.json_response({"ready": router, "nats": connected, "router": router},
                             status=200 if router else 503)


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_KEY], content_type=JSON)


def _reason_of(status: int, phrase: str) -> str:
    return HTTP_REASONS.get(status) or phrase.lower().replace(" ", "-") or "error"


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp answers a path or method it has no route for (404, 405) by raising an
    HTTPException with a plain-text body; a bug in a handler would be a text 500. Both become
    our JSON error body, keeping the exception's own headers (405's Allow). A 500 is
    counted and logged as any answer (`observe`): the route's own count never ran."""
    started = time.monotonic()
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items()
                   if k.lower() not in ("content-type", "content-length")}
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else (
            f"{exc.reason}: {request.method} {request.path}")
        if openai_compat.is_openai_path(request.path):  # OpenAI's clients read its shape
            return openai_compat.error_response(exc.status, message,
                                                _reason_of(exc.status, exc.reason), headers)
        return web.Response(status=exc.status, headers=headers, content_type=JSON,
                            body=error_json(message, _reason_of(exc.status, exc.reason)))
    except Exception:
        log.exception("gateway handler failed", method=request.method, path=request.path)
        message = "internal error in the gateway"
        response = (openai_compat.error_response(500, message, "internal")
                    if openai_compat.is_openai_path(request.path) else
                    web.Response(status=500, content_type=JSON,
                                 body=error_json(message, "internal")))
        observe(request, request.match_info.get("model", "_unknown"), response, started)
        return response


async def metrics_endpoint(request: web.Request) -> web.Response:
    data = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _unauthorized(request: web.Request) -> web.Response:
    message = "missing or wrong bearer token"
    if openai_compat.is_openai_path(request.path):
        return openai_compat.error_response(401, message, "invalid_api_key")
    return web.Response(status=401, body=error_json(message, HTTP_REASONS[401]),
                        content_type=JSON, headers={"WWW-Authenticate": 'Bearer realm="plane"'})


@web.middleware
async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[CONFIG_KEY]
    if config.needs_token and request.path.startswith("/v1/"):
        tenant = _tenant_of(_bearer(request.headers.get("Authorization", "")), config)
        if tenant is None:
            return _unauthorized(request)
        if tenant:
            request[TENANT_KEY] = tenant
    return await handler(request)


def _bearer(authorization: str) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme's case is the
    client's: RFC 9110 11.1), None for any other."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


def _tenant_of(given: bytes | None, config: GatewayConfig) -> str | None:
    """The tenant a request's bearer token names: "" for the plain bearer token, None for
    none or a token we do not know. Every token is compared in constant time."""
    if given is None:
        return None
    found: str | None = None
    if config.bearer_token is not None and hmac.compare_digest(
            given, config.bearer_token.encode()):
        found = ""
    for token, tenant in config.tenant_tokens.items():
        if hmac.compare_digest(given, token.encode()):
            found = tenant
    return found


def build_app(client: Client, config: GatewayConfig, metrics: GatewayMetrics,
              probe: RouterProbe | None = None) -> web.Application:
    # aiohttp's own limit backs up our 413 for bodies sent without a Content-Length.
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[json_errors, bearer_auth])
    app[CLIENT_KEY], app[CONFIG_KEY], app[METRICS_KEY] = client, config, metrics
    app[CANONICAL_KEY] = CanonicalLog("plane.gateway.requests")
    app[TICKETS_KEY] = HeldTickets(config.max_held_tickets)
    app[PROBE_KEY] = probe or RouterProbe(client.nc, config.names.router_service,
                                          timeout_s=config.ready_timeout_s,
                                          cache_s=config.ready_cache_s)
    doc: dict[str, Any] = build_openapi(bearer=config.needs_token)
    app[OPENAPI_KEY] = _json.encode(doc)
    app.router.add_post("/v1/infer/{model}", infer)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/openapi.json", openapi)
    openai_compat.add_routes(app)
    return app
