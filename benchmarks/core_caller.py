"""The same plain caller for the plane and the floor: one core-NATS request per send (no
SDK, no retries, so one plane request is one router decision), as a pulse target (so pulse's
open-loop driver can use it), and a closed-loop driver over it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from types import TracebackType

import nats
import nats.errors
from nats.aio.client import Client

from plane.contract.subjects import Header
from plane.pulse.outcome import ERROR, TIMEOUT, Attempts, Outcome

REQUEST_TIMEOUT_S = 5.0


def _us_since(t: float) -> int:
    return int((time.monotonic() - t) * 1e6)


class CoreRequest:
    """A pulse target: one plain core-NATS request per send, no SDK and no retries, the same
    code for both paths. The floor answers with no status header: that counts as a 200."""

    def __init__(self, url: str, subject: str, headers: dict[str, str] | None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.name = subject
        self._url, self._subject, self._headers = url, subject, headers
        self._timeout_s = timeout_s
        self._nc: Client | None = None
        self.reasons: Counter[str] = Counter()  # Plane-Reason of every refusal

    async def __aenter__(self) -> CoreRequest:
        self._nc = await nats.connect(self._url, name="bench-caller")
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            await nc.close()

    async def send(self, body: bytes) -> Attempts:
        assert self._nc is not None
        sent = time.monotonic()
        try:
            msg = await self._nc.request(self._subject, body, timeout=self._timeout_s,
                                         headers=self._headers)
        except TimeoutError:  # nats.errors.TimeoutError is one too
            return Attempts(statuses=(0,), final=TIMEOUT, last_attempt_us=_us_since(sent))
        except nats.errors.Error:  # no responders, a closed connection: an answer to count
            return Attempts(statuses=(0,), final=ERROR, last_attempt_us=_us_since(sent))
        headers = msg.headers or {}
        status = headers.get(Header.STATUS, "200")
        if status != "200":
            self.reasons[f"{status} {headers.get(Header.REASON, '?')}"] += 1
        return Attempts(statuses=(int(status),), final=status, last_attempt_us=_us_since(sent))


@dataclass(frozen=True)
class Size:
    """How much each load sends: `requests` when given, else for `seconds`."""

    requests: int | None
    seconds: float


async def closed_loop(target: CoreRequest, body: bytes, callers: int,
                      size: Size) -> list[Outcome]:
    """`callers` callers, each sending its next request when its last one is answered."""
    outcomes: list[Outcome] = []
    start = time.monotonic()
    stop_at = start + size.seconds
    left = size.requests

    async def caller() -> None:
        nonlocal left
        while time.monotonic() < stop_at if left is None else left > 0:
            if left is not None:
                left -= 1
            sent = time.monotonic()
            attempts = await target.send(body)
            outcomes.append(Outcome(scheduled_s=sent - start,
                                    latency_us=attempts.last_attempt_us, attempts=attempts))

    async with asyncio.TaskGroup() as tg:
        for _ in range(callers):
            tg.create_task(caller())
    return outcomes
