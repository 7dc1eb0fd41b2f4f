"""The plane's Python SDK, async (`Client`) and blocking (`SyncClient`).

    async with Client.connect(url) as plane:
        result = await plane.invoke("risk", {"features": [0.0] * 32}, deadline_ms=50)

    async with Client.connect(url) as plane:
        async for piece in plane.stream("tinylm", {"prompt": "hi", "max_tokens": 32},
                                        deadline_ms=500):
            print(piece, end="")

A stream (`TokenStream`, `plane.client.stream`) yields each token message's text; leaving
the loop early cancels it on the plane; `SyncClient.stream` is the same for a `for` loop.

With no `deadline_ms` the call sends none and the plane's live deadline for the model
applies (`deadline_ms.<model>` in the PLANE_CONFIG bucket).

`ConnectOptions` carries a secured server's credentials (`Client.connect(ConnectOptions(url=...,
user=..., password=...))`). Errors are those of `plane.contract.errors`: `Rejected` (429, with
`retry_after_ms` and `reason`),
`BadRequest` (400/413), `DeadlineExceeded` (504 or no answer in time; also a `TimeoutError`),
`Unavailable` (503, or nobody listening), `ConnectFailed` (an `Unavailable`: no NATS server
at the URL, with `url`), `ConnectionClosed` (an `Unavailable`: this client's connection is
closed, with `why`, e.g. the account's subscription limit). Each carries `attempts` and
`request_id`.
"""

from plane.client.aio import Client, ClientConfig
from plane.client.attempt import encode_payload
from plane.client.result import LocalCause, Result
from plane.client.stream import TokenStream
from plane.client.sync import SyncClient
from plane.contract.backoff import NO_RETRY, RetryPolicy, retry_delay_ms
from plane.contract.config import ConnectOptions
from plane.contract.errors import (
    BadRequest,
    ConnectFailed,
    ConnectionClosed,
    DeadlineExceeded,
    PlaneError,
    Rejected,
    Unavailable,
)

__all__ = [
    "NO_RETRY",
    "BadRequest",
    "Client",
    "ClientConfig",
    "ConnectFailed",
    "ConnectOptions",
    "ConnectionClosed",
    "DeadlineExceeded",
    "LocalCause",
    "PlaneError",
    "Rejected",
    "Result",
    "RetryPolicy",
    "SyncClient",
    "TokenStream",
    "Unavailable",
    "encode_payload",
    "retry_delay_ms",
]
