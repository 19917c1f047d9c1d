"""Hostile bodies at every write of the controller, from the rules themselves: oversized,
malformed, surrogate-laden and wrong-typed, with hostile path values, from an admin (who
reaches every handler) and a viewer (refused at the door). Never a 5xx; every refusal in
the API's one error shape (`{"error": "..."}`; the console's forms answer with a page);
and every refused write of a known operator on the audit trail, with its status and filed
under the object its path names. A route added to `access.RULES` joins the table by
itself, and its body's fields come from the app's own OpenAPI description."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from edge_agent.fleet.controller.access import MAX_BODY_BYTES, PUBLIC, RULES, is_console
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.console import FORM_LIMIT
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.store import ControllerStore

SURROGATE = "s\ud800"
# Path values: a plain one, a lone surrogate (percent-encoded UTF-8 of U+D800, which is not
# UTF-8), a climb out of the tree, NUL, and one far longer than any id.
PATH_VALUES = ["r1", "%ED%A0%80", "..%2F..%2Fetc", "a%00b", "x" * 10_000]
WRITES = sorted((method, path) for (method, path), rule in RULES.items()
                if method not in ("GET", "HEAD"))


@pytest.fixture
def app(store: ControllerStore, tmp_path: Path) -> FastAPI:
    (tmp_path / "releases" / "metadata").mkdir(parents=True, exist_ok=True)
    return create_app(store, ControllerMetrics(store), broker_connected=lambda: True,
                      state_dir=tmp_path)


@pytest.fixture
def tokens(store: ControllerStore) -> dict[str, str]:
    return {role: store.operators.create_operator(f"{role}-1", role, 1.0)[0]
            for role in ("viewer", "admin")}


@pytest.fixture
def http(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def _fields(app: FastAPI, method: str, path: str) -> dict[str, dict[str, Any]]:
    """The JSON body's properties as the app describes them (none for a form or a file)."""
    op = app.openapi()["paths"].get(path, {}).get(method.lower(), {})
    content = op.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema", {})
    ref = schema.get("$ref", "")
    if ref:
        schema = app.openapi()["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    return dict(schema.get("properties", {}))


def _hostile_value(prop: dict[str, Any]) -> Any:
    kind = prop.get("type") or next((a.get("type") for a in prop.get("anyOf", [])
                                     if a.get("type") != "null"), "string")
    if kind == "array":
        return [SURROGATE, SURROGATE * 3]
    if kind == "object":
        return {SURROGATE: SURROGATE}
    return SURROGATE


def _wrong_value(prop: dict[str, Any]) -> Any:
    kind = prop.get("type") or "string"
    return {"string": 2**70, "integer": "many", "number": [1], "boolean": {"x": 1},
            "array": {"not": "a list"}, "object": [1, 2]}.get(kind, [[[]]])


def bodies(app: FastAPI, method: str, path: str) -> list[tuple[str, dict[str, str], Any]]:
    """(what, headers, content) for one write: `content` is bytes or an iterator of bytes
    (sent chunked, with no Content-Length)."""
    form = is_console(path)
    kind = "application/x-www-form-urlencoded" if form else "application/json"
    fields = _fields(app, method, path)
    out: list[tuple[str, dict[str, str], Any]] = [
        ("empty", {"content-type": kind}, b""),
        ("truncated JSON", {"content-type": "application/json"}, b'{"devices": ["a", '),
        ("invalid UTF-8", {"content-type": kind}, b'\xff\xfe{"\xc3(": "\xa0\xa1"}'),
        ("NaN and a huge number", {"content-type": "application/json"},
         b'{"waves": NaN, "abort_above": Infinity, "soak": 1' + b"0" * 400 + b"}"),
        ("an array", {"content-type": "application/json"}, b"[1, 2, 3]"),
        ("a string", {"content-type": "application/json"}, b'"text"'),
        ("a form where JSON is read", {"content-type": "application/x-www-form-urlencoded"},
         b"devices=a&fleet=%ED%A0%80"),
        ("multipart", {"content-type": "multipart/form-data; boundary=xx"},
         b"--xx\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n\xff\r\n--xx--\r\n"),
        ("surrogate keys", {"content-type": "application/json"},
         json.dumps({SURROGATE: SURROGATE, "devices": [SURROGATE]}).encode()),
        ("no Content-Length", {"content-type": kind}, iter([b'{"devices":', b' ["a"]}'])),
        ("a Content-Length past the limit", {"content-type": kind,
                                            "content-length": str(1 << 40)}, b"{}"),
    ]
    if fields:
        out += [("every field a lone surrogate", {"content-type": "application/json"},
                 json.dumps({k: _hostile_value(p) for k, p in fields.items()}).encode()),
                ("every field the wrong type", {"content-type": "application/json"},
                 json.dumps({k: _wrong_value(p) for k, p in fields.items()}).encode())]
        for name, p in fields.items():  # one field at a time: the others cannot refuse first
            out += [(f"{name} the wrong type", {"content-type": "application/json"},
                     json.dumps({name: _wrong_value(p)}).encode()),
                    (f"{name} a lone surrogate", {"content-type": "application/json"},
                     json.dumps({name: _hostile_value(p)}).encode())]
    if form:
        out += [("a form of lone surrogates", {"content-type": kind},
                 b"csrf=%ED%A0%80&release=%ED%A0%80&devices=%ED%A0%80&waves=%ED%A0%80"
                 b"&token=eop_%ED%A0%80&next=%ED%A0%80"),
                ("a form of NULs", {"content-type": kind}, b"token=%00&csrf=%00&release=%00"),
                ("a form past its limit", {"content-type": kind},
                 b"token=" + b"a" * (FORM_LIMIT + 1))]
    if (method, path) not in (("PUT", "/release-files/{sha256}"), ("POST", "/releases")):
        out.append(("a body past the limit", {"content-type": kind},
                    b"{" + b" " * MAX_BODY_BYTES + b"}"))
    return out


def _url(path: str, value: str) -> str:
    out = path
    for name in ("{device_id}", "{rollout_id}", "{command_id}", "{name}", "{verb}"):
        out = out.replace(name, value)
    return out.replace("{sha256}", "a" * 64 if value == "r1" else value)


def _no_route(response: httpx.Response) -> bool:
    """Refused before any rule matched (a path value with a '/' in it leaves the route):
    no route, so no operator was looked up and nothing was tried."""
    return response.status_code in (404, 405) and response.json()["error"].startswith(
        ("no route", f"{response.request.method} is not allowed"))


def _check(response: httpx.Response, where: str, console: bool) -> None:
    assert response.status_code < 500, f"{where} -> {response.status_code}: " \
                                        f"{response.text[:500]}"
    if response.status_code >= 400 and not (console and response.headers.get(
            "content-type", "").startswith("text/html")):
        body = response.json()
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], \
            f"{where}: {body}"


