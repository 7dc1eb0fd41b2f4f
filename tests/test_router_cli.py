"""`plane router`'s own options reach the router's configuration, and a value out of range
is refused before anything starts (exit 2, the range named)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from plane import cli
from plane.app import main
from plane.contract.config import RouterConfig


def invoke(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[RouterConfig]]:
    seen: list[RouterConfig] = []

    async def run_router(spec: Any, cfg: RouterConfig) -> None:  # nothing served
        seen.append(cfg)

    monkeypatch.setattr(cli, "run_router", run_router)
    result = CliRunner().invoke(main, ["router", "--nats", "nats://127.0.0.1:1", *args])
    return result, seen


def test_max_inbox_wait_reaches_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = invoke(monkeypatch, "--max-inbox-wait-ms", "250", "--router-id", "r1")
    assert result.exit_code == 0, result.output
    assert [(c.max_inbox_wait_ms, c.router_id) for c in seen] == [(250, "r1")]
    result, seen = invoke(monkeypatch)
    assert result.exit_code == 0, result.output
    assert seen[0].max_inbox_wait_ms == RouterConfig().max_inbox_wait_ms == 50


def test_a_max_inbox_wait_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = invoke(monkeypatch, "--max-inbox-wait-ms", "5")
    assert result.exit_code == 2 and seen == []
    assert "--max-inbox-wait-ms" in result.output and "10<=x<=600000" in result.output
