"""monitoring/: Prometheus' own tools accept the config and the alert rules, the alerts fire when an operator
needs them (``promtool test rules`` on made-up series) and stay quiet otherwise, and every PromQL expression
of the dashboard and the console page is valid PromQL.

No Prometheus server here: tests/integration/test_monitoring.py runs the same files against a live one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from geotrain.telemetry.prometheus_server import (MONITORING_DIR, console_expressions, dashboard_expressions,
                                        rule_expressions)

RULES = MONITORING_DIR / "rules" / "geotrain.yml"
DASHBOARD = MONITORING_DIR / "grafana" / "dashboards" / "geotrain.json"
CONSOLE = MONITORING_DIR / "consoles" / "geotrain.html"
LIBRARY = MONITORING_DIR / "console_libraries" / "geotrain.lib"

promtool_missing = pytest.mark.skipif(shutil.which("promtool") is None,
                                      reason="promtool not installed (apt-get install prometheus)")


def promtool(*arguments: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *arguments], capture_output=True, text=True, timeout=60, cwd=cwd)


@promtool_missing
def test_promtool_accepts_the_shipped_config_and_rules(tmp_path):
    # a copy, so the relative paths (rules/*.yml, targets/*.json) resolve as in the compose stack
    copy = tmp_path / "monitoring"
    shutil.copytree(MONITORING_DIR, copy)
    checked = promtool("check", "config", str(copy / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1 rule files found" in checked.stdout + checked.stderr, "prometheus.yml does not load the alert rules"
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_tells_an_operator_what_and_how_bad():
    rules = yaml.safe_load(RULES.read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    names = {alert["alert"] for alert in alerts}
    assert {"GeotrainSwarmStalled", "GeotrainThroughputHalved", "GeotrainPeerChurn", "GeotrainEgressOverBudget",
            "GeotrainCheckpointStale"} <= names
    for alert in alerts:
        assert re.fullmatch(r"\d+[smh]", str(alert.get("for", ""))), f"{alert['alert']}: no `for:` duration"
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert len(alert["annotations"]["summary"]) > 20 and len(alert["annotations"]["description"]) > 80, \
            f"{alert['alert']}: summary and description must tell an operator what happened and what to do"


# ---- the alerts' logic, on made-up series (promtool test rules) --------------------------------------------
# Annotations are left out of the copy of the rules under test: promtool compares them verbatim, and
# `promtool check rules` above already parses their templates.

def _series(name: str, labels: dict, values: str) -> dict:
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _peers(run_id: str, values: str) -> dict:
    return _series("geotrain_swarm_peers", {"run_id": run_id, "peer_region": "europe-west4", "peer_cloud": "gcp"},
                   values)


def _case(alert: str, series: list[dict], checks: list[tuple[str, list[str]]]) -> dict:
    """``checks``: (evaluation time, run ids the alert is firing for then)."""
    severity = next(rule["labels"]["severity"] for group in yaml.safe_load(RULES.read_text())["groups"]
                    for rule in group["rules"] if rule.get("alert") == alert)
    return {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": time, "alertname": alert,
         "exp_alerts": [{"exp_labels": {"severity": severity, "run_id": run_id}} for run_id in firing]}
        for time, firing in checks]}


ALERT_CASES = {
    "stalled": _case("GeotrainSwarmStalled", [
        # epochs 1..11 in the first 10 minutes, then stuck
        _series("geotrain_swarm_global_epoch", {"run_id": "stuck"}, "1+1x10 11x40"), _peers("stuck", "2x50"),
        # the same epochs, but its trainers are gone: a finished run, not a stalled one
        _series("geotrain_swarm_global_epoch", {"run_id": "finished"}, "1+1x10 11x40"), _peers("finished", "0x50"),
        _series("geotrain_swarm_global_epoch", {"run_id": "healthy"}, "1+1x50"), _peers("healthy", "2x50"),
    ], [("20m", []), ("45m", ["stuck"])]),
    "throughput": _case("GeotrainThroughputHalved", [
        _series("geotrain_swarm_samples_per_second", {"run_id": "slowed"}, "100x60 20x40"), _peers("slowed", "4x100"),
        _series("geotrain_swarm_samples_per_second", {"run_id": "steady"}, "100x100"), _peers("steady", "4x100"),
    ], [("50m", []), ("90m", ["slowed"])]),
    "churn": _case("GeotrainPeerChurn", [
        # 4 departures within 4 minutes: half of an 8-trainer swarm, a tenth of a 40-trainer one
        _series("geotrain_swarm_peer_departures_total", {"run_id": "wave"}, "0x10 1 2 3 4 4x20"),
        _peers("wave", "8x40"),
        _series("geotrain_swarm_peer_departures_total", {"run_id": "large"}, "0x10 1 2 3 4 4x20"),
        _peers("large", "40x40"),
    ], [("8m", []), ("25m", ["wave"])]),
    "egress": _case("GeotrainEgressOverBudget", [
        _series("geotrain_swarm_egress_cost_dollars_per_hour", {"run_id": "spender"}, "3x30"),
        _series("geotrain_swarm_egress_budget_dollars_per_hour", {"run_id": "spender"}, "2x30"),
        _series("geotrain_swarm_egress_cost_dollars_per_hour", {"run_id": "thrifty"}, "1x30"),
        _series("geotrain_swarm_egress_budget_dollars_per_hour", {"run_id": "thrifty"}, "2x30"),
        _series("geotrain_swarm_egress_cost_dollars_per_hour", {"run_id": "no-budget"}, "9x30"),
    ], [("10m", []), ("25m", ["spender"])]),
    "checkpoint": _case("GeotrainCheckpointStale", [
        # one checkpoint at the start (unix time 0 in promtool's clock), none since
        _series("geotrain_checkpoint_last_success_timestamp_seconds", {"run_id": "stale"}, "0x80"),
        _peers("stale", "2x80"),
        _series("geotrain_checkpoint_last_success_timestamp_seconds", {"run_id": "fresh"}, "0+60x80"),
        _peers("fresh", "2x80"),
    ], [("50m", []), ("75m", ["stale"])]),
    "no checkpoint": _case("GeotrainNoCheckpoint", [
        _series("geotrain_checkpoints_total", {"run_id": "never"}, "0x90"),
        _series("geotrain_swarm_global_epoch", {"run_id": "never"}, "1+1x90"),
        _series("geotrain_checkpoints_total", {"run_id": "saved"}, "0+1x90"),
        _series("geotrain_swarm_global_epoch", {"run_id": "saved"}, "1+1x90"),
    ], [("30m", []), ("70m", ["never"])]),
    "no swarm view": _case("GeotrainSwarmViewMissing", [
        _series("geotrain_samples_total", {"run_id": "orphan", "role": "trainer"}, "0+100x30"),
        _series("geotrain_samples_total", {"run_id": "watched", "role": "trainer"}, "0+100x30"),
        _series("geotrain_swarm_global_epoch", {"run_id": "watched"}, "1+1x30"),
    ], [("5m", []), ("20m", ["orphan"])]),
    "bad peer": _case("GeotrainBadPeer", [
        _series("geotrain_guard_refusals_total", {"run_id": "attacked", "role": "trainer", "what": "contribution",
                                                  "reason": "non-finite"}, "0x10 1 2 2x30"),
        # refused requests of a private swarm's outsider, and busy downloads, are not a bad peer in the swarm
        _series("geotrain_guard_refusals_total", {"run_id": "private", "role": "trainer", "what": "join_group",
                                                  "reason": "not admitted"}, "0+1x40"),
        _series("geotrain_guard_refusals_total", {"run_id": "private", "role": "trainer", "what": "download_state",
                                                  "reason": "busy"}, "0+1x40"),
    ], [("5m", []), ("14m", ["attacked"]), ("35m", [])]),
}


@promtool_missing
def test_alerts_fire_when_they_should_and_only_then(tmp_path):
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    tested = {test["alert_rule_test"][0]["alertname"] for test in ALERT_CASES.values()}
    assert tested == {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": list(ALERT_CASES.values())},
        sort_keys=False))
    result = promtool("test", "rules", "test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- dashboard and console page ---------------------------------------------------------------------------

@promtool_missing
def test_every_dashboard_and_console_expression_is_valid_promql(tmp_path):
    # promtool parses rules offline: each expression becomes a recording rule
    expressions = [expression for _title, expression in dashboard_expressions(DASHBOARD)]
    expressions += console_expressions(CONSOLE)
    rules = [{"record": f"geotrain:check_{index}", "expr": expression} for index, expression in enumerate(expressions)]
    (tmp_path / "expressions.yml").write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    result = promtool("check", "rules", str(tmp_path / "expressions.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_console_page_shows_what_an_operator_watches():
    expressions = console_expressions(CONSOLE)
    for metric in ("geotrain_swarm_samples_per_second", "geotrain_samples_per_second", "geotrain_swarm_peers",
                   "geotrain_swarm_global_epoch", "geotrain_swarm_granularity", "geotrain_swarm_cost_dollars_per_hour",
                   "geotrain_swarm_cost_dollars_per_million_samples"):
        assert any(metric + "{" in e or metric + ")" in e for e in expressions), f"the console page lacks {metric}"
    assert any("by (peer_region" in e for e in expressions), "no view of the trainers by region"
    # the page calls only templates its library defines (a typo renders as an error page)
    defined = set(re.findall(r'\{\{\s*define\s+"(\w+)"', LIBRARY.read_text()))
    page = CONSOLE.read_text()
    used = set(re.findall(r'\{\{\s*template\s+"(\w+)"', page))
    assert used and used <= defined, f"templates not defined in geotrain.lib: {used - defined}"
    formats = set(re.findall(r'"(geotrain_(?:number|int|dollars|duration))"', page))
    assert formats <= defined


def test_the_dashboard_covers_throughput_regions_averaging_traffic_and_cost():
    expressions = " ".join(expression for _title, expression in dashboard_expressions(DASHBOARD))
    for needed in ("geotrain_swarm_samples_per_second", "by (peer_region, peer_cloud) (geotrain_swarm_peers",
                   "geotrain_swarm_global_epoch", "geotrain_swarm_granularity",
                   "histogram_quantile(0.9, sum by (le) (rate(geotrain_averaging_duration_seconds_bucket",
                   "sum by (result) (rate(geotrain_averaging_rounds_total", "rate(geotrain_sent_bytes_total",
                   "rate(geotrain_received_bytes_total", "geotrain_swarm_cost_dollars_per_hour",
                   "geotrain_swarm_cost_dollars_per_million_samples"):
        assert needed in expressions, f"no dashboard panel queries {needed}"
    assert "$" not in expressions, "a Grafana variable was left unsubstituted"


def test_rule_expressions_are_all_found():
    assert len(rule_expressions(RULES)) == len(ALERT_CASES)
