"""FloodMemory: after a flood has drained and the process has been quiet a moment, the
allocator is asked once to return its free pages; never during a flood, never for a trickle."""

from __future__ import annotations

from plane.router.memory import FloodMemory


def test_trims_once_after_a_flood_has_drained_and_stayed_quiet() -> None:
    calls: list[int] = []
    fm = FloodMemory(flood=100, quiet_s=1.0, few=5, trim=lambda: calls.append(1))
    fm.observe(10, 0.0)
    fm.observe(500, 0.1)  # the flood
    fm.observe(200, 0.5)
    fm.observe(3, 1.0)  # drained: quiet from here
    fm.observe(2, 1.9)
    assert calls == []  # not quiet long enough
    fm.observe(50, 2.0)  # busy again: the quiet restarts
    fm.observe(1, 2.1)
    fm.observe(1, 2.5)
    assert calls == []
    fm.observe(0, 3.2)
    assert calls == [1] and fm.trims == 1
    fm.observe(0, 9.0)
    assert calls == [1]  # once per flood


def test_a_trickle_never_trims() -> None:
    calls: list[int] = []
    fm = FloodMemory(flood=100, quiet_s=1.0, few=5, trim=lambda: calls.append(1))
    for i in range(1000):
        fm.observe(i % 50, i * 0.1)
    assert calls == []
