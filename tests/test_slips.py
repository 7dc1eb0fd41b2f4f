"""How late holders start past their promised start, by how far ahead it was promised: a far
start slips more, no nearer slip is taken for a further start's, a few starts, or old ones,
do not decide, and a slip weighs less as it ages."""

import math
import random

from plane.router.promises import Promise
from plane.router.slips import (
    SLIP_GAP_S,
    SLIP_HALF_LIFE_S,
    SLIP_MAX_AGE_S,
    SLIP_MIN_STARTS,
    SLIP_REMAKE_S,
    SLIP_WINDOW,
    FadingWindow,
    Slips,
    bucket,
)


def promise(ahead_s: float, service_s: float = 0.010) -> Promise:
    return Promise(ticket="r-0", due_s=ahead_s, expires_s=1.0, service_s=service_s,
                   issued_s=0.0, promised_s=ahead_s)


def test_buckets_double_in_service_times_ahead() -> None:
    assert [bucket(a, 0.010) for a in (0.0, 0.009, 0.010, 0.029, 0.030, 0.070, 1.0)] == [
        0, 0, 1, 1, 2, 3, 4]
    assert bucket(-0.005, 0.010) == 0  # a start promised for now (the schedule's "now")


def test_a_start_promised_further_ahead_is_judged_by_its_own_slips() -> None:
    slips = Slips(half_life_s=math.inf)  # no fading: the buckets alone
    assert slips.p99_us(0.040, 0.010, 0.1) == 0  # nothing known yet: the lateness decides
    for _ in range(50):
        near = promise(0.002)
        slips.add(near, near.promised_s + 0.001)  # 1 ms late
        far = promise(0.040)  # four service times ahead: bucket 2
        slips.add(far, far.promised_s + 0.009)
    assert 999 <= slips.p99_us(0.002, 0.010, 0.1) <= 1000
    # One to three service times ahead: nothing seen there; the nearer bucket's slips.
    assert 999 <= slips.p99_us(0.015, 0.010, 0.1) <= 1000
    assert 8999 <= slips.p99_us(0.040, 0.010, 0.1) <= 9000
    # Further than any start seen: at least as late as the furthest seen.
    assert 8999 <= slips.p99_us(0.500, 0.010, 0.1) <= 9000
    # A start early is a slip of 0, not a credit.
    early = promise(0.002)
    slips.add(early, 0.0)
    assert slips.summary(0.1) == {"ahead_0": 1000, "ahead_2": 9000}


def test_a_nearer_start_that_slipped_more_sets_the_floor_for_further_ones() -> None:
    slips = Slips(half_life_s=math.inf)  # no fading: the buckets alone
    for _ in range(SLIP_MIN_STARTS):
        near = promise(0.001)
        slips.add(near, near.promised_s + 0.006)
        far = promise(0.040)
        slips.add(far, far.promised_s + 0.002)
    assert 5999 <= slips.p99_us(0.040, 0.010, 0.1) <= 6000


def test_a_few_starts_do_not_decide_and_old_ones_are_forgotten() -> None:
    """The p99 of a few starts is their largest, and a margin it sets refuses the tickets whose
    starts would correct it: a bucket counts from SLIP_MIN_STARTS starts on, and only those of
    the last SLIP_MAX_AGE_S."""
    slips = Slips(half_life_s=math.inf)  # no fading: the buckets alone
    for _ in range(SLIP_MIN_STARTS - 1):  # a stall: every start 40 ms late
        p = promise(0.002)
        slips.add(p, p.promised_s + 0.040)
    assert slips.p99_us(0.002, 0.010, 0.1) == 0
    assert slips.summary(0.1) == {}
    p = promise(0.002)
    slips.add(p, p.promised_s + 0.040)
    assert 39_999 <= slips.p99_us(0.002, 0.010, 0.1) <= 40_000
    # No start since: the stall is forgotten.
    assert slips.p99_us(0.002, 0.010, 0.1 + SLIP_MAX_AGE_S) == 0


