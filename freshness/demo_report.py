"""What `plane risk-demo` saw, and its verdict.

The ticket part: a burst of more `calibrated` requests than there are slots; one of those
refused with `429 busy` comes back, alone, after its `Retry-After-Ms` with its
`Plane-Ticket`, as a caller that trusts the plane would (`demo.redeem_one_ticket`).

The verdict is "OK" only when every record was bridged and scored exactly once, every scoring
answer met its contract (a 200 within the request's deadline, as the caller measured it, SDK
retries included), and the refusal in the ticket part turned into an answer. Anything else is
"NOT OK", with what missed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from freshness.config import stream_token
from plane.client.ticket_demo import TicketStory
from plane.contract.messages import Status
from plane.contract.quantiles import quantile
from plane.contract.subjects import Names


@dataclass(frozen=True, kw_only=True)
class DemoSetting:
    """What the report repeats of the plan (kept apart so this module needs no plan)."""

    duration_s: float
    rate_per_s: float
    cards: int
    lag_ms: float
    lag_fraction: float
    freshness_ms: int
    on_stale: str
    deadline_ms: int
    topic: str
    names: Names


@dataclass
class DemoReport:
    setting: DemoSetting
    produced: int = 0
    bridged: int = 0
    dead: int = 0
    features_applied: int = 0
    scored: int = 0
    to_kafka: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    freshness: Counter[str] = field(default_factory=Counter)
    request_ms: list[float] = field(default_factory=list)
    end_to_end_ms: list[float] = field(default_factory=list)
    late_200: int = 0  # 200s that came after the deadline
    first_record_s: float | None = None
    ticket: TicketStory | None = None
    kafka: str = ""
    nats: str = ""

    def answer(self, status: int, request_ms: float) -> None:
        self.statuses[status] += 1
        self.request_ms.append(request_ms)
        if status == Status.OK and request_ms > self.setting.deadline_ms:
            self.late_200 += 1

    @property
    def refused_or_failed(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != Status.OK)

    @property
    def deadline_misses(self) -> int:
        """Answers that broke their contract: not a 200, or a 200 after the deadline."""
        return self.refused_or_failed + self.late_200

    @property
    def complete(self) -> bool:
        return (self.produced > 0 and self.scored == self.produced == self.bridged
                and self.dead == 0)

    @property
    def ok(self) -> bool:
        return (self.complete and self.deadline_misses == 0
                and self.ticket is not None and self.ticket.ok)

    def problems(self) -> list[str]:
        out = []
        if not self.complete:
            out.append(f"{self.produced} produced, {self.bridged} bridged, {self.scored} "
                       f"scored, {self.dead} dead letters: not every record scored once")
        if self.refused_or_failed:
            out.append(f"{self.refused_or_failed} scoring answers were not 200")
        if self.late_200:
            out.append(f"{self.late_200} answers were 200 but after the "
                       f"{self.setting.deadline_ms} ms deadline")
        if self.ticket is None or not self.ticket.ok:
            out.append("the ticket was not redeemed with a 200")
        return out

    def render(self) -> str:
        s = self.setting
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items())) or "-"
        first = f"{self.first_record_s:.2f} s" if self.first_record_s is not None else "-"
        lines = [
            f"risk-demo: {s.duration_s:g} s at {s.rate_per_s:g} tx/s over {s.cards} cards "
            f"(Kafka {self.kafka}, NATS {self.nats})",
            f"  injected lag      {s.lag_ms:g} ms on {s.lag_fraction:.0%} of records; "
            f"threshold {s.freshness_ms} ms, on stale: {s.on_stale}",
            f"  produced          {self.produced}",
            f"  bridged           {self.bridged} (dead letters: {self.dead}; first record "
            f"{first} after the bridge started)",
            f"  features applied  {self.features_applied}",
            f"  scored            {self.scored}, answers by status: {statuses}",
            f"  deadline misses   {self.deadline_misses} (not 200: {self.refused_or_failed}; "
            f"200 after the {s.deadline_ms} ms deadline: {self.late_200})",
            "  freshness         "
            + (", ".join(f"{k}: {v}" for k, v in sorted(self.freshness.items())) or "-"),
            f"  published         NATS {s.names.scored(stream_token(s.topic))}: {self.scored}, "
            f"Kafka {s.topic}.scored: {self.to_kafka}",
            f"  scoring request   p50 {quantile(self.request_ms, 0.5):.2f} ms, "
            f"p99 {quantile(self.request_ms, 0.99):.2f} ms, "
            f"max {max(self.request_ms, default=0.0):.2f} ms (deadline {s.deadline_ms} ms)",
            f"  event -> scored   p50 {quantile(self.end_to_end_ms, 0.5):.2f} ms, "
            f"p99 {quantile(self.end_to_end_ms, 0.99):.2f} ms",
        ]
        if self.ticket is not None:
            lines += self.ticket.render()
        if self.ok:
            lines.append("  result            OK: every record bridged and scored once, every "
                         "answer a 200 within its deadline, the ticket redeemed")
        else:
            lines.append("  result            NOT OK: " + "; ".join(self.problems()))
        return "\n".join(lines)
