"""The gateway as an async context manager: connects to NATS, serves HTTP on loopback (by
default), and on exit stops taking requests, lets in-flight ones finish, then drains NATS.

    async with Gateway(GatewayConfig(port=0), ConnectOptions(url=url)) as gw:
        print(gw.url)   # http://127.0.0.1:<port>
"""

from __future__ import annotations

from types import TracebackType

import structlog
from aiohttp import web
from nats.aio.client import Client as NATS

from plane.client import Client, ClientConfig
from plane.contract.config import ConnectOptions
from plane.contract.errors import cannot_listen
from plane.contract.natsconn import close, connect
from plane.gateway.app import build_app
from plane.gateway.config import GatewayConfig
from plane.gateway.metrics import GatewayMetrics

log = structlog.get_logger("plane.gateway")

# How long aiohttp reads on (and drops) the rest of a body the gateway answered early, so that
# a client still sending sees the answer rather than a reset, before it closes the connection.
LINGERING_S = 1.0
# aiohttp's parser refuses a head line (the request line, one header) over 8190 bytes with a
# text/plain 400 of its own, before any handler runs; the plane's limit is on a request's
# headers together (`MAX_HEADER_BYTES`, 8 KiB), refused in our JSON by `read_caller`. So its
# parser takes lines up to 64 KiB, and ours says what is wrong; a line over that is still
# aiohttp's plain 400.
MAX_HEAD_LINE = 64 * 1024


class Gateway:
    def __init__(self, config: GatewayConfig, connect_opts: ConnectOptions,
                 metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.connect_opts = connect_opts
        self.metrics = metrics or GatewayMetrics()
        self.port: int | None = None
        self._nc: NATS | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("gateway not started")
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._nc = await connect(self.connect_opts)
        try:
            # A call or stream in flight when the connection drops is answered at once
            # (503 `unhealthy`; a stream's SSE ends with it), not held to its deadline for
            # an answer the drop lost.
            client = Client(self._nc, ClientConfig(
                names=self.config.names, reconnect_wait_ms=self.config.reconnect_wait_ms,
                end_on_disconnect=True))
            app = build_app(client, self.config, self.metrics)
            # aiohttp's keep-alive timer is also its only head timeout: in 3.14 (checked in
            # `RequestHandler.connection_made`) it runs from the moment a connection opens,
            # and again after each answer, and when it fires on a connection still waiting
            # for a whole request head it closes it. Its default (3630 s) let a client
            # trickling a head hold a connection for an hour.
            # After an answer given before the whole body came (a 408 for a body trickled
            # in, a 413, a 401), aiohttp reads the rest for its lingering time before it
            # closes: 10 s by default, a connection held for a client we already answered.
            # A client that disconnects cancels its handler (aiohttp's default is to let it
            # run on): a generation's stream is cancelled then, and its slot frees.
            self._runner = web.AppRunner(app, access_log=None,
                                         shutdown_timeout=self.config.shutdown_timeout_s,
                                         keepalive_timeout=self.config.header_timeout_s,
                                         lingering_time=LINGERING_S, handler_cancellation=True,
                                         max_line_size=MAX_HEAD_LINE,
                                         max_field_size=MAX_HEAD_LINE)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.config.host, self.config.port)
            try:
                await site.start()
            except OSError as exc:
                raise cannot_listen("plane gateway", self.config.host, self.config.port, exc,
                                    option="--port", host_option="--host") from None
        except BaseException:
            await self.stop()
            raise
        self.port = int(self._runner.addresses[0][1])
        log.info("gateway started", url=self.url, nats=self.connect_opts.url,
                 auth=self.config.needs_token)

    async def stop(self) -> None:
        """Stop listening, finish in-flight requests, drain NATS; idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        nc, self._nc = self._nc, None
        if nc is not None:
            await close(nc)
        if runner is not None:
            log.info("gateway stopped")

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()