def test_a_burst_of_slips_fades_while_no_start_comes() -> None:
    """An overload's first moments slip (the schedule has not learnt its cycle yet): their
    margin stops the tickets at once, then, no start coming to say more, halves every
    SLIP_HALF_LIFE_S past a gap of SLIP_GAP_S, so that tickets come back for the nearest
    starts first, not all at once when the burst ages out."""
    slips = Slips()
    for _ in range(SLIP_MIN_STARTS):
        p = promise(0.002)
        slips.add(p, p.promised_s + 0.040)  # 40 ms late, all at 0.042 s
    now = 0.042
    assert 39_999 <= slips.p99_us(0.002, 0.010, now) <= 40_000
    assert slips.p99_us(0.002, 0.010, now + SLIP_GAP_S) >= 39_999  # a gap is not starvation
    one = slips.p99_us(0.002, 0.010, now + SLIP_GAP_S + SLIP_HALF_LIFE_S)
    assert 19_999 <= one <= 20_001
    two = slips.p99_us(0.002, 0.010, now + SLIP_GAP_S + 2 * SLIP_HALF_LIFE_S)
    assert 9_999 <= two <= 10_001
    at = now + SLIP_GAP_S + 2 * SLIP_HALF_LIFE_S
    assert slips.summary(at) == {"ahead_0": two}
    # A fresh slip counts in full at once, beside the faded ones ...
    p = promise(0.002)
    p.promised_s, p.issued_s = at - 0.030, at - 0.032
    slips.add(p, at)
    assert 29_999 <= slips.p99_us(0.002, 0.010, at) <= 30_000
    # ... and while starts keep coming nothing fades, old or new.
    for i in range(1, 40):
        q = promise(0.002)
        q.promised_s, q.issued_s = at + i * 0.02 - 0.001, at + i * 0.02 - 0.003
        slips.add(q, at + i * 0.02)
    assert 29_999 <= slips.p99_us(0.002, 0.010, at + 39 * 0.02) <= 30_000
    assert slips.summary(at + 39 * 0.02)["ahead_0"] == slips.p99_us(0.002, 0.010,
                                                                    at + 39 * 0.02)


def test_a_buckets_faded_p99_is_the_p99_of_its_faded_slips() -> None:
    """The window keeps each slip as a key whose order never changes (`FadingWindow`): its
    p99 is that of the slips faded one by one, whatever their sizes, times and count."""
    rng = random.Random(7)
    for n in (1, 16, 99, 100, 128, 300):
        w = FadingWindow(SLIP_HALF_LIFE_S)
        kept: list[tuple[float, int]] = []
        t = 100.0
        for _ in range(n):
            t += rng.random() * 0.02
            slip = rng.choice([0, -5, rng.randrange(1, 60_000)])
            w.add(slip, t, t)  # here the fading clock is the time itself
            kept = [*kept, (t, max(0, slip))][-128:]
        now = t + rng.random()
        faded = sorted(v * 0.5 ** ((now - at) / SLIP_HALF_LIFE_S) for at, v in kept)
        want = faded[min(len(faded) - 1, (99 * len(faded)) // 100)]
        assert abs(w.p99_us(now) - want) <= 1, (n, w.p99_us(now), want)
        w.expire(t + 10)  # all past SLIP_MAX_AGE_S
        assert w.count == 0 and w.p99_us(now) == 0


def test_a_later_slip_counts_at_once_an_earlier_one_within_the_remake() -> None:
    """The margin's table is made again at once for a start later than it, and within
    SLIP_REMAKE_S for starts that can only lower it (remade after every start, it cost a
    router 9 us a start)."""
    slips = Slips(half_life_s=math.inf)
    for _ in range(SLIP_MIN_STARTS):
        p = promise(0.002)
        slips.add(p, 1.0)  # promised at 0.002, started at 1.0: ~998 ms late
    assert slips.p99_us(0.002, 0.010, 1.0) > 990_000
    for _ in range(SLIP_WINDOW):  # as many 1 ms slips: the late ones leave the window
        p = promise(0.002)
        p.promised_s, p.issued_s = 0.999, 0.997
        slips.add(p, 1.0)
    assert slips.p99_us(0.002, 0.010, 1.0) > 990_000  # not yet
    assert slips.p99_us(0.002, 0.010, 1.0 + SLIP_REMAKE_S) == 1_000
    for _ in range(2):  # the p99 of 128 is the second latest
        p = promise(0.002)
        p.promised_s, p.issued_s = 0.5, 0.498
        slips.add(p, 1.0 + SLIP_REMAKE_S)  # later than the margin: at once
    assert slips.p99_us(0.002, 0.010, 1.0 + SLIP_REMAKE_S) >= 549_000
