"""The fleet console in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium): windows to open, signing in, reading a live part,
and the screenshots the manual shows (to the test's tmp dir, and with
EDGE_AGENT_SCREENSHOTS=DIR to DIR as `console-NAME.png`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.fleetkit import wait_until

if TYPE_CHECKING:
    from tests.support.brokers import Mosquitto
    from tests.support.releasekit import Repo

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@contextmanager
def windows() -> Iterator[Callable[[], Any]]:
    """New headless Chromium windows (each its own cookies), closed at the end."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed (make test installs "
                    "them: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    made: list[Any] = []

    def make() -> Any:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1280,900", "--no-first-run"):
            options.add_argument(arg)
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        driver.set_page_load_timeout(60)
        made.append(driver)
        return driver

    try:
        yield make
    finally:
        for driver in made:
            driver.quit()


def shot(driver: Any, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / f"{name}.png"))
    wanted = os.environ.get("EDGE_AGENT_SCREENSHOTS")
    if wanted:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(wanted) / f"console-{name}.png"))


def sign_in(driver: Any, url: str, token: str, *, tmp_path: Path | None = None) -> None:
    """The sign-in page, as a person uses it: the token typed, Enter pressed (a shot of
    the page first, with `tmp_path`)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{url}/")
    assert "/console/login" in driver.current_url  # no session: to the sign-in page
    field = driver.find_element(By.ID, "token")
    assert driver.find_element(By.CSS_SELECTOR, "label[for=token]").text == "Operator token"
    if tmp_path is not None:
        shot(driver, tmp_path, "sign-in")
    field.send_keys(token + Keys.ENTER)  # the keyboard alone
    assert wait_until(lambda: driver.find_elements(By.ID, "devices"), 20, 0.1)


def text(driver: Any, element_id: str) -> str:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return str(driver.find_element(By.ID, element_id).text)
    except (NoSuchElementException, StaleElementReferenceException):
        return ""  # between two redraws of the live part


@contextmanager
def serving_fleet(broker: Mosquitto, repo: Repo, boxes: tuple[str, ...], tmp_path: Path, *,
                  settings: str = "", step_s: float = 0.4) -> Iterator[dict[str, Any]]:
    """`fleet serve` over `repo` (more of its settings in `settings`, TOML after its [http]
    section), an operator and a viewer, and `boxes` simulated (the agent's own link code),
    each online: {"url", "tokens" (by role), "fleet", "auth" (the viewer's header)}."""
    import httpx

    from tests.conftest import free_port
    from tests.support.rolloutkit import cli, controller_config, serving
    from tests.support.rolloutsim import LinkFleet

    port = free_port()
    config = controller_config(tmp_path / "controller.toml", state=tmp_path / "state",
                               key=repo.keys.private("command"), broker=broker,
                               http=f"port = {port}\n{settings}")
    tokens = {role: cli("fleet", "operators", "create", f"{role}-1", "--role", role,
                        "--config", str(config)).stdout.strip()
              for role in ("operator", "viewer")}
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {tokens['viewer']}"}

    def healthy() -> bool:
        try:
            return bool(httpx.get(f"{url}/healthz", headers=auth, timeout=2)
                        .json()["broker_connected"])
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    with serving(config, tmp_path / "serve.log"):
        assert wait_until(healthy, 60, 0.2), (tmp_path / "serve.log").read_text()[-2000:]
        fleet = LinkFleet(broker, repo.keys.public_file("command"), boxes, tmp_path / "sim",
                          step_s=step_s).connect()
        try:
            assert wait_until(lambda: len(httpx.get(f"{url}/devices", headers=auth).json()[
                "devices"]) == len(boxes), 60, 0.2)
            yield {"url": url, "tokens": tokens, "fleet": fleet, "auth": auth}
        finally:
            fleet.close()
