"""Inference as a NATS micro endpoint: `plane.infer.>` listed in `$SRV.INFO` and counted in
`$SRV.STATS` (requests, errors, processing time), as the NATS services standard has it, so
`nats micro stats` and any service-aware tool see the plane's own traffic.

nats-py's micro `Endpoint` subscribes, counts and times each request around our handler (the
time is the router's decision on the subscription's task: a placed request's answer comes
from the node later). Two things it does not do, done here with its attributes (nats-py is
pinned, `pyproject.toml`; `tests/test_micro.py` checks both against it):
- an error is counted only when the handler raises, and the router answers its errors
  itself (a raise would make micro send a second answer): `count_error` counts a request the
  router answered with an error status;
- `Service.stop` unsubscribes, which drops requests delivered but not yet read: the router
  drains the subscription first (every request it brought is answered), then `detach` takes
  the endpoint out of the service so that its stop does not touch the closed subscription;
- its subscription takes nats-py's default pending limit (half a million messages): `start`
  puts in its place one with the router's own limit, so that a burst costs bounded memory
  (what overflows is answered, `plane.contract.natsconn.on_overflow`). Its callback counts
  and times each request in the endpoint's statistics as the endpoint's own handler does
  (`Endpoint._handle_request`), without the `Request` and the two coroutines it puts
  around our handler per request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request
from nats.micro.service import Endpoint, Service


class InferEndpoint:
    def __init__(self, service: Service, *, subject: str, queue: str,
                 handler: Callable[[Msg], Awaitable[None]], metadata: dict[str, str],
                 name: str = "infer") -> None:
        self._service = service
        self._name = name
        self._subject = subject
        self._queue = queue
        self._handler = handler
        self._metadata = metadata
        self._endpoint: Endpoint | None = None

    async def start(self, nc: Client, pending_limit: int) -> Subscription:
        """Listen, at most `pending_limit` requests read and not yet handled; the
        subscription (drained at stop)."""
        await self._service.add_endpoint(name=self._name, subject=self._subject,
                                         queue_group=self._queue, handler=self._on_request,
                                         metadata=self._metadata)
        endpoint = self._endpoint = self._service._endpoints[-1]
        theirs = endpoint._subscription
        ours = await nc.subscribe(self._subject, queue=self._queue, cb=self._counted,
                                  pending_msgs_limit=pending_limit)
        if theirs is not None:
            await theirs.unsubscribe()
        endpoint._subscription = ours
        return ours

    async def _on_request(self, req: Request) -> None:
        await self._handler(req._msg)  # (the endpoint's own subscription, until `start` ends)

    async def _counted(self, msg: Msg) -> None:
        """`Endpoint._handle_request` on the message itself: count, call, time; a handler
        that raises is counted an error and answered 500, as there."""
        endpoint = self._endpoint
        assert endpoint is not None
        start_ns = time.perf_counter_ns()
        endpoint._num_requests += 1
        try:
            await self._handler(msg)
        except Exception as error:
            endpoint._num_errors += 1
            endpoint._last_error = repr(error)  # type: ignore[assignment]  # typed None
            await Request(msg).respond_error("500", repr(error))
        endpoint._processing_time += time.perf_counter_ns() - start_ns
        endpoint._average_processing_time = int(
            endpoint._processing_time / endpoint._num_requests)

    def count_error(self, status: int, text: str) -> None:
        if self._endpoint is not None:
            self._endpoint._num_errors += 1
            self._endpoint._last_error = f"{status} {text}"[:200]  # type: ignore[assignment]  # nats-py types it None

    def detach(self) -> None:
        """After its subscription was drained: out of the service, whose stop would
        unsubscribe it again."""
        if self._endpoint is not None and self._endpoint in self._service._endpoints:
            self._service._endpoints.remove(self._endpoint)
