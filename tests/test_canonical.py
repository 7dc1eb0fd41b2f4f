"""The canonical request line: every request while the rate is low; at most the budget per
second when it is high, each line saying how many it stands for; errors on their own budget."""

from __future__ import annotations

import pytest
import structlog

from plane.contract import canonical
from plane.contract.canonical import CanonicalLog


def test_lines_are_sampled_and_say_what_they_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(canonical.time, "monotonic", lambda: now[0])
    log = CanonicalLog("t", per_s=5, errors_per_s=2)
    with structlog.testing.capture_logs() as lines:
        for i in range(20):  # a burst: the first five pass
            log.line("request", request_id=f"r{i}")
        log.line("request", error=True, request_id="e1")  # an error has its own budget
        now[0] += 1.0  # a second later: five more tokens
        log.line("request", request_id="later")
    ok = [entry for entry in lines if entry["log_level"] == "info"]
    assert [entry["request_id"] for entry in ok] == ["r0", "r1", "r2", "r3", "r4", "later"]
    assert ok[-1]["skipped"] == 15 and ok[0]["skipped"] == 0
    [err] = [entry for entry in lines if entry["log_level"] == "warning"]
    assert err["request_id"] == "e1" and err["skipped"] == 0
