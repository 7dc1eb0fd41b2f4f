"""RecentIds: a node's answered ids are bounded. They fill to `size` (a `plane up` process's
memory grows by ~300 B per answer until then: ~20 MB at the default size) and stay there,
oldest forgotten first, however many answers follow."""

from __future__ import annotations

from plane.contract.ownership import attempt_id, placement_id
from plane.contract.recent import RecentIds


def answer(ids: RecentIds, n: int) -> None:
    """What a slot records per answer: its placement and its attempt, each twice (on the
    claim and again on the finish)."""
    for _ in range(2):
        ids.add(placement_id("PLANE_SLOTS_0", n))
        ids.add(attempt_id(f"r{n}", "1"))


def test_stays_at_its_size_after_many_times_its_size_of_answers() -> None:
    ids = RecentIds(size=64)
    for n in range(10_000):
        answer(ids, n)
        assert len(ids) <= 64
    assert len(ids) == 64


def test_forgets_the_oldest_first() -> None:
    ids = RecentIds(size=64)
    for n in range(1000):
        answer(ids, n)
    assert ids.seen(placement_id("PLANE_SLOTS_0", 999)) and ids.seen(attempt_id("r999", "1"))
    assert ids.seen(attempt_id("r968", "1"))  # the last 32 answers are the 64 kept
    assert not ids.seen(placement_id("PLANE_SLOTS_0", 967))
    assert not ids.seen(attempt_id("r0", "1"))
