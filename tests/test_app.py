from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from edge_agent.config import load_settings
from tests.conftest import DEFAULT_MODEL, free_port, start_server

pytestmark = pytest.mark.integration


def test_first_start_on_an_empty_state_dir_installs_and_loads_the_default_model(
        tmp_path: Path) -> None:
    """What `make run` does on a fresh box."""
    settings = load_settings(None, state_dir=tmp_path / "var",
                             **{"server.port": free_port(), "runtime.context_length": 512})
    live = start_server(settings)
    try:
        tags = httpx.get(f"{live.base_url}/api/tags").json()["models"]
        assert [m["name"] for m in tags] == [DEFAULT_MODEL]
        assert (tmp_path / "var" / "blobs" / f"sha256-{tags[0]['digest']}").is_file()
        with httpx.stream("POST", f"{live.base_url}/api/chat", timeout=60, json={
                "model": DEFAULT_MODEL, "options": {"num_predict": 8},
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            lines = list(r.iter_lines())
        assert len(lines) >= 2 and '"done": true' in lines[-1]
    finally:
        live.stop()
