"""An app's verdict on an answer (`POST /edge/v1/feedback`): by the id the answer carried
(the OpenAI `id`, or `X-Edge-Request-Id` in either dialect), kept on the request's ledger
row, counted in `/metrics`; refused for an unknown id or another tenant's, and for a body
outside the closed sets, in OpenAI's error shape."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from edge_agent.api.feedback import FeedbackBody
from edge_agent.config import load_settings
from edge_agent.fleet.protocol import feedback as wire
from edge_agent.governance.keys import KeyStore
from edge_agent.ledger.feedback import RATINGS, REASONS, rate
from edge_agent.ledger.store import REQUESTS, open_ledger
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

CONFIG = """
[tenants.shop]
models = ["smollm2:*"]

[tenants.kiosk]
models = ["smollm2:*"]
"""
ROW_ID = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def box(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    root = tmp_path_factory.mktemp("feedback")
    state = clone_state(model_cache, root / "state")
    cfg = root / "config.toml"
    cfg.write_text(CONFIG)
    store = KeyStore(state)
    keys = {t: store.create(t)[0] for t in ("shop", "kiosk")}
    settings = load_settings(cfg, state_dir=state, **{"server.port": free_port(),
                                                      "runtime.context_length": 512})
    live = start_server(settings)
    yield live, keys
    live.stop()


def _post(live: LiveServer, key: str | None, body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{live.base_url}/edge/v1/feedback", json=body, headers=headers,
                      timeout=30)


def _row(live: LiveServer, row_id: str) -> dict[str, Any]:
    db = sqlite3.connect(live.settings.state_dir / "ledger.db")
    db.row_factory = sqlite3.Row
    try:
        found = db.execute("SELECT * FROM requests WHERE id = ?", [row_id]).fetchone()
    finally:
        db.close()
    assert found is not None, row_id
    return dict(found)


def _counted(live: LiveServer, rating: str) -> float:
    text = httpx.get(f"{live.base_url}/metrics", timeout=30).text
    found = re.search(rf'^edge_agent_feedback_total\{{model="{re.escape(DEFAULT_MODEL)}",'
                      rf'rating="{rating}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _openai_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return dict(err)


@pytest.mark.integration
def test_a_verdict_by_the_answers_id_is_kept_on_its_row_and_counted(
        box: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = box
    client = OpenAI(base_url=live.openai_url, api_key=keys["shop"], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    completion = raw.parse()
    row_id = raw.headers["x-edge-request-id"]
    assert ROW_ID.match(row_id) and completion.id == f"chatcmpl-{row_id}"
    good_before, bad_before = _counted(live, "good"), _counted(live, "bad")

    r = _post(live, keys["shop"], {"request_id": completion.id, "rating": "good"})
    assert r.status_code == 200, r.text
    echo = r.json()
    assert echo == {"object": "feedback", "request_id": row_id, "model": DEFAULT_MODEL,
                    "rating": "good", "reason": None, "created": echo["created"],
                    "replaced": False}
    row = _row(live, row_id)
    assert (row["feedback"], row["feedback_reason"]) == ("good", None)
    assert row["feedback_at"] >= row["ts"] and row["tenant"] == "shop"
    assert _counted(live, "good") == good_before + 1

    # A second verdict, by the header's id, replaces the first and says so.
    r = _post(live, keys["shop"], {"request_id": row_id, "rating": "bad", "reason": "wrong"})
    assert r.status_code == 200 and r.json()["replaced"] is True
    assert (_row(live, row_id)["feedback"], _row(live, row_id)["feedback_reason"]) == \
        ("bad", "wrong")
    assert _counted(live, "bad") == bad_before + 1

    # Another tenant's request reads as unknown, and its verdict is not kept.
    err = _openai_error(_post(live, keys["kiosk"], {"request_id": row_id, "rating": "good"}),
                        404, "request_id")
    assert err["code"] == "not_found"
    _openai_error(_post(live, keys["shop"], {"request_id": "0" * 32, "rating": "good"}),
                  404, "request_id")
    assert _row(live, row_id)["feedback"] == "bad"
    assert _counted(live, "good") == good_before + 1


@pytest.mark.integration
def test_an_ollama_answer_is_rated_by_its_header(
        box: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = box
    r = httpx.post(f"{live.base_url}/api/generate", timeout=60,
                   headers={"Authorization": f"Bearer {keys['kiosk']}",
                            "X-Request-Id": "shared-trace"},
                   json={"model": DEFAULT_MODEL, "prompt": "hi", "stream": False,
                         "options": {"num_predict": 2}})
    assert r.status_code == 200
    row_id = r.headers["x-edge-request-id"]
    assert r.headers["x-request-id"] == "shared-trace" != row_id
    # The trace id is the client's and may name many requests: not a request id.
    _openai_error(_post(live, keys["kiosk"], {"request_id": "shared-trace", "rating": "good"}),
                  404, "request_id")
    r = _post(live, keys["kiosk"], {"request_id": row_id, "rating": "good", "reason": "other"})
    assert r.status_code == 200 and r.json()["replaced"] is False
    assert _row(live, row_id)["feedback"] == "good"


@pytest.mark.integration
@pytest.mark.parametrize(("body", "param"), [
    ({"request_id": "0" * 32, "rating": "great"}, "rating"),
    ({"request_id": "0" * 32, "rating": "bad", "reason": "I did not like it"}, "reason"),
    ({"request_id": "0" * 32, "rating": "good", "comment": "free text"}, "comment"),
    ({"rating": "good"}, "request_id"),
    ({"request_id": "", "rating": "good"}, "request_id"),
])
def test_a_body_outside_the_closed_sets_is_refused(
        box: tuple[LiveServer, dict[str, str]], body: dict[str, Any], param: str) -> None:
    live, keys = box
    err = _openai_error(_post(live, keys["shop"], body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.integration
def test_a_verdict_needs_a_key(box: tuple[LiveServer, dict[str, str]]) -> None:
    live, _ = box
    err = _openai_error(_post(live, None, {"request_id": "0" * 32, "rating": "good"}), 401,
                        None)
    assert err["code"] == "invalid_api_key"


def test_the_ratings_are_the_wires_and_the_schemas() -> None:
    assert RATINGS == wire.RATINGS
    schema = FeedbackBody.model_json_schema()
    assert set(schema["properties"]["rating"]["enum"]) == set(RATINGS)
    assert schema["additionalProperties"] is False
    assert len(REASONS) == 6


def test_rate_touches_only_the_tenants_row(tmp_path: Path) -> None:
    db = open_ledger(tmp_path / "ledger.db")
    requests = db[REQUESTS]
    requests.insert({"id": "a" * 32, "trace_id": "t", "ts": 1.0, "tenant": "shop",  # type: ignore[union-attr]
                     "model": "m:1", "status": 200})
    assert rate(db, "a" * 32, "kiosk", "good", None, 2.0) is None
    first = rate(db, "a" * 32, "shop", "good", None, 2.0)
    assert first is not None and (first.model, first.replaced) == ("m:1", False)
    again = rate(db, "a" * 32, "shop", "bad", "slow", 3.0)
    assert again is not None and again.replaced
    row = db[REQUESTS].get("a" * 32)  # type: ignore[union-attr]
    assert (row["feedback"], row["feedback_reason"], row["feedback_at"]) == ("bad", "slow", 3.0)
    db.close()


def test_a_ledger_from_before_gains_the_feedback_columns(tmp_path: Path) -> None:
    from edge_agent.ledger.store import pending_migrations

    path = tmp_path / "ledger.db"
    open_ledger(path).close()
    db = sqlite3.connect(path)  # as the ledger was before the columns' migration
    for column in ("feedback", "feedback_reason", "feedback_at"):
        db.execute(f"ALTER TABLE requests DROP COLUMN {column}")
    db.execute("DELETE FROM _sqlite_migrations WHERE name = 'm011_feedback'")
    db.commit()
    db.close()
    assert pending_migrations(path) == ["m011_feedback"]
    columns = open_ledger(path)["requests"].columns_dict  # type: ignore[union-attr]
    assert {"feedback", "feedback_reason", "feedback_at"} <= set(columns)
