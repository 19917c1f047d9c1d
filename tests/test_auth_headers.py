"""Two Authorization headers are refused (400) on every authenticated route, in the
dialect's shape: which one a proxy or server would pick is not defined."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from edge_agent.api import feedback, ollama, ollama_models
from edge_agent.api.auth import authenticate
from edge_agent.api.errors import is_openai_path
from edge_agent.api.openai import routes as openai_routes
from edge_agent.config import load_settings
from edge_agent.governance.keys import KeyStore
from tests.conftest import LiveServer, free_port, start_server

CONFIG = """
[tenants.shop]
models = ["smollm2:*"]
"""


def _server(root: Path, *, keys: bool) -> tuple[LiveServer, list[str]]:
    cfg = root / "config.toml"
    cfg.write_text(CONFIG)
    made = [KeyStore(root / "state").create("shop")[0] for _ in range(2)] if keys else []
    settings = load_settings(cfg, state_dir=root / "state", **{"server.port": free_port()})
    return start_server(settings, wait_for_model=None, preload=False), made


@pytest.fixture(scope="module")
def governed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, list[str]]]:
    live, keys = _server(tmp_path_factory.mktemp("dup-auth"), keys=True)
    yield live, keys
    live.stop()


def _authenticated_routes() -> list[tuple[str, str]]:
    """Every route of both dialects' routers and the box's own (each router requires
    authentication)."""
    routes = []
    for router in (ollama.router, ollama_models.router, openai_routes.router,
                   feedback.router):
        assert any(d.dependency is authenticate for d in router.dependencies)
        for route in router.routes:
            assert isinstance(route, APIRoute)
            path = re.sub(r"\{[^}]+\}", "some-model", route.path)
            routes += [(method, path) for method in sorted(route.methods or ())]
    return routes


def _send(live: LiveServer, method: str, path: str, values: list[str]) -> httpx.Response:
    headers = [("Authorization", f"Bearer {v}") for v in values]
    body = None if method in ("GET", "HEAD") else b"{}"
    return httpx.request(method, f"{live.base_url}{path}", headers=headers, content=body,
                         timeout=30)


def _assert_refused(r: httpx.Response, path: str, method: str) -> None:
    assert r.status_code == 400, (method, path, r.status_code, r.text)
    if method == "HEAD":
        return
    if is_openai_path(path):
        err = r.json()["error"]
        assert err["param"] == "Authorization" and err["type"] == "invalid_request_error"
        assert "one Authorization header" in err["message"]
    else:
        assert set(r.json()) == {"error"} and "one Authorization header" in r.json()["error"]


def test_two_authorization_headers_are_refused_on_every_authenticated_route(
        governed: tuple[LiveServer, list[str]]) -> None:
    live, (key, other) = governed
    routes = _authenticated_routes()
    assert ("POST", "/v1/chat/completions") in routes and ("DELETE", "/api/delete") in routes
    assert ("POST", "/edge/v1/feedback") in routes
    for method, path in routes:
        _assert_refused(_send(live, method, path, [key, other]), path, method)
        _assert_refused(_send(live, method, path, [key, "not-a-key"]), path, method)
        _assert_refused(_send(live, method, path, ["not-a-key", key]), path, method)
    assert _send(live, "GET", "/api/tags", [key]).status_code == 200
    assert _send(live, "GET", "/v1/models", [other]).status_code == 200
    assert _send(live, "GET", "/v1/models", []).status_code == 401


def test_two_authorization_headers_are_refused_in_open_mode_too(tmp_path: Path) -> None:
    live, _ = _server(tmp_path, keys=False)
    try:
        assert _send(live, "GET", "/api/tags", []).status_code == 200
        _assert_refused(_send(live, "GET", "/api/tags", ["a", "b"]), "/api/tags", "GET")
        _assert_refused(_send(live, "GET", "/v1/models", ["a", "b"]), "/v1/models", "GET")
    finally:
        live.stop()
