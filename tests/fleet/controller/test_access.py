"""Who may call which route of the controller: every route of the app against its rule, for
every kind of caller, on a loopback controller and on an exposed one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from edge_agent.fleet.controller.access import PUBLIC, RULES, SCRAPE, is_console
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.console import console_router
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.operators import ROLES, may
from edge_agent.fleet.controller.store import SQLiteStore

SAMPLE_PARAMS = {"{device_id}": "d1", "{rollout_id}": "r1", "{command_id}": "c1",
                 "{sha256}": "a" * 64,
                 "{name}": "nobody", "{path:path}": "metadata/1.root.json"}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(tmp_path / "controller.db")
    yield made
    made.close()


def _app(store: SQLiteStore, tmp_path: Path, **kw: object) -> FastAPI:
    (tmp_path / "releases" / "metadata").mkdir(parents=True, exist_ok=True)
    return create_app(store, ControllerMetrics(store), broker_connected=lambda: True,
                      state_dir=tmp_path, **kw)  # type: ignore[arg-type]


# Routes outside the OpenAPI description: the description itself and the boxes' downloads.
UNDESCRIBED = {("GET", "/openapi.json"), ("HEAD", "/openapi.json"),
               ("GET", "/releases/{path:path}"), ("HEAD", "/releases/{path:path}")}


def _routes(app: FastAPI, store: SQLiteStore) -> set[tuple[str, str]]:
    """Every route: those the OpenAPI description lists, and the console's pages."""
    console = {(method, route.path) for route in console_router(store, None).routes
               for method in getattr(route, "methods", ())}
    return {(method.upper(), path) for path, item in app.openapi()["paths"].items()
            for method in item} | UNDESCRIBED | console


def _url(path: str) -> str:
    for template, value in SAMPLE_PARAMS.items():
        path = path.replace(template, value)
    return path


def _refused(response: httpx.Response) -> bool:
    """Refused: 401 or 403, or a console page's way of saying 401 (to the login page)."""
    return response.status_code in (401, 403) or (
        response.status_code == 303
        and response.headers["location"].startswith("/console/login"))


def test_every_route_has_a_rule_and_every_rule_a_route(store: SQLiteStore,
                                                       tmp_path: Path) -> None:
    routes = _routes(_app(store, tmp_path), store)
    assert routes == set(RULES), (routes ^ set(RULES))
    assert set(RULES.values()) <= {PUBLIC, SCRAPE, *ROLES}


@pytest.mark.parametrize("loopback", [True, False], ids=["loopback", "exposed"])
def test_each_role_is_allowed_or_refused_on_each_route(store: SQLiteStore, tmp_path: Path,
                                                       loopback: bool) -> None:
    http = TestClient(_app(store, tmp_path, loopback=loopback))
    tokens = {role: store.operators.create_operator(f"{role}-1", role, 1.0)[0] for role in ROLES}
    revoked, _ = store.operators.create_operator("gone", "admin", 1.0)
    store.operators.revoke_operator("gone", 2.0)
    callers: dict[str, dict[str, str]] = {
        "anonymous": {},
        **{role: {"Authorization": f"Bearer {token}"} for role, token in tokens.items()},
        "revoked": {"Authorization": f"Bearer {revoked}"},
        "forged": {"Authorization": f"Bearer {tokens['admin'][:-4]}AAAA"},
        "malformed": {"Authorization": "Basic YWRtaW46YWRtaW4="},
        "empty": {"Authorization": "Bearer "},
    }
    for (method, path), rule in sorted(RULES.items()):
        for caller, headers in callers.items():
            response = http.request(method, _url(path), headers=headers,
                                    follow_redirects=False)
            if rule == PUBLIC:  # reached its handler (a sign-in with no token says 401 itself)
                assert response.status_code < 500 and response.status_code != 403, \
                    f"{caller} {method} {path} -> {response.status_code}"
                continue
            if caller not in ROLES:
                allowed = rule == SCRAPE and loopback
            else:
                allowed = rule == SCRAPE or may(caller, rule)
            where = f"{caller} {method} {path} ({rule}) -> {response.status_code}"
            assert _refused(response) != allowed, where
            assert response.status_code < 500, where
            if not allowed and method == "GET" and is_console(path):
                assert response.status_code == (403 if caller in ROLES else 303), where
            elif not allowed:
                assert response.status_code == (403 if caller in ROLES else 401), where
                if method != "HEAD":
                    body = response.json()
                    assert set(body) == {"error"} and body["error"], where
                if response.status_code == 401:
                    assert response.headers["www-authenticate"].startswith("Bearer"), where


