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
from typing import Any

import pytest

from tests.support.fleetkit import wait_until

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
