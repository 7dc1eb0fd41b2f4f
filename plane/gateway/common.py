"""What every route of the gateway shares: the app's keys, the mapping of a plane reply's
headers to HTTP, reading a request body within the gateway's limits, and the call options an
HTTP request's headers give (`plane.gateway.app` for the plane's own routes,
`plane.gateway.openai_compat` for the OpenAI-compatible ones)."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

import msgspec
from aiohttp import web

from plane.client import Client
from plane.client.aio import CallOptions
from plane.contract.canonical import CanonicalLog
from plane.contract.headers import CallerHeaders
from plane.contract.messages import ErrorBody, Reason, Status
from plane.contract.models import MODELS
from plane.contract.replies import now_ms
from plane.contract.subjects import MSGPACK, TRACE_HEADER_MAX, TRACE_HEADERS, Header
from plane.gateway.config import GatewayConfig
from plane.gateway.metrics import GatewayMetrics
from plane.gateway.ready import RouterProbe

SERVER_TIME_HTTP = "X-Server-Time"
JSON = "application/json"
REQUEST_TIMEOUT = 408  # HTTP only: the gateway's own answer to a body sent too slowly
# Reply headers passed through to the HTTP caller, as they came.
PASSED = (Header.REQUEST_ID, Header.STATUS, Header.REASON, Header.NODE, Header.SLOT,
          Header.SERVICE_US, Header.TICKET, Header.RETRY_AFTER_MS, Header.SERVER_TIME,
          Header.FRESHNESS, Header.TRACEPARENT, Header.TRACESTATE, Header.LOCAL)

NOT_FOUND = 404
# The gateway's own reasons, HTTP only (the plane's are `plane.contract.messages.Reason`).
HTTP_REASONS = {401: "unauthorized", NOT_FOUND: "not-found", 405: "method-not-allowed",
                REQUEST_TIMEOUT: "request-timeout", 413: Reason.TOO_LARGE.value}

_json = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_KEY = web.AppKey("client", Client)
CONFIG_KEY = web.AppKey("config", GatewayConfig)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)
PROBE_KEY = web.AppKey("router_probe", RouterProbe)
OPENAPI_KEY = web.AppKey("openapi", bytes)
CANONICAL_KEY = web.AppKey("canonical", CanonicalLog)
TENANT_KEY = web.RequestKey("tenant", str)
MODEL_KEY = web.RequestKey("model", str)  # the model a request named, once known


def http_headers(reply: Mapping[str, str], *, content_type: str | None = None) -> dict[str, str]:
    """The HTTP headers of a plane reply: Plane-* passed through, Retry-After in whole
    seconds (rounded up: a wait of 1 ms is 1 s, none is 0) next to Retry-After-Ms,
    X-Server-Time."""
    out = {k: reply[k] for k in PASSED if k in reply}
    out["Content-Type"] = content_type or reply.get(Header.CONTENT_TYPE) or JSON
    server_ms = reply.get(Header.SERVER_TIME)
    out[SERVER_TIME_HTTP] = server_ms if server_ms is not None else str(now_ms())
    after_ms = reply.get(Header.RETRY_AFTER_MS)
    if after_ms is not None and after_ms.isdigit():
        out[Header.RETRY_AFTER] = str(math.ceil(int(after_ms) / 1000))
    return out


def error_json(message: str, reason: str) -> bytes:
    return _json.encode(ErrorBody(error=message, reason=reason))


def gateway_error(status: int, reason: str, message: str, request_id: str | None
                  ) -> web.Response:
    """An error answered by the gateway itself. It carries the caller's request id when that
    one passed the check, else a fresh one (a bad id is never echoed)."""
    headers = http_headers({Header.STATUS: str(status), Header.REASON: reason,
                            Header.REQUEST_ID: request_id or uuid.uuid4().hex})
    return web.Response(status=status, body=error_json(message, reason), headers=headers)


class BodyRefused(Exception):
    """A request body the gateway will not take: too large, or too slow (then the
    connection is closed: `close`). Each route answers it in its own error shape."""

    def __init__(self, status: int, reason: str, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.reason, self.close = status, reason, close


async def read_body(request: web.Request, config: GatewayConfig) -> bytes:
    """The request's body within `max_body_bytes` and `body_timeout_s`, or `BodyRefused`."""
    too_large = f"body larger than {config.max_body_bytes} bytes"
    if request.content_length is not None and request.content_length > config.max_body_bytes:
        raise BodyRefused(Status.TOO_LARGE, Reason.TOO_LARGE, too_large)
    try:
        if request.content.is_eof():  # all of it arrived with the head: nothing to wait for
            return await request.read()
        # A body trickled in (slow POST) holds a connection as a slow head would.
        async with asyncio.timeout(config.body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyRefused(Status.TOO_LARGE, Reason.TOO_LARGE, too_large) from None
    except TimeoutError:
        raise BodyRefused(REQUEST_TIMEOUT, HTTP_REASONS[REQUEST_TIMEOUT],
                          f"the body did not arrive within {config.body_timeout_s} s",
                          close=True) from None


def call_args(caller: CallerHeaders, request: web.Request) -> CallOptions:
    """What the caller said in its headers (checked by `plane.contract.headers`), as `Client.call`
    arguments; its W3C trace context (`traceparent`, `tracestate`) goes on as it came, and
    the tenant of its bearer token (`bearer_auth`) as `Plane-Tenant`."""
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
    http = request.headers
    extra = {h: v for h in TRACE_HEADERS if (v := http.get(h)) and len(v) <= TRACE_HEADER_MAX}
    if tenant := request.get(TENANT_KEY):
        extra[Header.TENANT] = tenant
    if caller.wait_ms is not None:
        extra[Header.WAIT_MS] = str(caller.wait_ms)
    if extra:
        args["headers"] = extra
    return args


# What the metrics and the canonical line count for a request whose HTTP client left before
# its answer (nginx's "client closed request"): its handler was cancelled.
CLIENT_GONE = 499


def observe_gone(request: web.Request, model: str, started: float) -> None:
    """A request whose client disconnected before its answer (its handler cancelled)."""
    observe(request, model, web.Response(status=CLIENT_GONE), started)


def observe(request: web.Request, model: str, response: web.StreamResponse,
            started: float) -> None:
    """The metrics and the canonical log line of one HTTP request (a stream's when it ended)."""
    # Metric labels stay bounded: a caller inventing model names adds no series.
    label = model if model in MODELS else "_unknown"
    took_s = time.monotonic() - started
    request.app[METRICS_KEY].observe(label, response.status, took_s)
    canonical, error = request.app[CANONICAL_KEY], response.status >= 500
    if canonical.due(error=error):  # most lines are sampled away: their fields never built
        canonical.write(
            "http request", error=error, method=request.method, path=request.path,
            model=label, status=response.status,
            request_id=response.headers.get(Header.REQUEST_ID), us=int(took_s * 1e6))
