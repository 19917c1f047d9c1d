"""Tenants, keys and enforcement in both dialects, with their ledger rows."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from edge_agent import __version__
from edge_agent.cli import main
from edge_agent.config import load_settings
from edge_agent.errors import Unauthorized
from edge_agent.governance.keys import KeyStore
from edge_agent.governance.tenants import Governor
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

CONFIG = """
[tenants.shop]
models = ["smollm2:*"]
max_output_tokens = 20
requests_per_minute = 1000

[tenants.kiosk]
models = ["smollm2:135m"]
requests_per_minute = 2

[tenants.tight]
max_context_tokens = 96
truncate = "oldest_turns"
output_limit = "clamp"
max_output_tokens = 8
"""


@pytest.fixture(scope="module")
def governed(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    root = tmp_path_factory.mktemp("governed")
    state = clone_state(model_cache, root / "state")
    cfg = root / "config.toml"
    cfg.write_text(CONFIG)
    store = KeyStore(state)
    keys = {t: store.create(t)[0] for t in ("shop", "kiosk", "tight")}
    settings = load_settings(cfg, state_dir=state, **{"server.port": free_port(),
                                                      "runtime.context_length": 512})
    live = start_server(settings)
    yield live, keys
    live.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(live: LiveServer, key: str | None, **body: object) -> httpx.Response:
    payload = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 4, **body}
    return httpx.post(f"{live.openai_url}/chat/completions", json=payload, timeout=60,
                      headers=_auth(key) if key else {})


def _ollama(live: LiveServer, key: str | None, **body: object) -> httpx.Response:
    payload = {"model": DEFAULT_MODEL, "prompt": "hi", "stream": False,
               "options": {"num_predict": 4}, **body}
    return httpx.post(f"{live.base_url}/api/generate", json=payload, timeout=60,
                      headers=_auth(key) if key else {})


def _ledger(live: LiveServer, *answered: httpx.Response) -> list[sqlite3.Row]:
    """The rows, once those of the `answered` requests are there (a row is queued after
    the response's last byte, so it may trail the client by a moment)."""
    want = {r.headers["x-request-id"] for r in answered}
    deadline = time.monotonic() + 10
    while True:
        live.app.state.parts.ledger.flush()
        db = sqlite3.connect(live.settings.state_dir / "ledger.db")
        db.row_factory = sqlite3.Row
        rows = list(db.execute("SELECT * FROM requests ORDER BY ts"))
        db.close()
        if want <= {r["trace_id"] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


@pytest.mark.integration
def test_missing_or_bad_keys_get_401_in_both_dialects(
        governed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = governed
    r = _chat(live, None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _chat(live, keys["shop"][:-2] + "xx")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _ollama(live, "not-a-key")
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert httpx.get(f"{live.base_url}/api/tags").status_code == 401
    assert httpx.get(f"{live.base_url}/health").status_code == 200  # liveness stays open
    last = _chat(live, keys["shop"])
    assert last.status_code == 200
    rows = [r for r in _ledger(live, last) if r["status"] == 401]
    assert len(rows) >= 3 and all(r["error_type"] == "authentication_error" for r in rows)


@pytest.mark.integration
def test_model_outside_the_tenants_scope_is_403(
        governed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = governed
    r = _chat(live, keys["shop"], model="gemma3:270m")
    assert r.status_code == 403 and r.json()["error"]["param"] == "model"
    r = _ollama(live, keys["kiosk"], model="gemma3:270m")
    assert r.status_code == 403 and "not allowed" in r.json()["error"]
    answered = r
    row = [r for r in _ledger(live, answered) if r["status"] == 403][-1]
    assert row["tenant"] == "kiosk" and row["key_prefix"] == keys["kiosk"].split("_")[1]


@pytest.mark.integration
def test_rate_limit_gives_429_with_retry_after(
        governed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = governed
    codes = [_ollama(live, keys["kiosk"]).status_code for _ in range(2)]
    assert codes == [200, 200]
    r = _ollama(live, keys["kiosk"])
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
    assert "2 requests per minute" in r.json()["error"]
    r = _chat(live, keys["kiosk"])
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    answered = r
    assert [r["tenant"] for r in _ledger(live, answered) if r["status"] == 429][-1] == "kiosk"


@pytest.mark.integration
def test_output_ceiling_refuses_or_clamps_and_says_so(
        governed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = governed
    r = _chat(live, keys["shop"], max_tokens=50)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "ceiling of 20" in r.json()["error"]["message"]
    r = _ollama(live, keys["shop"], options={"num_predict": 50})
    assert r.status_code == 400 and "options.num_predict" in r.json()["error"]
    r = _chat(live, keys["tight"], max_tokens=50)
    assert r.status_code == 200 and r.headers["X-Edge-Clamped"] == "8"
    assert r.json()["usage"]["completion_tokens"] <= 8
    unasked = _chat(live, keys["shop"], max_tokens=None, logit_bias={"2": -100, "0": -100})
    assert unasked.json()["usage"]["completion_tokens"] == 20  # the ceiling, no header
    assert "X-Edge-Clamped" not in unasked.headers
    row = [r for r in _ledger(live, unasked) if r["clamped"] == 1][-1]
    assert row["tenant"] == "tight"


@pytest.mark.integration
def test_over_long_prompt_is_refused_or_loses_its_oldest_turns(
        governed: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = governed
    long_user = "Tell me about apples and pears and plums. " * 30
    r = _chat(live, keys["shop"], messages=[{"role": "user", "content": long_user * 3}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in r.json()["error"]["message"]
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        history += [{"role": "user", "content": f"Question {i} about the opening hours?"},
                    {"role": "assistant", "content": f"Answer {i}: nine to five."}]
    history.append({"role": "user", "content": "And on Sunday?"})
    r = _chat(live, keys["tight"], messages=history, max_tokens=4)
    assert r.status_code == 200
    dropped = int(r.headers["X-Edge-Truncated"])
    assert dropped > 0 and r.json()["usage"]["prompt_tokens"] + 4 <= 96
    answered = r
    row = [r for r in _ledger(live, answered) if r["truncated_tokens"]][-1]
    assert row["truncated_tokens"] == dropped and row["tenant"] == "tight"
    r = _ollama(live, keys["tight"], prompt="word " * 200)  # no turns to drop: refused
    assert r.status_code == 400 and "context window is 96" in r.json()["error"]


@pytest.mark.integration
def test_revoked_key_stops_working(governed: tuple[LiveServer, dict[str, str]]) -> None:
    live, _ = governed
    key, record = KeyStore(live.settings.state_dir).create("shop")
    assert _chat(live, key).status_code == 200
    assert KeyStore(live.settings.state_dir).revoke(record.prefix)
    deadline = time.monotonic() + 10
    while _chat(live, key).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert _chat(live, key).status_code == 401


def test_keys_cli_create_list_revoke(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    runner = CliRunner()
    args = ["--config", str(cfg), "--state-dir", str(tmp_path / "s")]
    created = runner.invoke(main, ["keys", "create", "--tenant", "shop", *args])
    assert created.exit_code == 0
    key = created.output.strip().splitlines()[0]
    assert key.startswith("ea_")
    listed = runner.invoke(main, ["keys", "list", "--json", *args])
    import json

    rows = json.loads(listed.output)
    assert rows[0]["tenant"] == "shop" and rows[0]["prefix"] == key.split("_")[1]
    assert key not in (tmp_path / "s" / "keys.db").read_bytes().decode("latin-1")
    assert runner.invoke(main, ["keys", "revoke", rows[0]["prefix"], *args]).exit_code == 0
    assert runner.invoke(main, ["keys", "revoke", rows[0]["prefix"], *args]).exit_code == 1
    unknown = runner.invoke(main, ["keys", "create", "--tenant", "nobody", *args])
    assert unknown.exit_code == 2 and "not in the configuration" in unknown.output


def test_a_key_created_a_moment_after_a_reload_works_at_once(tmp_path: Path) -> None:
    """The server re-reads the key store at most every 0.5 s on an unknown key, unless the
    store was written since: a key the CLI made right after another request's reload is
    taken, not answered 401 (it was, for up to half a second)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tenants.shop]\nmodels = ["*"]\n')
    settings = load_settings(cfg, state_dir=tmp_path / "s")
    store = KeyStore(settings.state_dir)
    first, _ = store.create("shop")
    gov = Governor(settings, store)
    with pytest.raises(Unauthorized):
        gov.authenticate("Bearer ea_00000000_" + "x" * 43)  # an unknown key: a reload now
    fresh, _ = store.create("shop")
    assert gov.authenticate(f"Bearer {fresh}").name == "shop"
    for _ in range(20):  # unknown keys with nothing new: throttled, still refused
        with pytest.raises(Unauthorized):
            gov.authenticate("Bearer ea_00000000_" + "y" * 43)
    assert gov.authenticate(f"Bearer {first}").name == "shop"


@pytest.mark.integration
def test_doctor_knows_its_own_server_on_a_box_with_tenants(
        governed: tuple[LiveServer, dict[str, str]]) -> None:
    """With tenants every API route asks for a key (401); doctor tells its own server on
    the port by /health, which never does, instead of calling it another program."""
    live, _ = governed
    port = live.settings.server.port
    result = CliRunner().invoke(main, ["doctor", "--state-dir", str(live.settings.state_dir),
                                       "--port", str(port)])
    assert f"ok    port: edge-agent {__version__} answers on 127.0.0.1:{port}" in \
        result.output, result.output
