"""What a release did, end to end: a real `fleet serve`, a real Mosquitto and four simulated
boxes (the agent's own link code) reporting metrics shaped as a box sends them. A rollout
whose first wave makes time to first token 30% worse shows as such in the rollout's
before/after table and on the SLO chart's marker (a real headless Chromium, screenshots),
and the controller's Prometheus export, run through the shipped alerting rules by
`promtool test rules`, pages for exactly that wave's boxes — and for none before it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.fleet.protocol.envelope import METRICS
from tests.fleet.controller.test_observability import SHIPPED, promtool
from tests.fleet.controller.test_slo import metrics_body
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import Mosquitto
from tests.support.console import serving_fleet, shot, sign_in, windows
from tests.support.fleetkit import wait_until
from tests.support.releasekit import make_repo
from tests.support.rolloutsim import LinkFleet

pytestmark = [pytest.mark.broker]

NAME = "simmodel:1b"
BOXES = ("slo-000", "slo-001", "slo-002", "slo-003")
BEFORE_MS, AFTER_MS, SLO_MS = 150.0, 195.0, 180.0


@pytest.fixture
def central(mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path
            ) -> Iterator[dict[str, Any]]:
    broker = mosquitto_factory(devices=BOXES, passwd_tool=False).start()
    repo = make_repo(tmp_path)
    repo.add(write_tiny_gguf(tmp_path / "model.gguf"), NAME, "2")
    with serving_fleet(broker, repo, BOXES, tmp_path, step_s=0.2,
                       settings=f"[slo]\nttft_p95_ms = {SLO_MS}\ncompare_s = 600") as central:
        yield {**central, "viewer": central["auth"],
               "operator": {"Authorization": f"Bearer {central['tokens']['operator']}"}}


def _report(fleet: LinkFleet, device: str, ends: list[float], ttft_ms: float) -> None:
    for end in ends:
        assert fleet.sim.emit(device, "metrics", METRICS,
                              metrics_body(end, ttft_p95=ttft_ms, model=NAME,
                                           length=1.0 if end > time.time() - 5 else 60.0))


def _requests(url: str, auth: dict[str, str]) -> int:
    return sum(b["requests"] for b in
               httpx.get(f"{url}/slo", params={"window": "1h"}, headers=auth,
                         timeout=10).json()["buckets"])


def _ttft_alerts(url: str, auth: dict[str, str], tmp_path: Path, name: str
                 ) -> subprocess.CompletedProcess[str]:
    """The shipped rules over 15 minutes of the export as scraped now, held steady."""
    text = httpx.get(f"{url}/fleet-metrics", headers=auth, timeout=10).text
    series = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("edge_fleet_slo_ttft_seconds", "edge_fleet_slo_target_seconds"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                series.append({"series": f"{s.name}{{{labels}}}", "values": f"{s.value}x15"})
    spec = {"rule_files": [str(SHIPPED / "alerts.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                {"eval_time": "12m", "alertname": "EdgeTTFTOverSLO", "exp_alerts": []}]}]}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(spec))
    return promtool("test", "rules", str(path))


def test_a_slower_wave_shows_in_the_table_the_chart_and_the_alert(
        central: dict[str, Any], tmp_path: Path) -> None:
    url, fleet = central["url"], central["fleet"]
    viewer, operator = central["viewer"], central["operator"]
    now = time.time()
    before = [now - 60 * k for k in range(9, -1, -1)]
    for box in BOXES:
        _report(fleet, box, before, BEFORE_MS)
    assert wait_until(lambda: _requests(url, viewer) == 11 * 10 * len(BOXES), 60, 0.2)
    quiet = _ttft_alerts(url, viewer, tmp_path, "before")
    assert quiet.returncode == 0, quiet.stdout  # under the SLO: no page

    started = httpx.post(f"{url}/rollouts", headers=operator, timeout=30, json={
        "release": f"{NAME}@2", "waves": "50%,100%", "soak": "0s", "min_executed": 1})
    assert started.status_code == 201, started.text
    rid = started.json()["id"]

    def status() -> dict[str, Any]:
        return dict(httpx.get(f"{url}/rollouts/{rid}", headers=viewer, timeout=10).json())

    assert wait_until(lambda: status()["state"] == "COMPLETED", 90, 0.3), status()
    waves = {d["device"]: d["wave"] for d in status()["devices"]}
    slower = sorted(d for d, w in waves.items() if w == 1)
    assert len(slower) == 2
    after = [time.time() + k for k in range(1, 11)]
    for box in BOXES:
        _report(fleet, box, after, AFTER_MS if box in slower else BEFORE_MS)
    assert wait_until(lambda: _requests(url, viewer) == 11 * 20 * len(BOXES), 60, 0.2)

    impact = httpx.get(f"{url}/slo/rollouts/{rid}", headers=viewer, timeout=10).json()
    by_wave = {w["wave"]: w for w in impact["waves"]}
    assert impact["model"] == NAME and impact["window_s"] == 600
    assert by_wave[1]["change"]["ttft_p95"] == pytest.approx(AFTER_MS / BEFORE_MS)
    assert by_wave[1]["before"]["requests"] == by_wave[1]["after"]["requests"] == 220
    assert by_wave[2]["change"]["ttft_p95"] == 1.0

    paged = _ttft_alerts(url, viewer, tmp_path, "after")
    assert paged.returncode == 1  # the test expected silence; promtool says what fired
    said = paged.stdout + paged.stderr
    fired = {line.split('device="')[1].split('"')[0]
             for line in said.splitlines() if 'alertname="EdgeTTFTOverSLO"' in line}
    assert fired == set(slower), said

    from selenium.webdriver.common.by import By

    with windows() as make:
        driver = make()
        sign_in(driver, url, central["tokens"]["viewer"])
        driver.get(f"{url}/console/rollouts/{rid}")
        row = driver.find_element(By.CSS_SELECTOR, "#impact tr[data-wave='1']")
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        assert cells[1:4] == ["150 ms", "195 ms", "+30%"], cells
        assert "bad" in row.find_element(By.CSS_SELECTOR, "td.change").get_attribute("class")
        driver.execute_script("document.getElementById('impact-h').scrollIntoView()")
        shot(driver, tmp_path, "release-impact")
        driver.get(f"{url}/console/slo?window=1h&model={NAME}")
        chart = driver.find_element(By.ID, "chart-ttft")
        marker = chart.find_element(By.CSS_SELECTOR, "a.marker")
        assert marker.find_element(By.CSS_SELECTOR, "text.marker-label").text == f"{NAME}@2"
        assert marker.get_dom_attribute("href").endswith(f"/console/rollouts/{rid}")
        assert len(chart.find_elements(By.TAG_NAME, "polyline")) >= 2
        assert {c.get_attribute("id") for c in driver.find_elements(
            By.CSS_SELECTOR, "svg.chart")} == {"chart-ttft", "chart-tpot", "chart-requests",
                                               "chart-tokens", "chart-structured",
                                               "chart-degradations", "chart-feedback"}
        assert driver.find_element(By.ID, "slo-releases").text.count(f"{NAME}@2") == 1
        shot(driver, tmp_path, "service-levels")
