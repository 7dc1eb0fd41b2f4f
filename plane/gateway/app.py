"""HTTP to NATS and back, one to one: `POST /v1/infer/{model}` becomes a request on
`plane.infer.<model>`; the reply's Plane-Status becomes the HTTP status and its headers the
HTTP headers. A 429 carries Retry-After in whole seconds (RFC 9110), Retry-After-Ms, and
X-Server-Time (the plane's clock, epoch ms). Also GET /healthz, /readyz and /metrics.

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

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from plane.backoff import NO_RETRY
from plane.client import Client
from plane.client.result import Result
from plane.errors import BadRequest
from plane.gateway.config import GatewayConfig
from plane.gateway.metrics import GatewayMetrics
from plane.headers import CallerHeaders, read_caller
from plane.messages import Reason, Status, error_body
from plane.replies import now_ms
from plane.subjects import MSGPACK, TOKEN_RE, Header, InvalidToken, check_token

SERVER_TIME_HTTP = "X-Server-Time"
JSON = "application/json"
REQUEST_TIMEOUT = 408  # HTTP only: the gateway's own answer to a body sent too slowly
# Reply headers passed through to the HTTP caller, as they came.
PASSED = (Header.REQUEST_ID, Header.STATUS, Header.REASON, Header.NODE, Header.SLOT,
          Header.SERVICE_US, Header.TICKET, Header.RETRY_AFTER_MS, Header.SERVER_TIME,
          Header.FRESHNESS)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_KEY = web.AppKey("client", Client)
CONFIG_KEY = web.AppKey("config", GatewayConfig)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)


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


def _error(status: int, reason: Reason, message: str, request_id: str | None) -> web.Response:
    """An error answered by the gateway itself. It carries the caller's request id when that
    one passed the check, else a fresh one (a bad id is never echoed)."""
    headers = http_headers({Header.STATUS: str(status), Header.REASON: reason.value,
                            Header.REQUEST_ID: request_id or uuid.uuid4().hex})
    return web.Response(status=status, body=error_body(message, reason), headers=headers)


def _unauthorized() -> web.Response:
    return web.Response(status=401, body=b'{"error": "missing or wrong bearer token", '
                        b'"reason": "unauthorized"}', content_type=JSON,
                        headers={"WWW-Authenticate": 'Bearer realm="plane"'})


def _call_args(caller: CallerHeaders) -> dict[str, object]:
    """What the caller said in its headers (checked by `plane.headers`), as `Client.call`
    arguments."""
    args: dict[str, object] = {
        "deadline_ms": caller.deadline_ms, "first_attempt": caller.attempt,
        "request_id": caller.request_id, "ticket": caller.ticket,
        "avoid_node": caller.avoid_node,
        "content_type": MSGPACK if (caller.content_type or "").startswith(MSGPACK) else None,
    }
    return {k: v for k, v in args.items() if v is not None}


async def infer(request: web.Request) -> web.Response:
    metrics = request.app[METRICS_KEY]
    started = time.monotonic()
    model = request.match_info["model"]
    response = await _infer(request, model)
    label = model if TOKEN_RE.fullmatch(model) else "_invalid"
    metrics.observe(label, response.status, time.monotonic() - started)
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
        response = _error(REQUEST_TIMEOUT, Reason.BAD_REQUEST,
                          f"the body did not arrive within {config.body_timeout_s} s", rid)
        response.force_close()
        return response
    args = _call_args(caller)
    result: Result = await client.call(model, body, policy=NO_RETRY, **args)  # type: ignore[arg-type]
    ctype = MSGPACK if args.get("content_type") == MSGPACK and result.ok else None
    return web.Response(status=result.status, body=result.body,
                        headers=http_headers(result.headers, content_type=ctype))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready while the NATS connection is up (the gateway can reach the plane)."""
    connected = request.app[CLIENT_KEY].nc.is_connected
    return web.json_response({"ready": connected}, status=200 if connected else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    data = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[CONFIG_KEY].bearer_token
    if token is not None and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _unauthorized()
    return await handler(request)


def build_app(client: Client, config: GatewayConfig, metrics: GatewayMetrics) -> web.Application:
    # aiohttp's own limit backs up our 413 for bodies sent without a Content-Length.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[bearer_auth])
    app[CLIENT_KEY], app[CONFIG_KEY], app[METRICS_KEY] = client, config, metrics
    app.router.add_post("/v1/infer/{model}", infer)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    return app
