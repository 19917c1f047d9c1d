"""The rollout settings of [fleet]: the maintenance window and the artifacts URL."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from edge_agent.config import Settings, parse_window


@pytest.mark.parametrize(("text", "window"), [
    ("02:00-05:00", (120, 300)), ("22:00-05:00", (1320, 300)), (" 9:30 - 9:45 ", (570, 585)),
])
def test_windows(text: str, window: tuple[int, int]) -> None:
    assert parse_window(text) == window


@pytest.mark.parametrize("text", ["2-5", "24:00-01:00", "01:60-02:00", "03:00-03:00", ""])
def test_bad_windows_are_refused_at_load(text: str) -> None:
    with pytest.raises(ValidationError, match="maintenance window"):
        Settings(fleet={"maintenance_window": text})


def test_artifacts_url_gets_its_slash_and_must_be_http() -> None:
    s = Settings(fleet={"artifacts_url": "http://controller:8480/releases"})
    assert s.fleet.artifacts_url == "http://controller:8480/releases/"
    with pytest.raises(ValidationError, match="artifacts_url"):
        Settings(fleet={"artifacts_url": "ftp://x/"})
