"""The web console in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by selenium), against a real `fleet serve`, a real Mosquitto and two simulated boxes
(the agent's own link code, `tests.support.rolloutsim`): an operator signs in with a token,
sees both boxes online with their versions, starts a rollout from a release and aborts it,
starts another and watches its waves move to COMPLETED with no reload, and finds each
release's stage and materials on the releases page; a viewer sees the
same pages without a single action button; a POST without the form's CSRF token is
refused. A screenshot of each page goes to the test's tmp dir (and, with
EDGE_AGENT_SCREENSHOTS=DIR, to DIR: the manual's pictures).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.fleet.controller.releases.evaluation import samples_summary
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import Mosquitto
from tests.support.console import serving_fleet, shot, sign_in, text, windows
from tests.support.fleetkit import wait_until
from tests.support.releasekit import make_repo

pytestmark = [pytest.mark.broker]

NAME = "simmodel:1b"
BOXES = ("sim-000", "sim-001")
PRODUCTION_MATERIALS = {
    "eval_samples": samples_summary(b'{"kind": ["openai", "tools"]}\n{"kind": "ollama"}\n'
                                    ).model_dump(),
    "eval_results": {"sha256": "0" * 64, "metrics": {"accuracy": 0.93}},
    "build": "llama.cpp b4500 Q4_K_M", "route": "local", "degradation": "simmodel:1b@2",
    "rollback_target": "2", "review_by": "2027-03-01"}


@pytest.fixture
def browser() -> Iterator[Callable[[], Any]]:
    with windows() as make:
        yield make


@pytest.fixture
def central(mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path
            ) -> Iterator[dict[str, Any]]:
    """`fleet serve` with a published release, two operators, two simulated boxes online."""
    broker = mosquitto_factory(devices=BOXES, passwd_tool=False).start()
    repo = make_repo(tmp_path)
    repo.add(write_tiny_gguf(tmp_path / "model.gguf"), NAME, "2")
    repo.add(write_tiny_gguf(tmp_path / "model.gguf"), NAME, "3", license="Apache-2.0",
             stage="production", materials=PRODUCTION_MATERIALS)
    with serving_fleet(broker, repo, BOXES, tmp_path) as central:
        yield central


def _start(driver: Any, url: str, waves: str, soak: str, tmp_path: Path | None = None) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(f"{url}/console/rollouts")
    Select(driver.find_element(By.ID, "release")).select_by_value(f"{NAME}@2")
    for field, value in (("waves", waves), ("soak", soak)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    if tmp_path is not None:
        shot(driver, tmp_path, "start")  # the form, filled in
    driver.find_element(By.CSS_SELECTOR, "#start button[type=submit]").click()
    assert wait_until(lambda: "/console/rollouts/ro-" in driver.current_url, 20, 0.1), \
        driver.page_source[-2000:]
    return str(driver.current_url.rsplit("/", 1)[1])


def test_an_operator_and_a_viewer_use_the_console(central: dict[str, Any],
                                                  browser: Callable[[], Any],
                                                  tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    url, fleet = central["url"], central["fleet"]
    op = browser()
    sign_in(op, url, central["tokens"]["operator"], tmp_path=tmp_path)
    assert "operator-1 (operator)" in text(op, "who")
    rows = {r.get_attribute("data-device"): r.text
            for r in op.find_elements(By.CSS_SELECTOR, "#devices tbody tr")}
    assert set(rows) == set(BOXES), rows
    assert all("online" in text and "sim" in text for text in rows.values()), rows  # version
    agents = " ".join(text(op, "agents").split())  # fleet-wide
    assert agents == f"Agents: sim llama.cpp - on {len(BOXES)}", agents
    shot(op, tmp_path, "fleet-simulated")  # the manual's is of real boxes (the walk-through)

    # A rollout started from the release, then aborted by the button, while boxes crawl.
    for box in BOXES:
        fleet[box].step_s = 3.0
    first = _start(op, url, "1,100%", "0s", tmp_path)
    op.find_element(By.ID, "act-abort").click()
    assert wait_until(lambda: text(op, "state").startswith("ABORTED"), 20, 0.2), \
        text(op, "state")
    assert "abort by operator-1" in text(op, "trail")
    shot(op, tmp_path, "rollout-aborted")
    assert wait_until(lambda: httpx.get(f"{url}/rollouts/{first}", headers=central["auth"])
                      .json()["settled"], 60, 0.3)

    # Another, watched to the end on one page load: the live part moves by itself.
    for box in BOXES:
        fleet[box].step_s = 0.3
    second = _start(op, url, "1,100%", "1s")
    op.execute_script("window.__loadedOnce = 'yes';")
    seen = set()

    def completed() -> bool:
        seen.add(text(op, "progress"))
        return text(op, "state").startswith("COMPLETED")

    assert wait_until(completed, 90, 0.2), (text(op, "state"), seen)
    assert op.execute_script("return window.__loadedOnce") == "yes"  # never reloaded
    assert op.find_element(By.ID, "live").get_attribute("data-updated")
    assert len(seen - {""}) >= 2, seen  # the progress line changed under our eyes
    assert "2 active" in text(op, "progress")
    shot(op, tmp_path, "rollout-simulated")
    op.get(f"{url}/console/audit")
    assert "rollout.start" in text(op, "audit") and "operator-1" in text(op, "audit")
    shot(op, tmp_path, "audit")
    op.get(f"{url}/console/releases")
    assert f"{NAME}@2" in text(op, "releases")
    rows = {r.get_attribute("data-release"): " ".join(r.text.split())
            for r in op.find_elements(By.CSS_SELECTOR, "#releases tbody tr")}
    assert "experiment" in rows[f"{NAME}@2"] and "Review by -" in rows[f"{NAME}@2"], rows
    production = rows[f"{NAME}@3"]
    for shown in ("production", "License Apache-2.0", "Eval samples 2 (ollama, openai, tools)",
                  "accuracy 0.93", "Build llama.cpp b4500 Q4_K_M", "Route local",
                  f"Degradation {NAME}@2", "Rollback target 2", "Review by 2027-03-01"):
        assert shown in production, (shown, production)
    shot(op, tmp_path, "releases")

    # The same session's cookie without the form's CSRF token: refused, nothing done.
    status = op.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"fetch('/console/rollouts/{second}/rollback', {{method: 'POST', "
        "credentials: 'same-origin', headers: {'content-type': "
        "'application/x-www-form-urlencoded'}, body: ''}).then(r => done(r.status));")
    assert status == 403
    assert httpx.get(f"{url}/rollouts/{second}", headers=central["auth"]).json()["state"] == \
        "COMPLETED"

    # A viewer: the same pages, no action anywhere, and the route refuses it anyway.
    viewer = browser()
    sign_in(viewer, url, central["tokens"]["viewer"])
    for page in (f"/console/rollouts/{second}", "/console/rollouts", "/"):
        viewer.get(f"{url}{page}")
        assert not viewer.find_elements(By.CSS_SELECTOR, "form.action"), page
    shot(viewer, tmp_path, "rollout-viewer")
    csrf_free = viewer.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"fetch('/console/rollouts/{second}/rollback', {{method: 'POST', "
        "credentials: 'same-origin', body: ''}).then(r => done(r.status));")
    assert csrf_free == 403
