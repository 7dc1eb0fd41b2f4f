"""How late ticket holders start past the start they were promised, by how far ahead it was.

A promise is a start in the router's schedule: the slots' predicted free times and the
promises before it. Its holder starts later than that when it comes back late, when the work
ahead of it runs past its prediction, or when the router gets to it late; the further ahead
the start, the more predictions stand between it and now, and the more it slips. A ticket
whose holder would miss its deadline on its return is worse than none, so admission gives one
only if a start as late as most (the p99) among those promised about as far ahead still
meets the deadline (`Admission._refuse`).

A start is measured from the promised time (the promise's due time when it was made, before
a call brought it forward) to the broker's PubAck of the holder's placement. A holder that
did not start on its promise (refused on its return: its deadline no longer fits, or its
park window closed) counts as a start at that moment: a lower bound, and the very slips
that count.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field

from plane.router.promises import Promise

# How far ahead a promise was, in service times (its expected one, when made): bucket k holds
# the promises 2^k - 1 to 2^(k+1) - 1 service times ahead (0: within one; 1: one to three;
# 2: three to seven; ...), the last bucket everything further. (One window for all: at 2x of
# 8 x 10 ms with 60 ms deadlines, the holders refused on their return had been promised
# 27-38 ms ahead and had slipped 9 ms at the median, where the p99 of every start's slip,
# most of them near ones, was ~7 ms; 2% of first retries failed.)
BUCKETS = 5
SLIP_WINDOW = 128  # starts per bucket
# A bucket counts once it holds SLIP_MIN_STARTS starts of the last SLIP_MAX_AGE_S; before,
# nothing is known and the holders' lateness alone sets the margin. The p99 of a few is their
# largest, and what it refuses cannot be corrected: no ticket, no start to learn from.
# (Counted from the first start, one slip of 39 ms in the first second of two routers at 2x
# of 4 x 5 ms, 40 ms deadlines, left them with 40 tickets in 20 s where 3,000 had been given,
# every other refusal `deadline`.) A load that has passed, or a stall, is forgotten the same
# way: a bucket that has stopped getting starts stops counting.
SLIP_MIN_STARTS = 16
SLIP_MAX_AGE_S = 5.0
# Within that age, while no start comes (none for longer than SLIP_GAP_S), the slips kept
# count for half as much every SLIP_HALF_LIFE_S: a burst of slips (an overload's first
# 100-200 ms, before the schedule has learnt its cycle) stops the tickets it should, then,
# no start coming to say more, lets them back as it fades, the nearest starts first (the
# surest, whose starts teach the margin again), not all at once when it ages out. (At its
# full size for SLIP_MAX_AGE_S, two routers at 2x of 4 x 5 ms, 40 ms deadlines, gave no
# ticket for 5 s after the onset's slips of 13-25 ms, a margin of 38-52 ms with no promise
# open; then, all tickets back at once, a new chain slipped as much again: 57% of first
# retries started. BENCHMARKS.md, forty-second session.) While starts come, nothing fades:
# faded by their age alone, the far starts' slips of one router at 2x of 8 x 10 ms, 60 ms
# deadlines, weighed less than they were, and 1% more first retries failed. The table is made
# again at once after a start later than its margin, else at most every SLIP_REMAKE_S (a start
# that can only lower it waits that long: one remade after every start cost a router 9 us a
# start), and every SLIP_REMAKE_S while the slips fade.
SLIP_HALF_LIFE_S = 0.5
SLIP_GAP_S = 0.05
SLIP_REMAKE_S = 0.05


def bucket(ahead_s: float, service_s: float) -> int:
    """floor(log2(1 + service times ahead)), at most BUCKETS - 1 (an int's bit length: the
    router reads it on every refusal that could carry a ticket)."""
    cycles = 1.0 + max(0.0, ahead_s) / max(service_s, 1e-6)
    if cycles >= 1 << BUCKETS:
        return BUCKETS - 1
    return min(BUCKETS - 1, int(cycles).bit_length() - 1)


@dataclass(slots=True)
class FadingWindow:
    """One bucket's starts: the last SLIP_WINDOW of the last SLIP_MAX_AGE_S, each slip
    halved every `half_life_s` of a fading clock (`Slips`: the time no start came). A slip v
    that came when that clock read c is kept as its key log2(v) + c / half_life_s: its faded
    size when the clock reads c' is 2 ** (key - c' / half_life_s), so the order of the
    faded sizes never changes, the keys stay sorted (one insort a start), and the p99 is
    read at once (a sort of 128 faded sizes per read cost 80 us a bucket)."""

    half_life_s: float
    _arrivals: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=SLIP_WINDOW))  # (t, key), in arrival order
    _keys: list[float] = field(default_factory=list)  # the same keys, sorted

    def add(self, slip_us: int, t_s: float, clock_s: float) -> None:
        """A slip at `t_s` (its age, for SLIP_MAX_AGE_S), the fading clock then `clock_s`."""
        key = math.log2(slip_us) + clock_s / self.half_life_s if slip_us > 0 else -math.inf
        if len(self._arrivals) == SLIP_WINDOW:
            self._drop(self._arrivals[0][1])  # the deque lets it go as this one comes in
        self._arrivals.append((t_s, key))
        insort(self._keys, key)

    def _drop(self, key: float) -> None:
        del self._keys[bisect_left(self._keys, key)]

    def expire(self, now_s: float) -> None:
        cutoff = now_s - SLIP_MAX_AGE_S
        while self._arrivals and self._arrivals[0][0] < cutoff:
            self._drop(self._arrivals.popleft()[1])

    @property
    def count(self) -> int:
        return len(self._keys)

    @property
    def oldest_s(self) -> float | None:
        return self._arrivals[0][0] if self._arrivals else None

    def p99_us(self, clock_s: float) -> int:
        """The p99 of the slips as they weigh when the fading clock reads `clock_s` (0 with
        none)."""
        keys = self._keys
        if not keys:
            return 0
        key = keys[min(len(keys) - 1, (99 * len(keys)) // 100)]
        return round(2.0 ** (key - clock_s / self.half_life_s)) if key > -math.inf else 0


@dataclass(slots=True)
class Slips:
    """One model's starts past their promised time, by how far ahead they were promised.
    Read on every refusal that could carry a ticket, written once per holder: each bucket's
    margin (`p99_us`) is kept in a table (see SLIP_REMAKE_S for when it is made again), not
    made on each read (up to 4 us a read, 10% of a refusal, before)."""

    half_life_s: float = SLIP_HALF_LIFE_S
    windows: list[FadingWindow] = field(default_factory=list)
    _table: tuple[int, ...] = (0,) * BUCKETS
    _fresh_until_s: float = -math.inf  # the table holds until then
    _made_s: float = -math.inf  # when it was made
    # The fading clock: how long, in all, no start came for longer than SLIP_GAP_S, up to the
    # last start (at `_last_start_s`).
    _faded_s: float = 0.0
    _last_start_s: float | None = None

    def __post_init__(self) -> None:
        self.windows = [FadingWindow(self.half_life_s) for _ in range(BUCKETS)]

    def add(self, promise: Promise, start_s: float) -> None:
        """The holder of `promise` started at `start_s` (or will not on it: see the module)."""
        k = bucket(promise.promised_s - promise.issued_s, promise.service_s)
        slip_us = int((start_s - promise.promised_s) * 1e6)
        self._faded_s = clock = self._clock(start_s)
        self._last_start_s = max(start_s, self._last_start_s or start_s)
        self.windows[k].add(slip_us, start_s, clock)
        self._fresh_until_s = (-math.inf if slip_us > self._table[k]
                               else min(self._fresh_until_s, self._made_s + SLIP_REMAKE_S))

    def _clock(self, now_s: float) -> float:
        """The fading clock at `now_s`: the time no start came, less SLIP_GAP_S a gap."""
        last = self._last_start_s
        return self._faded_s + (0.0 if last is None else max(0.0, now_s - last - SLIP_GAP_S))

    def p99_us(self, ahead_s: float, service_s: float, now_s: float) -> int:
        """How late a start promised `ahead_s` from `now_s` is, as most are lately: the p99
        of its bucket (its slips halved every SLIP_HALF_LIFE_S no start came), or of a
        nearer one if that is later (a start further ahead slips no less); 0 while none of
        them counts (SLIP_MIN_STARTS)."""
        if now_s >= self._fresh_until_s:
            self._make_table(now_s)
        return self._table[bucket(ahead_s, service_s)]

    def _make_table(self, now_s: float) -> None:
        table, margin, oldest, clock = [], 0, math.inf, self._clock(now_s)
        for w in self.windows:
            if _counts(w, now_s):
                margin = max(margin, w.p99_us(clock))
            table.append(margin)
            if (t := w.oldest_s) is not None:
                oldest = min(oldest, t)
        self._table, self._made_s = tuple(table), now_s
        # Nothing kept: it holds until the next start (`add`). Else until the oldest ages
        # out, or while the slips fade (the clock runs SLIP_GAP_S past the last start).
        fades_s = max(now_s, (self._last_start_s or now_s) + SLIP_GAP_S)
        self._fresh_until_s = (math.inf if oldest == math.inf
                               else min(oldest + SLIP_MAX_AGE_S, fades_s + SLIP_REMAKE_S))

    def summary(self, now_s: float) -> dict[str, int]:
        """The p99 of each bucket that counts, as admission weighs it now (the router's
        status): `ahead_<k>`, k as in `bucket`."""
        clock = self._clock(now_s)
        return {f"ahead_{k}": w.p99_us(clock) for k, w in enumerate(self.windows)
                if _counts(w, now_s)}


def _counts(w: FadingWindow, now_s: float) -> bool:
    """Whether a bucket's starts of the last SLIP_MAX_AGE_S are enough to go by."""
    w.expire(now_s)
    return w.count >= SLIP_MIN_STARTS
