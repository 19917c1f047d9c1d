"""The alerting rules and the Grafana dashboard the controller ships: the rules pass
Prometheus's own `promtool check rules` and fire (or stay quiet) on the series as the
controller exports them (`promtool test rules`); every series the dashboard and the rules
name is one the controller really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.cli import main
from edge_agent.config.controller import SLOSettings
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.slo_export import SLOExport
from edge_agent.fleet.controller.store import SQLiteStore
from tests.fleet.controller.test_slo import metrics_body, msg

SHIPPED = Path(__file__).resolve().parents[3] / "edge_agent/fleet/controller/observability"
PROMTOOL = shutil.which("promtool")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.fail("promtool is not installed (make test installs it: apt-get install "
                    "prometheus)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def test_the_rules_check_and_fire_as_written(tmp_path: Path) -> None:
    checked = promtool("check", "rules", str(SHIPPED / "alerts.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    box = 'device="s1",fleet="f1",model="m:1b"'
    tests = {"rule_files": [str(SHIPPED / "alerts.yml")], "evaluation_interval": "1m",
             "tests": [{
                 "interval": "1m",
                 "input_series": [
                     {"series": 'edge_fleet_device_up{device="s1",fleet="f1"}',
                      "values": "1 1 0x15"},
                     {"series": f'edge_fleet_slo_requests_total{{{box},outcome="ok"}}',
                      "values": "0+100x40"},
                     # Server errors start at minute 20: 10% of the requests.
                     {"series": f'edge_fleet_slo_requests_total{{{box},outcome="server_error"}}',
                      "values": "0x20 0+11x20"},
                     {"series": 'edge_fleet_slo_target_ratio{slo="error_rate"}',
                      "values": "0.05x40"},
                     # A release started at minute 15 (its start, in seconds, as the value).
                     {"series": 'edge_fleet_release_started_timestamp_seconds{rollout="ro-1",'
                                'name="m:1b",version="2",kind="model"}',
                      "values": "_x15 900x25"},
                 ],
                 "alert_rule_test": [
                     {"eval_time": "5m", "alertname": "EdgeBoxOffline", "exp_alerts": []},
                     {"eval_time": "14m", "alertname": "EdgeBoxOffline", "exp_alerts": [
                         {"exp_labels": {"severity": "page", "device": "s1", "fleet": "f1"},
                          "exp_annotations": {"summary": "Box s1 of f1 has been offline for "
                                                         "10 minutes"}}]},
                     {"eval_time": "19m", "alertname": "EdgeErrorRateUpAfterRelease",
                      "exp_alerts": []},
                     {"eval_time": "35m", "alertname": "EdgeErrorRateUpAfterRelease",
                      "exp_alerts": [{"exp_labels": {"severity": "page", "fleet": "f1",
                                                     "model": "m:1b"},
                                      # 11 of 111 a minute, as increase() extrapolates it.
                                      "exp_annotations": {"summary": "9.311% of m:1b's "
                                                          "requests in f1 failed, within 6 "
                                                          "hours of a release"}}]},
                 ]}]}
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump(tests))
    ran = promtool("test", "rules", str(spec))
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_an_error_spike_without_a_release_is_not_blamed_on_one(tmp_path: Path) -> None:
    box = 'device="s1",fleet="f1",model="m:1b"'
    tests = {"rule_files": [str(SHIPPED / "alerts.yml")], "evaluation_interval": "1m",
             "tests": [{"interval": "1m", "input_series": [
                 {"series": f'edge_fleet_slo_requests_total{{{box},outcome="ok"}}',
                  "values": "0+100x40"},
                 {"series": f'edge_fleet_slo_requests_total{{{box},outcome="server_error"}}',
                  "values": "0+11x40"},
                 {"series": 'edge_fleet_slo_target_ratio{slo="error_rate"}', "values": "0.05x40"},
             ], "alert_rule_test": [{"eval_time": "35m", "alertname":
                                     "EdgeErrorRateUpAfterRelease", "exp_alerts": []}]}]}
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump(tests))
    ran = promtool("test", "rules", str(spec))
    assert ran.returncode == 0, ran.stdout + ran.stderr


def _exported_names(tmp_path: Path) -> set[str]:
    store = SQLiteStore(tmp_path / "controller.db")
    try:
        store.ingest([msg("d1", 1, metrics_body(1e9))])
        texts = [SLOExport(store.slo, SLOSettings(), clock=lambda: 1e9).render(),
                 ControllerMetrics(store).render()]
    finally:
        store.close()
    names = set()
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            names.add(family.name)  # a family with no series yet (no rollout) is listed
            names.update(s.name for s in family.samples)
    return names


def test_the_dashboard_and_rules_name_only_exported_series(tmp_path: Path) -> None:
    exported = _exported_names(tmp_path)
    dashboard = json.loads((SHIPPED / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    rules = yaml.safe_load((SHIPPED / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    named = {n for e in exprs for n in re.findall(r"\b(edge_fleet_[a-z_]+)", e)}
    assert named and named <= exported, named - exported
    annotation = dashboard["annotations"]["list"][0]
    assert annotation["useValueForTime"] and "{{version}}" in annotation["titleFormat"]


def test_the_cli_prints_what_ships() -> None:
    runner = CliRunner()
    rules = runner.invoke(main, ["fleet", "observability", "rules"])
    assert rules.exit_code == 0 and yaml.safe_load(rules.output)["groups"]
    board = runner.invoke(main, ["fleet", "observability", "dashboard"])
    assert board.exit_code == 0 and json.loads(board.output)["uid"] == "edge-fleet-slo"
