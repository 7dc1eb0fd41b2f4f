"""The plane's Python SDK, async (`Client`) and blocking (`SyncClient`).

    async with Client.connect(url) as plane:
        result = await plane.invoke("risk", {"features": [0.0] * 32}, deadline_ms=50)

Errors are those of `plane.errors`: `Rejected` (429, with `retry_after_ms` and `reason`),
`BadRequest` (400/413), `DeadlineExceeded` (504 or no answer in time; also a `TimeoutError`),
`Unavailable` (503, or nobody listening). Each carries `attempts` and `request_id`.
"""

from plane.backoff import NO_RETRY, RetryPolicy, retry_delay_ms
from plane.client.aio import Client, ClientConfig, encode_payload
from plane.client.result import Result
from plane.client.sync import SyncClient

__all__ = [
    "NO_RETRY",
    "Client",
    "ClientConfig",
    "Result",
    "RetryPolicy",
    "SyncClient",
    "encode_payload",
    "retry_delay_ms",
]
