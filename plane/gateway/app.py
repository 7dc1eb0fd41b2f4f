"""HTTP to NATS and back, one to one: `POST /v1/infer/{model}` becomes a request on
`plane.infer.<model>`; the reply's Plane-Status becomes the HTTP status and its headers the
HTTP headers. A 429 carries Retry-After in whole seconds (RFC 9110), Retry-After-Ms, and
X-Server-Time (the plane's clock, epoch ms). Also GET /healthz, /readyz (a router answers),
/metrics and /openapi.json (`plane.gateway.openapi`).

Every error is JSON, `{"error": "...", "reason": "..."}`, whoever makes it: the plane, the
gateway (an unknown model is a 404 `not-found`), or aiohttp itself (404 and 405 for a path or
method it has no route for: `json_errors` rewrites its plain-text bodies).

The gateway never retries: the HTTP caller sees each refusal and decides (the ticket comes
back to it in Plane-Ticket and goes out again when it sends that header).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from plane.client import Client
from plane.client.aio import CallOptions
from plane.client.result import Result
from plane.contract.backoff import NO_RETRY
from plane.contract.canonical import CanonicalLog
from plane.contract.errors import BadRequest
from plane.contract.headers import CallerHeaders, read_caller
from plane.contract.messages import ErrorBody, Reason, Status
from plane.contract.models import MODELS
from plane.contract.replies import now_ms
from plane.contract.subjects import (
    MSGPACK,
    TRACE_HEADER_MAX,
    TRACE_HEADERS,
    Header,
    InvalidToken,
    check_token,
)
from plane.gateway.config import GatewayConfig
from plane.gateway.metrics import GatewayMetrics
from plane.gateway.openapi import build_openapi
from plane.gateway.ready import RouterProbe

SERVER_TIME_HTTP = "X-Server-Time"
JSON = "application/json"
REQUEST_TIMEOUT = 408  # HTTP only: the gateway's own answer to a body sent too slowly
# Reply headers passed through to the HTTP caller, as they came.
PASSED = (Header.REQUEST_ID, Header.STATUS, Header.REASON, Header.NODE, Header.SLOT,
          Header.SERVICE_US, Header.TICKET, Header.RETRY_AFTER_MS, Header.SERVER_TIME,
          Header.FRESHNESS, Header.TRACEPARENT, Header.TRACESTATE)

NOT_FOUND = 404
# The gateway's own reasons, HTTP only (the plane's are `plane.contract.messages.Reason`).
HTTP_REASONS = {401: "unauthorized", NOT_FOUND: "not-found", 405: "method-not-allowed",
                REQUEST_TIMEOUT: "request-timeout", 413: Reason.TOO_LARGE.value}

log = structlog.get_logger("plane.gateway")
_json = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_KEY = web.AppKey("client", Client)
CONFIG_KEY = web.AppKey("config", GatewayConfig)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)
PROBE_KEY = web.AppKey("router_probe", RouterProbe)
OPENAPI_KEY = web.AppKey("openapi", bytes)
CANONICAL_KEY = web.AppKey("canonical", CanonicalLog)
TENANT_KEY = web.RequestKey("tenant", str)


def http_headers(reply: Mapping[str, str], *, content_type: str | None = None) -> dict[str, str]:
    """The HTTP headers of a plane reply: Plane-* passed through, Retry-After in whole
    seconds (rounded up, at least 1) next to Retry-After-Ms, X-Server-Time."""
    out = {k: reply[k] for k in PASSED if k in reply}
    out["Content-Type"] = content_type or reply.get(Header.CONTENT_TYPE) or JSON
    server_ms = reply.get(Header.SERVER_TIME)
    out[SERVER_TIME_HTTP] = server_ms if server_ms is not None else str(now_ms())
    after_ms = reply.get(Header.RETRY_AFTER_MS)
    if after_ms is not None and after_ms.isdigit():
        out[Header.RETRY_AFTER] = str(max(1, math.ceil(int(after_ms) / 1000)))
    return out


def error_json(message: str, reason: str) -> bytes:
    return _json.encode(ErrorBody(error=message, reason=reason))


def _error(status: int, reason: str, message: str, request_id: str | None) -> web.Response:
    """An error answered by the gateway itself. It carries the caller's request id when that
    one passed the check, else a fresh one (a bad id is never echoed)."""
    headers = http_headers({Header.STATUS: str(status), Header.REASON: reason,
                            Header.REQUEST_ID: request_id or uuid.uuid4().hex})
    return web.Response(status=status, body=error_json(message, reason), headers=headers)


def _unauthorized() -> web.Response:
    return web.Response(status=401, body=error_json("missing or wrong bearer token",
                                                    HTTP_REASONS[401]),
                        content_type=JSON, headers={"WWW-Authenticate": 'Bearer realm="plane"'})


def _call_args(caller: CallerHeaders, http: Mapping[str, str]) -> CallOptions:
    """What the caller said in its headers (checked by `plane.contract.headers`), as `Client.call`
    arguments; its W3C trace context (`traceparent`, `tracestate`) goes on as it came."""
    args = CallOptions()
    if caller.attempt is not None:
        args["first_attempt"] = caller.attempt
    if caller.deadline_ms is not None:
        args["deadline_ms"] = caller.deadline_ms
    if caller.request_id is not None:
        args["request_id"] = caller.request_id
    if caller.ticket is not None:
        args["ticket"] = caller.ticket
    if caller.avoid_node is not None:
        args["avoid_node"] = caller.avoid_node
    if (caller.content_type or "").startswith(MSGPACK):
        args["content_type"] = MSGPACK
    trace = {h: v for h in TRACE_HEADERS if (v := http.get(h)) and len(v) <= TRACE_HEADER_MAX}
    if trace:
        args["headers"] = trace
    return args


async def infer(request: web.Request) -> web.Response:
    metrics = request.app[METRICS_KEY]
    started = time.monotonic()
    model = request.match_info["model"]
    response = await _infer(request, model)
    # Metric labels stay bounded: a caller inventing model names adds no series.
    label = model if model in MODELS else "_unknown"
    took_s = time.monotonic() - started
    metrics.observe(label, response.status, took_s)
    request.app[CANONICAL_KEY].line(
        "http request", error=response.status >= 500, method=request.method,
        path=request.path, model=label, status=response.status,
        request_id=response.headers.get(Header.REQUEST_ID), us=int(took_s * 1e6))
    return response


async def _infer(request: web.Request, model: str) -> web.Response:
    config, client = request.app[CONFIG_KEY], request.app[CLIENT_KEY]
    try:
        caller = read_caller(request.headers)  # before anything of the caller's is echoed
    except BadRequest as exc:
        return _error(Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc), exc.request_id)
    rid = caller.request_id
    try:
        check_token("model", model)
    except InvalidToken as exc:
        return _error(Status.BAD_REQUEST, Reason.BAD_REQUEST, str(exc), rid)
    if model not in MODELS:
        return _error(NOT_FOUND, HTTP_REASONS[NOT_FOUND], f"unknown model {model!r}; this "
                      f"plane serves: {', '.join(sorted(MODELS))}", rid)
    too_large = f"body larger than {config.max_body_bytes} bytes"
    if request.content_length is not None and request.content_length > config.max_body_bytes:
        return _error(Status.TOO_LARGE, Reason.TOO_LARGE, too_large, rid)
    try:
        # A body trickled in (slow POST) holds a connection as a slow head would.
        async with asyncio.timeout(config.body_timeout_s):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(Status.TOO_LARGE, Reason.TOO_LARGE, too_large, rid)
    except TimeoutError:
        response = _error(REQUEST_TIMEOUT, HTTP_REASONS[REQUEST_TIMEOUT],
                          f"the body did not arrive within {config.body_timeout_s} s", rid)
        response.force_close()
        return response
    args = _call_args(caller, request.headers)
    if tenant := request.get(TENANT_KEY):
        args["headers"] = {**args.get("headers", {}), Header.TENANT: tenant}
    result: Result = await client.call(model, body, policy=NO_RETRY, **args)
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
    our JSON error body, keeping the exception's own headers (405's Allow)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items()
                   if k.lower() not in ("content-type", "content-length")}
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else (
            f"{exc.reason}: {request.method} {request.path}")
        return web.Response(status=exc.status, headers=headers, content_type=JSON,
                            body=error_json(message, _reason_of(exc.status, exc.reason)))
    except Exception:
        log.exception("gateway handler failed", method=request.method, path=request.path)
        return web.Response(status=500, content_type=JSON,
                            body=error_json("internal error in the gateway", "internal"))


async def metrics_endpoint(request: web.Request) -> web.Response:
    data = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[CONFIG_KEY]
    if config.needs_token and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "").encode()
        tenant = _tenant_of(given, config)
        if tenant is None:
            return _unauthorized()
        if tenant:
            request[TENANT_KEY] = tenant
    return await handler(request)


def _tenant_of(given: bytes, config: GatewayConfig) -> str | None:
    """The tenant a request's `Authorization` names: "" for the plain bearer token, None
    for no token we know. Every token is compared in constant time."""
    found: str | None = None
    if config.bearer_token is not None and hmac.compare_digest(
            given, f"Bearer {config.bearer_token}".encode()):
        found = ""
    for token, tenant in config.tenant_tokens.items():
        if hmac.compare_digest(given, f"Bearer {token}".encode()):
            found = tenant
    return found


def build_app(client: Client, config: GatewayConfig, metrics: GatewayMetrics,
              probe: RouterProbe | None = None) -> web.Application:
    # aiohttp's own limit backs up our 413 for bodies sent without a Content-Length.
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[json_errors, bearer_auth])
    app[CLIENT_KEY], app[CONFIG_KEY], app[METRICS_KEY] = client, config, metrics
    app[CANONICAL_KEY] = CanonicalLog("plane.gateway.requests")
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
    return app