@pytest.mark.parametrize(("method", "path"), WRITES, ids=[f"{m} {p}" for m, p in WRITES])
def test_hostile_bodies_never_get_a_5xx_and_every_refusal_is_audited(
        method: str, path: str, app: FastAPI, http: TestClient, store: ControllerStore,
        tokens: dict[str, str]) -> None:
    rule = RULES[(method, path)]
    console = is_console(path)
    values = PATH_VALUES if "{" in path else ["r1"]
    for role, token in tokens.items():
        headers = {"authorization": f"Bearer {token}"}
        if console:  # the console's forms are reached with its session cookie and CSRF
            http.cookies.clear()
        for value in values:
            url = _url(path, value)
            for what, extra, content in bodies(app, method, path):
                where = f"{role} {method} {url[:80]} with {what}"
                before = len(store.audit.actions(limit=100_000))
                response = http.request(method, url, headers={**headers, **extra},
                                        content=content, follow_redirects=False)
                _check(response, where, console)
                if response.status_code < 400 or rule == PUBLIC or _no_route(response):
                    continue
                rows = store.audit.actions(limit=100_000)[before:]
                assert [r.status for r in rows] == [response.status_code], \
                    f"{where}: {response.status_code} recorded as {rows}"
                row = rows[0]
                assert row.operator == f"{role}-1" and row.role == role, where
                if value == "r1" and "{" in path:  # filed under the object the path names
                    assert row.target in ("r1", "a" * 64), f"{where}: target {row.target}"


