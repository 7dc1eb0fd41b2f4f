"""What a slot knows of the request it runs now."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.msg import Msg

from gpu_node.generation import GenResult, Stop
from gpu_node.streaming import StreamRun


@dataclass(slots=True)
class Current:
    msg: Msg
    request_id: str
    reply: str
    deadline_at_ms: int
    work_us: int
    fetched_s: float  # monotonic
    answered: bool = False
    compute_us: int = 0  # the device call alone (the rest of service_us: decode, encode)
    fetched_ns: int = 0  # wall clock, epoch ns (spans)
    compute_ns: tuple[int, int] = (0, 0)  # the device call, epoch ns (spans)
    stop: Stop | None = None  # a generation's: set to stop its thread before the next step
    stream: StreamRun | None = None  # a stream's running state
    gen: GenResult | None = None  # a generation's outcome (its done-event's token fields)
    # Waiting for its inputs (the freshness guard's wait for a fresh value): this request's
    # own time, not the slot's overhead, like its work.
    inputs_us: int = 0

    @property
    def own_us(self) -> int:
        """The slot time this request asked for beyond the slot's overhead: its requested
        work and its wait for inputs (what the overhead windows subtract)."""
        return self.work_us + self.inputs_us

    @property
    def answer_by_ms(self) -> int:
        """Until when the node may answer with a plain ack: the deadline, or a stream's."""
        return self.stream.deadline_at_ms if self.stream is not None else self.deadline_at_ms
