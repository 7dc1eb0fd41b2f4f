"""Is a router there to answer? The gateway's `/readyz`.

A connected NATS client is not enough: with no router alive every request would end in a 503
`no-capacity`, and a load balancer should send the traffic elsewhere. Routers register as NATS
micro services, so one `$SRV.PING.<prefix>-router` request answers the question: the server
says "no responders" at once when none listens, else the first router's pong comes back in
well under a millisecond. The answer is kept for `cache_s`, and probes that arrive together
share one ping, so a flood of /readyz costs NATS at most one request per `cache_s`.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.micro.service import ServiceVerb, control_subject

log = structlog.get_logger("plane.gateway")


class RouterProbe:
    def __init__(self, nc: NATS, service: str, *, timeout_s: float = 0.5,
                 cache_s: float = 1.0) -> None:
        self._nc = nc
        # nats.micro builds the control subject (`$SRV.PING.<service>`): the same function
        # the routers' own micro service subscribes with.
        self.subject = control_subject(ServiceVerb.PING, service)
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._lock = asyncio.Lock()
        self._answer: tuple[float, bool] | None = None  # (monotonic time, router answered)

    async def router_answers(self) -> bool:
        async with self._lock:  # concurrent probes wait for the one ping in flight
            now = time.monotonic()
            if self._answer is not None and now - self._answer[0] < self.cache_s:
                return self._answer[1]
            answered = await self._ping()
            self._answer = (time.monotonic(), answered)
            return answered

    async def _ping(self) -> bool:
        if not self._nc.is_connected:
            return False
        try:
            await self._nc.request(self.subject, b"", timeout=self.timeout_s)
        except (NatsError, TimeoutError) as exc:  # no responders, timeout, connection lost
            log.debug("no router answered", subject=self.subject, error=repr(exc))
            return False
        return True
