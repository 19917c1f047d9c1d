from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.config import load_settings
from edge_agent.engine.modelops import ModelOps
from tests.conftest import DEFAULT_MODEL, LiveServer, free_port, start_server
from tests.support.fleetkit import wait_until
from tests.support.releasekit import small_filesystem

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


@pytest.fixture
def held_install(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The first start's install of the default model waits for the event: the window in
    which a slow disk (an SD card, a Jetson's eMMC) keeps it, held open for the test."""
    go = threading.Event()
    real = ModelOps.install_catalog

    def held(self: ModelOps, *args: Any, **kwargs: Any) -> Any:
        assert go.wait(60), "the test never let the install go on"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelOps, "install_catalog", held)
    yield go
    go.set()


def _reasons(live: LiveServer) -> list[str]:
    """What `/ready` says still stops the box from being ready ([] once it is)."""
    return list(httpx.get(f"{live.base_url}/ready").json()["reasons"])


def _error_text(path: str, r: httpx.Response) -> str:
    """The error's text in either dialect's shape: Ollama's string, OpenAI's object."""
    error = r.json()["error"]
    return str(error if path.startswith("/api/") else error["message"])


def test_a_request_during_the_first_start_install_waits_for_the_default_model(
        tmp_path: Path, held_install: threading.Event) -> None:
    settings = load_settings(None, state_dir=tmp_path / "var",
                             **{"server.port": free_port(), "runtime.context_length": 512})
    live = start_server(settings, wait_for_model=None)
    try:
        ready = httpx.get(f"{live.base_url}/ready")
        assert ready.status_code == 503
        assert f"default model {DEFAULT_MODEL} is being installed" in ready.json()["reasons"]
        threading.Timer(1.0, held_install.set).start()
        started = time.monotonic()
        r = httpx.post(f"{live.base_url}/api/chat", timeout=60, json={
            "model": DEFAULT_MODEL, "stream": False, "options": {"num_predict": 4},
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text  # not "model not found": it was on its way
        assert r.json()["done"] is True and time.monotonic() - started >= 0.9
    finally:
        live.stop()


def test_without_load_wait_the_first_start_install_answers_503_in_each_dialect(
        tmp_path: Path, held_install: threading.Event) -> None:
    settings = load_settings(None, state_dir=tmp_path / "var", **{
        "server.port": free_port(), "runtime.context_length": 512,
        "runtime.load_wait": False})
    live = start_server(settings, wait_for_model=None)
    try:
        chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        calls = [("/api/chat", {**chat, "options": {"num_predict": 4}}),
                 ("/v1/chat/completions", {**chat, "max_tokens": 4}),
                 ("/v1/completions", {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 4})]
        for path, body in calls:
            r = httpx.post(f"{live.base_url}{path}", json=body, timeout=30)
            assert r.status_code == 503, (path, r.text)
            assert int(r.headers["Retry-After"]) >= 1
            assert _error_text(path, r) == \
                f"model '{DEFAULT_MODEL}' is being installed; retry shortly"
        held_install.set()
        assert wait_until(lambda: _reasons(live) == [], 120, 0.1), "the model did not load"
        digest = httpx.get(f"{live.base_url}/api/tags").json()["models"][0]["digest"]
        r = httpx.post(f"{live.base_url}/v1/completions", json=calls[2][1], timeout=60)
        assert r.status_code == 200 and r.json()["system_fingerprint"] == f"fp_{digest[:12]}"
    finally:
        live.stop()


def test_a_first_start_install_that_fails_for_want_of_disk_is_said_not_hidden(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real 20 MB filesystem for the state dir: the 98 MB default cannot go in. The
    log says so once, `/ready` gives the reason, and a request for the model hears that
    the box could not install it (503), not that the name does not exist (404)."""
    with small_filesystem(tmp_path / "mnt", "20m") as mnt:
        state = mnt / "var"
        settings = load_settings(None, state_dir=state, **{
            "server.port": free_port(), "runtime.context_length": 512})
        live = start_server(settings, wait_for_model=None)
        try:
            assert wait_until(lambda: any("failed" in r for r in _reasons(live)), 60, 0.1), \
                _reasons(live)
            reasons = _reasons(live)
            assert reasons[0].startswith(f"default model {DEFAULT_MODEL} is not installed: "
                                         "its install at start failed (")
            assert "No space left on device" in reasons[0]
            chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            for path in ("/api/chat", "/v1/chat/completions"):
                r = httpx.post(f"{live.base_url}{path}", json=chat, timeout=30)
                assert r.status_code == 503, (path, r.text)
                message = _error_text(path, r)
                assert message.startswith(f"model '{DEFAULT_MODEL}' could not be installed "
                                          "at start: ") and "No space left" in message
            assert [p.name for p in (state / "blobs").iterdir()] == []  # nothing half-kept
        finally:
            live.stop()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"default model {DEFAULT_MODEL} not installed"]
