"""What one scheduled stream came to: when it was asked for, when its messages arrived, how it
ended and how many attempts it took (docs/design.md "Streams").

Times are seconds on the monotonic clock from the start of the run, taken when the message
reached pulse's subscription. The figures pulse reports are derived here, one definition
each, so the summary, the CSV and the tests cannot disagree:

- TTFT: first token - send of the attempt that was let in (for a stream let in at its first
  try, from its scheduled send time: a driver that falls behind cannot hide its own delay);
  `e2e_ttft` runs from the scheduled send whatever the attempts (retry waits included).
- TPOT: (last token - first token) / (tokens - 1), over the tokens of the messages after the
  first (a message may carry several tokens; with one token per message it is the same).
- gaps: the time between successive token messages.
"""

from __future__ import annotations

import itertools

import msgspec

TIMEOUT = "timeout"  # no final message within the wait (status made up by pulse)
ERROR = "error"  # the connection failed under the stream
BROKEN = "broken"  # messages out of order (a gap or a repeat in Plane-Stream-Seq)


# gc=False: numbers, strings and tuples of them only (a long run keeps many alive).
class StreamOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One stream, as pulse saw it.

    scheduled_s:    its arrival, the scheduled time of its first send
    sent_s:         when its first attempt actually went out
    accepted_s:     when the attempt that was let in went out (None: none was)
    start_s:        that attempt's `start` message (None: it never started)
    token_s:        each token message's arrival
    token_n:        tokens in each of those messages (bytes of text: tinylm emits ASCII)
    end_s:          the final message's arrival (None: it never came)
    statuses:       each attempt's final status (0: no answer)
    reasons:        each attempt's Plane-Reason ("" when none)
    final:          the last attempt's status as a label: "200", "429", ..., TIMEOUT, ERROR, BROKEN
    finish:         the `end` message's finish_reason ("" for any other final message)
    hinted:         how many 429s carried Retry-After-Ms
    stream_deadline_ms: the budget for the whole stream pulse sent (None: the plane's own)
    """

    scheduled_s: float
    sent_s: float
    accepted_s: float | None = None
    start_s: float | None = None
    token_s: tuple[float, ...] = ()
    token_n: tuple[int, ...] = ()
    end_s: float | None = None
    statuses: tuple[int, ...] = ()
    reasons: tuple[str, ...] = ()
    final: str = TIMEOUT
    finish: str = ""
    hinted: int = 0
    stream_deadline_ms: int | None = None

    @property
    def attempts(self) -> int:
        return len(self.statuses)

    @property
    def started(self) -> bool:
        return self.start_s is not None

    @property
    def accepted(self) -> bool:
        """Let in: it started, or it was admitted and then ran out of time (a 504, or no
        answer at all: a queue must not hide behind a timeout)."""
        return self.started or self.final in ("504", TIMEOUT)

    @property
    def first_refused(self) -> bool:
        return self.statuses[:1] == (429,)

    @property
    def tokens(self) -> int:
        return sum(self.token_n)

    @property
    def ttft_s(self) -> float | None:
        """First token - send of the accepted attempt (the scheduled time for the first)."""
        if not self.token_s or self.accepted_s is None:
            return None
        since = self.scheduled_s if self.attempts <= 1 else self.accepted_s
        return self.token_s[0] - since

    @property
    def e2e_ttft_s(self) -> float | None:
        return self.token_s[0] - self.scheduled_s if self.token_s else None

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / tokens after the first message; None below 2."""
        after_first = self.tokens - (self.token_n[0] if self.token_n else 0)
        if after_first < 1:
            return None
        return (self.token_s[-1] - self.token_s[0]) / after_first

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_s)]

    @property
    def within_deadline(self) -> bool:
        """Ended well (200) and, when pulse sent a stream deadline, by it (from the first
        send: the budget starts there). Without one the node's own ends a late stream 504."""
        if self.final != "200" or self.end_s is None:
            return False
        if self.stream_deadline_ms is None:
            return True
        return self.end_s - self.sent_s <= self.stream_deadline_ms / 1000
