"""Model management (delete, unload, loading outside the scope) needs an operator; reading a
model outside the scope is 403; the default model is never deleted or unloaded."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlite_utils import Database

from edge_agent.cli import main
from edge_agent.config import load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.registry import FOREVER
from edge_agent.governance.keys import MIGRATIONS, KeyStore
from edge_agent.governance.tenants import Governor
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

CONFIG = """
[tenants.beta]
models = ["gemma3:*"]

[tenants.shop]
models = ["smollm2:*", "copy:*"]

[tenants.ops]
models = ["gemma3:*"]
manage_models = true
"""
DOOMED = "copy:doomed"  # copies of the default model's manifest: no blob is copied
WARM = "copy:warm"


def _copy_model(state: Path, name: str) -> None:
    store = ModelStore(state)
    model = store.get(DEFAULT_MODEL).model_copy(update={"name": name})
    store._manifest_path(name).write_text(model.model_dump_json())


@pytest.fixture(scope="module")
def managed(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    root = tmp_path_factory.mktemp("managed")
    state = clone_state(model_cache, root / "state")
    for name in (DOOMED, WARM):
        _copy_model(state, name)
    cfg = root / "config.toml"
    cfg.write_text(CONFIG)
    store = KeyStore(state)
    keys = {t: store.create(t)[0] for t in ("beta", "shop", "ops")}
    keys["beta-admin"] = store.create("beta", admin=True)[0]
    settings = load_settings(cfg, state_dir=state, **{"server.port": free_port(),
                                                      "runtime.context_length": 256})
    live = start_server(settings)
    yield live, keys
    live.stop()


def _call(live: LiveServer, key: str | None, method: str, path: str,
          body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{live.base_url}{path}", json=body, headers=headers,
                         timeout=60)


def _delete(live: LiveServer, key: str | None, model: str) -> httpx.Response:
    return _call(live, key, "DELETE", "/api/delete", {"model": model})


def _show(live: LiveServer, key: str | None, model: str) -> httpx.Response:
    return _call(live, key, "POST", "/api/show", {"model": model})


def _load(live: LiveServer, key: str | None, model: str, keep_alive: object
          ) -> httpx.Response:
    return _call(live, key, "POST", "/api/generate", {"model": model, "keep_alive": keep_alive})


def _loaded(live: LiveServer) -> set[str]:
    return {m.info.name for m in live.app.state.parts.registry.loaded()}


def _operator_refusal(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    assert set(r.json()) == {"error"} and "operator key" in r.json()["error"]


@pytest.mark.integration
def test_delete_needs_an_operator_and_never_takes_the_default_model(
        managed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = managed
    _operator_refusal(_delete(live, keys["beta"], DEFAULT_MODEL))  # outside its scope
    _operator_refusal(_delete(live, keys["shop"], DOOMED))  # inside its scope: still no
    _operator_refusal(_delete(live, keys["beta"], "nope:1"))  # says nothing of existence
    assert _call(live, keys["shop"], "POST", "/api/generate",
                 {"model": DEFAULT_MODEL, "prompt": "hi", "stream": False,
                  "options": {"num_predict": 2}}).status_code == 200
    assert _show(live, keys["shop"], DOOMED).status_code == 200

    assert _delete(live, keys["ops"], "nope:1").status_code == 404  # manage_models = true
    assert _delete(live, keys["ops"], DOOMED).status_code == 200
    assert _show(live, keys["shop"], DOOMED).status_code == 404
    default = _delete(live, keys["beta-admin"], DEFAULT_MODEL)  # operator key
    assert default.status_code == 400 and "default model" in default.json()["error"]
    assert _show(live, keys["shop"], DEFAULT_MODEL).status_code == 200
    assert httpx.get(f"{live.base_url}/ready").status_code == 200


@pytest.mark.integration
def test_pull_needs_an_operator(managed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = managed
    body = {"model": DEFAULT_MODEL, "stream": False}
    _operator_refusal(_call(live, keys["shop"], "POST", "/api/pull", body))
    _operator_refusal(_call(live, keys["beta"], "POST", "/api/pull", {"model": "nope:1"}))
    ok = _call(live, keys["ops"], "POST", "/api/pull", body)
    assert ok.status_code == 200 and ok.json() == {"status": "success"}


@pytest.mark.integration
def test_show_outside_the_scope_is_403_whether_or_not_the_model_exists(
        managed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = managed
    installed, missing = _show(live, keys["beta"], DEFAULT_MODEL), _show(live, keys["beta"],
                                                                         "nope:1")
    assert installed.status_code == missing.status_code == 403
    assert "not allowed" in installed.json()["error"] and set(installed.json()) == {"error"}
    assert _show(live, keys["shop"], DEFAULT_MODEL).status_code == 200
    assert _show(live, keys["ops"], DEFAULT_MODEL).status_code == 200  # an operator reads all
    empty = _call(live, keys["beta"], "POST", "/api/embeddings", {"model": DEFAULT_MODEL})
    assert empty.status_code == 403  # the empty-prompt probe tells nothing either


@pytest.mark.integration
def test_listings_show_only_the_models_a_key_may_reach(
        managed: tuple[LiveServer, dict[str, str]]) -> None:
    """/api/tags, /api/ps and /v1/models list the tenant's `models` (an operator all of
    them); /v1/models/{id} outside the scope is 403 like /api/show, in OpenAI's shape."""
    live, keys = managed

    def names(key: str, path: str) -> set[str]:
        r = httpx.get(f"{live.base_url}{path}", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        if path == "/v1/models":
            return {m["id"] for m in r.json()["data"]}
        return {m["name"] for m in r.json()["models"]}

    installed = names(keys["beta-admin"], "/api/tags")
    assert {DEFAULT_MODEL, WARM} <= installed
    assert names(keys["shop"], "/api/tags") == {
        n for n in installed if n.startswith(("smollm2:", "copy:"))}
    for path in ("/api/tags", "/api/ps", "/v1/models"):
        assert DEFAULT_MODEL not in names(keys["beta"], path), path  # gemma3:* only
        assert not names(keys["beta"], path) - {"gemma3:270m"}, path
    assert DEFAULT_MODEL in names(keys["shop"], "/api/ps")  # loaded, in its scope
    assert names(keys["beta-admin"], "/v1/models") == installed  # an operator sees all
    url = f"{live.base_url}/v1/models/{DEFAULT_MODEL}"
    refused = httpx.get(url, headers={"Authorization": f"Bearer {keys['beta']}"})
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "model"
    nowhere = httpx.get(f"{live.base_url}/v1/models/nope:1",
                        headers={"Authorization": f"Bearer {keys['beta']}"})
    assert nowhere.status_code == 403  # outside the scope: says nothing of existence
    shown = httpx.get(url, headers={"Authorization": f"Bearer {keys['shop']}"})
    assert shown.status_code == 200 and shown.json()["id"] == DEFAULT_MODEL


@pytest.mark.integration
def test_load_outside_the_scope_and_unload_need_an_operator(
        managed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = managed
    assert _load(live, keys["beta"], WARM, "5m").status_code == 403
    assert WARM not in _loaded(live)
    assert _load(live, keys["beta"], DEFAULT_MODEL, 0).status_code == 403

    assert _load(live, keys["beta-admin"], WARM, "1m").status_code == 200  # operator key
    assert WARM in _loaded(live)
    warm = _load(live, keys["shop"], WARM, "5m")  # keeping an in-scope model warm is fine
    assert warm.status_code == 200 and warm.json()["done_reason"] == "load"
    _operator_refusal(_load(live, keys["shop"], WARM, 0))
    chat = _call(live, keys["shop"], "POST", "/api/chat",
                 {"model": WARM, "keep_alive": 0, "stream": False,
                  "messages": [{"role": "user", "content": "hi"}]})
    _operator_refusal(chat)
    assert WARM in _loaded(live)
    gone = _load(live, keys["ops"], WARM, 0)  # manage_models = true
    assert gone.status_code == 200 and gone.json()["done_reason"] == "unload"
    assert WARM not in _loaded(live)
    live.app.state.parts.ledger.flush()
    db = sqlite3.connect(live.settings.state_dir / "ledger.db")
    refused = db.execute("SELECT tenant, endpoint FROM requests WHERE status = 403 AND "
                         "error_type = 'permission_error'").fetchall()
    assert {("beta", "/api/generate"), ("shop", "/api/chat")} <= set(refused)


@pytest.mark.integration
def test_the_default_model_stays_loaded_whatever_keep_alive_asks(
        managed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = managed
    r = _call(live, keys["beta-admin"], "POST", "/api/chat",
              {"model": DEFAULT_MODEL, "keep_alive": 0})
    assert r.status_code == 200 and r.headers["X-Edge-Pinned"] == "true"
    r = _load(live, keys["shop"], DEFAULT_MODEL, 0)  # changes nothing: no privilege needed
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    r = _call(live, keys["shop"], "POST", "/api/generate",
              {"model": DEFAULT_MODEL, "prompt": "hi", "stream": False, "keep_alive": "1s",
               "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.headers["X-Edge-Pinned"] == "true"
    r = _call(live, keys["shop"], "POST", "/api/embed",
              {"model": DEFAULT_MODEL, "input": "hi", "keep_alive": 0})
    assert r.status_code == 200 and r.headers["X-Edge-Pinned"] == "true"
    model = next(m for m in live.app.state.parts.registry.loaded()
                 if m.info.name == DEFAULT_MODEL)
    assert model.keep_alive == FOREVER
    assert httpx.get(f"{live.base_url}/ready").status_code == 200


@pytest.mark.integration
def test_the_open_local_tenant_may_still_manage(live_server: LiveServer) -> None:
    r = _delete(live_server, None, "nope:1")
    assert r.status_code == 404  # past the operator check
    r = _load(live_server, None, DEFAULT_MODEL, 0)
    assert r.status_code == 200 and r.headers["X-Edge-Pinned"] == "true"
    assert DEFAULT_MODEL in _loaded(live_server)


def test_operator_rights_come_from_the_key_or_the_tenant_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    settings = load_settings(cfg, state_dir=tmp_path / "s")
    store = KeyStore(settings.state_dir)
    assert Governor(settings, store).authenticate(None).manage  # open: no keys at all
    plain, admin, ops = (store.create("beta")[0], store.create("beta", admin=True)[0],
                         store.create("ops")[0])
    gov = Governor(settings, store)
    assert not gov.authenticate(f"Bearer {plain}").manage
    assert gov.authenticate(f"Bearer {admin}").manage
    assert gov.authenticate(f"Bearer {ops}").manage


def test_keys_made_before_the_admin_flag_stay_ordinary(tmp_path: Path) -> None:
    db = Database(tmp_path / "keys.db")
    MIGRATIONS.apply(db, stop_before=["m002_admin"])  # a keys.db of the previous release
    db["keys"].insert({"prefix": "abcd1234", "hash": "0" * 64, "tenant": "beta",  # type: ignore[union-attr]
                       "created": 1.0, "last_used": None, "revoked": None})
    db.close()
    store = KeyStore(tmp_path)
    assert [(k.prefix, k.admin) for k in store.list()] == [("abcd1234", False)]
    assert store.load_active()["abcd1234"].admin is False


def test_keys_cli_creates_and_lists_operator_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    runner = CliRunner()
    args = ["--config", str(cfg), "--state-dir", str(tmp_path / "s")]
    made = runner.invoke(main, ["keys", "create", "--tenant", "beta", "--admin", *args])
    assert made.exit_code == 0 and "operator key" in made.output
    assert runner.invoke(main, ["keys", "create", "--tenant", "shop", *args]).exit_code == 0
    rows = json.loads(runner.invoke(main, ["keys", "list", "--json", *args]).output)
    assert [(r["tenant"], r["admin"]) for r in rows] == [("beta", True), ("shop", False)]
    table = runner.invoke(main, ["keys", "list", *args]).output.splitlines()
    assert table[0].split()[:3] == ["PREFIX", "TENANT", "ADMIN"]
    assert [line.split()[2] for line in table[1:]] == ["yes", "no"]