def test_the_reported_500s_are_refusals_on_the_trail(
        app: FastAPI, http: TestClient, store: ControllerStore,
        tokens: dict[str, str]) -> None:
    admin = {"authorization": f"Bearer {tokens['admin']}"}
    viewer = {"authorization": f"Bearer {tokens['viewer']}"}
    form = {"content-type": "application/x-www-form-urlencoded"}
    # A console form of 64-256 KiB, signed in or not: 413, not 500.
    for path, headers in (("/console/login", form), ("/console/rollouts", {**admin, **form})):
        big = http.post(path, content=b"token=" + b"a" * 100_000, headers=headers)
        assert big.status_code == 413, big.text
        assert "at most" in big.json()["error"]
    assert store.audit.actions(target=None)[-1].status == 413  # the operator's, on the trail
    # A lone surrogate in a list of device ids: 400, and the refusal on the trail.
    register = http.post("/devices", content=json.dumps({"devices": [SURROGATE]}),
                         headers={**admin, "content-type": "application/json"})
    assert register.status_code == 400, register.text
    assert "holds" in register.json()["error"]
    last = store.audit.actions()[-1]
    assert (last.action, last.status, last.operator) == ("device.register", 400, "admin-1")
    assert "\ufffd" in (last.target or "")
    # A viewer's refused write is filed under its target: `fleet audit --target r1`.
    refused = http.post("/rollouts/r1/pause", headers=viewer, content=b"")
    assert refused.status_code == 403
    (mine,) = store.audit.actions(target="r1")
    assert (mine.operator, mine.role, mine.status) == ("viewer-1", "viewer", 403)
    assert mine.action == "POST /rollouts/r1/pause"
    # A malformed body, refused before any handler ran: on the trail all the same.
    bad = http.post("/rollouts", content=b'{"release": ', headers={
        **admin, "content-type": "application/json"})
    assert bad.status_code == 400
    last = store.audit.actions()[-1]
    assert (last.action, last.status, last.operator) == ("POST /rollouts", 400, "admin-1")
    assert last.outcome == bad.json()["error"]


def test_an_anonymous_refusal_is_not_on_the_trail(http: TestClient, store: ControllerStore,
                                                  tokens: dict[str, str]) -> None:
    """Who did what: a caller with no valid token is nobody, and an anonymous flood must not
    fill the trail."""
    for _ in range(3):
        assert http.post("/rollouts/r1/pause", content=b"{}").status_code == 401
    assert store.audit.actions() == []


def test_a_path_value_is_kept_as_sent_where_it_can_be(
        http: TestClient, store: ControllerStore, tokens: dict[str, str]) -> None:
    viewer = {"authorization": f"Bearer {tokens['viewer']}"}
    odd = "d-" + quote("é")
    assert http.post(f"/devices/{odd}/retire", headers=viewer).status_code == 403
    assert [r.target for r in store.audit.actions()] == ["d-é"]


READS = sorted((method, path) for (method, path) in RULES if method in ("GET", "HEAD"))
HOSTILE_QUERY = ("limit=-1&since=yesterday&target=%00&operator=%ED%A0%80&prefix=%00"
                 "&state=%ff&next=//elsewhere&name=%00&error=%ED%A0%80")


@pytest.mark.parametrize(("method", "path"), READS, ids=[f"{m} {p}" for m, p in READS])
def test_hostile_paths_and_queries_on_every_read_never_get_a_5xx(
        method: str, path: str, http: TestClient, tokens: dict[str, str]) -> None:
    """The reads take no body, but their path values and filters reach the store too."""
    headers = {"authorization": f"Bearer {tokens['viewer']}"}
    values = PATH_VALUES if "{" in path else ["r1"]
    for value in values:
        for query in ("", HOSTILE_QUERY, "limit=99999999999999999999999&since=1e999"):
            url = path.replace("{path:path}", value)
            url = _url(url, value) + (f"?{query}" if query else "")
            response = http.request(method, url, headers=headers, follow_redirects=False)
            where = f"{method} {url[:100]}"
            assert response.status_code < 500, f"{where} -> {response.status_code}"
            if method == "GET" and response.status_code >= 400 and not (
                    is_console(path) and response.headers.get(
                        "content-type", "").startswith("text/html")):
                assert set(response.json()) == {"error"}, f"{where}: {response.text[:300]}"