def test_a_loopback_controller_without_operators_answers_reads_as_before(
        store: SQLiteStore, tmp_path: Path) -> None:
    http = TestClient(_app(store, tmp_path))
    assert http.get("/devices").json() == {"devices": []}
    assert http.get("/metrics").status_code == 200
    token, _ = store.operators.create_operator("alice", "viewer", 1.0)
    refused = http.get("/devices")  # from the first operator on, tokens only
    assert refused.status_code == 401
    assert "fleet operators create" in refused.json()["error"]
    assert http.get("/devices", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert http.get("/metrics").status_code == 200  # scraping stays open on loopback
    store.operators.revoke_operator("alice", 2.0)
    assert http.get("/devices", headers={"Authorization": f"Bearer {token}"}).status_code == 401
    assert http.get("/devices").status_code == 200  # no operator left: the host's users again


def test_an_exposed_controller_answers_nothing_without_a_token(store: SQLiteStore,
                                                                tmp_path: Path) -> None:
    http = TestClient(_app(store, tmp_path, loopback=False))
    for path in ("/devices", "/rollouts", "/metrics", "/healthz", "/openapi.json"):
        assert http.get(path).status_code == 401, path
    assert http.get("/releases/metadata/1.root.json").status_code == 404  # public: not there
    token, _ = store.operators.create_operator("prom", "viewer", 1.0)
    auth = {"Authorization": f"Bearer {token}"}
    assert http.get("/metrics", headers=auth).status_code == 200
    assert http.get("/healthz", headers=auth).json()["store"] == "ok"
    opened = TestClient(_app(store, tmp_path, loopback=False, metrics_open=True))
    assert opened.get("/metrics").status_code == 200
    assert opened.get("/devices").status_code == 401
    closed = TestClient(_app(store, tmp_path, loopback=True, metrics_open=False))
    assert closed.get("/metrics").status_code == 401


def test_a_route_without_a_rule_is_unreachable(store: SQLiteStore, tmp_path: Path) -> None:
    app = _app(store, tmp_path)
    reached: list[bool] = []

    @app.get("/new")
    def new() -> dict[str, bool]:
        reached.append(True)
        return {"reached": True}

    assert ("GET", "/new") in _routes(app, store) - set(RULES)  # what the test above would catch
    http = TestClient(app)
    assert http.get("/new").json() == {"error": "no route /new"} and not reached
    assert http.get("/nothing-here").status_code == 404
    refused = http.put("/devices")
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, POST"
    assert refused.json() == {"error": "PUT is not allowed here (only GET, POST)"}


def test_the_token_is_checked_before_the_body_is_read(store: SQLiteStore,
                                                      tmp_path: Path) -> None:
    http = TestClient(_app(store, tmp_path, loopback=False))
    viewer, _ = store.operators.create_operator("vic", "viewer", 1.0)
    for headers in ({}, {"Authorization": f"Bearer {viewer}"}):
        response = http.post("/rollouts", content=b"{" * 100_000,
                             headers={**headers, "content-type": "application/json"})
        # 401/403, not the 400 a parsed body would get: the handler was never reached
        assert response.status_code in (401, 403), response.text
