"""A ledger of requests and answers on the wire: every request is published with its own
reply inbox, so a second answer (or none) is seen, not hidden by a client's request mux."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.subjects import Header


@dataclass
class Ledger:
    nc: Client
    sent: dict[int, float] = field(default_factory=dict)  # id -> monotonic send time
    deadline_ms: dict[int, int] = field(default_factory=dict)
    answers: dict[int, list[tuple[float, Msg]]] = field(default_factory=dict)
    inbox: str = ""

    async def start(self) -> Ledger:
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_answer)
        return self

    async def _on_answer(self, msg: Msg) -> None:
        i = int(msg.subject.rsplit(".", 1)[1])
        self.answers.setdefault(i, []).append((time.monotonic(), msg))

    async def send(self, subject: str, body: bytes, deadline_ms: int,
                   headers: dict[str, str] | None = None) -> int:
        i = len(self.sent)
        self.sent[i] = time.monotonic()
        self.deadline_ms[i] = deadline_ms
        h = {Header.DEADLINE_MS: str(deadline_ms), Header.REQUEST_ID: f"ledger-{i}"}
        h.update(headers or {})
        await self.nc.publish(subject, body, reply=f"{self.inbox}.{i}", headers=h)
        return i

    async def settle(self, timeout_s: float, quiet_s: float = 0.3) -> None:
        """Wait until every request has an answer (or `timeout_s`), then `quiet_s` more so
        that a second answer would be seen."""
        t_end = time.monotonic() + timeout_s
        while len(self.answers) < len(self.sent) and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        await asyncio.sleep(quiet_s)

    def unanswered(self) -> list[int]:
        return [i for i in self.sent if i not in self.answers]

    def answered_twice(self) -> list[int]:
        return [i for i, a in self.answers.items() if len(a) > 1]

    def status(self, i: int) -> int:
        return int((self.answers[i][0][1].headers or {})[Header.STATUS])

    def latency_ms(self, i: int) -> float:
        return (self.answers[i][0][0] - self.sent[i]) * 1000

    def statuses(self) -> Counter[int]:
        return Counter(self.status(i) for i in self.answers)
