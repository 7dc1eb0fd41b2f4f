"""`plane risk-demo` end to end on embedded defaults: nats-server and tansu started by the
demo, the bridge, the feature updater, the guard in the node, scores to NATS and Kafka."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from freshness.config import OnStale
from freshness.demo import DemoPlan, run_risk_demo
from plane.app import main
from plane.errors import ConfigError


async def test_risk_demo_bridges_and_scores_every_record_once() -> None:
    plan = DemoPlan(duration_s=2.0, rate_per_s=60, cards=10, lag_ms=300, lag_fraction=0.3,
                    on_stale=OnStale.DEGRADE)
    report = await run_risk_demo(plan, None)
    text = report.render()
    assert report.ok, text
    assert report.produced == report.bridged == report.scored == report.to_kafka
    assert report.features_applied == report.produced
    # With 30% of records 300 ms late and on_stale=degrade, some answers say so.
    assert report.freshness["degraded"] > 0, text
    assert sum(report.statuses.values()) == report.scored
    assert "OK: every record bridged and scored once" in text


def test_risk_demo_cli_help_and_bad_flags() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["risk-demo", "--help"])
    assert result.exit_code == 0 and "plane risk-demo --lag-ms 300" in result.output
    result = runner.invoke(main, ["risk-demo", "--lag-fraction", "2"])
    assert result.exit_code == 2 and "--lag-fraction" in result.output
    result = runner.invoke(main, ["bridge", "--kafka", "127.0.0.1:1", "--topic", "t"])
    assert result.exit_code == 2 and "--nats" in result.output
    with pytest.raises(ConfigError):
        DemoPlan(topic="no spaces allowed")
