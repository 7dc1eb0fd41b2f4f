"""The one ledger of requests and answers on the wire: every request is published with its own
reply inbox, so a second answer (or none) is seen, not hidden by a client's request mux."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.subjects import Header

NATS_STATUS = "Status"  # the header nats-py fills from a server status line ("NATS/1.0 503")


@dataclass(frozen=True, slots=True)
class Answer:
    """One answer as it arrived: when (monotonic), and the message."""

    at_s: float
    msg: Msg

    @property
    def headers(self) -> dict[str, str]:
        return self.msg.headers or {}

    @property
    def status(self) -> int:
        """The plane's status; 503 for the broker's own "no responders" (no router was
        subscribed for a moment: one answer, just not from the plane); -1 for anything else."""
        h = self.headers
        if Header.STATUS in h:
            return int(h[Header.STATUS])
        return 503 if h.get(NATS_STATUS) == "503" else -1

    @property
    def reason(self) -> str:
        h = self.headers
        if Header.STATUS not in h and h.get(NATS_STATUS) == "503":
            return "no-responders"
        return h.get(Header.REASON, "") if Header.STATUS in h else repr(h)

    @property
    def request_id(self) -> str | None:
        return self.headers.get(Header.REQUEST_ID)


@dataclass
class Ledger:
    nc: Client
    sent_s: dict[int, float] = field(default_factory=dict)  # id -> monotonic send time
    deadline_ms: dict[int, int] = field(default_factory=dict)
    answers: dict[int, list[Answer]] = field(default_factory=dict)
    inbox: str = ""

    async def start(self) -> Ledger:
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_answer)
        return self

    async def _on_answer(self, msg: Msg) -> None:
        i = int(msg.subject.rsplit(".", 1)[1])
        self.answers.setdefault(i, []).append(Answer(time.monotonic(), msg))

    @staticmethod
    def request_id(i: int) -> str:
        return f"ledger-{i}"

    async def send(self, subject: str, body: bytes, deadline_ms: int,
                   headers: dict[str, str] | None = None) -> int:
        i = len(self.sent_s)
        self.sent_s[i] = time.monotonic()
        self.deadline_ms[i] = deadline_ms
        h = {Header.DEADLINE_MS: str(deadline_ms), Header.REQUEST_ID: self.request_id(i)}
        h.update(headers or {})
        await self.nc.publish(subject, body, reply=f"{self.inbox}.{i}", headers=h)
        return i

    async def settle(self, timeout_s: float, quiet_s: float = 0.3) -> None:
        """Wait until every request has an answer (or `timeout_s`), then `quiet_s` more so
        that a second answer would be seen."""
        t_end = time.monotonic() + timeout_s
        while len(self.answers) < len(self.sent_s) and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        await asyncio.sleep(quiet_s)

    def unanswered(self) -> list[int]:
        return [i for i in self.sent_s if i not in self.answers]

    def answered_twice(self) -> list[int]:
        return [i for i, a in self.answers.items() if len(a) > 1]

    def first(self, i: int) -> Answer:
        return self.answers[i][0]

    def status(self, i: int) -> int:
        return self.first(i).status

    def latency_ms(self, i: int) -> float:
        return (self.first(i).at_s - self.sent_s[i]) * 1000

    def statuses(self) -> Counter[int]:
        return Counter(self.status(i) for i in self.answers)
