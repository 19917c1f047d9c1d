from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.governance.redaction import Detectors, Redactor, device_key, evaluate

FIXTURE = Path(__file__).parent / "fixtures" / "redaction.jsonl"
TEXT = ("Mail jane.doe@example.com or call (415) 555-2671; card 4111 1111 1111 1111; "
        "order ORD-2024-118842 on 2024-11-30, SKU 4006381333931 at 12.99")


@pytest.fixture(scope="module")
def detectors() -> Detectors:
    return Detectors(["US", "GB", "DE", "FR"], ["us", "es", "it"])


def test_labelled_fixture_recall_and_precision_per_type(detectors: Detectors) -> None:
    samples = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(samples) >= 200
    assert sum(1 for s in samples if not s["entities"]) >= 50  # negatives: orders, dates, SKUs
    scores = evaluate(detectors, samples)
    assert set(scores) == {"EMAIL", "PHONE", "CARD", "IBAN", "NATIONAL_ID", "IP_ADDRESS",
                           "MAC_ADDRESS", "SECRET"}
    for entity, s in scores.items():
        assert s["recall"] >= 0.95, (entity, s)
        assert s["precision"] >= 0.90, (entity, s)


@pytest.mark.parametrize(("operator", "expected"), [
    ("tag", "Mail <EMAIL> or call <PHONE>; card <CARD>; "),
    ("mask", "Mail ******************** or call **************; card ************1111; "),
])
def test_operators_and_spans_point_into_the_redacted_text(detectors: Detectors, operator: str,
                                                          expected: str) -> None:
    redactor = Redactor(detectors, b"k" * 32, operator=operator)  # type: ignore[arg-type]
    text, spans = redactor.redact(TEXT)
    assert text.startswith(expected)
    assert text.endswith("order ORD-2024-118842 on 2024-11-30, SKU 4006381333931 at 12.99")
    assert [s.entity for s in spans] == ["EMAIL", "PHONE", "CARD"]
    for span in spans:
        assert span.operator == operator and span.detector_version
        piece = text[span.start:span.end]
        assert piece == f"<{span.entity}>" if operator == "tag" else piece.startswith("*")


def test_hmac_tokens_are_keyed_and_stable(detectors: Detectors, tmp_path: Path) -> None:
    key = device_key(tmp_path)
    assert device_key(tmp_path) == key and len(key) == 32
    assert (tmp_path / "redaction.key").stat().st_mode & 0o777 == 0o600
    one = Redactor(detectors, key, operator="hmac").redact("a@b.example.com")[0]
    again = Redactor(detectors, key, operator="hmac").redact("a@b.example.com")[0]
    other = Redactor(detectors, b"x" * 32, operator="hmac").redact("a@b.example.com")[0]
    assert one == again != other and one.startswith("<EMAIL:") and "a@b" not in one


SECRET_EMAIL = "marta.kowalska@example.com"
SECRET_PHONE = "(415) 555-2671"
SECRET_CARD = "4111 1111 1111 1111"


@pytest.mark.integration
def test_nothing_raw_is_stored_and_the_redaction_log_has_the_spans(
        model_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import sqlite3

    import httpx

    from edge_agent.config import load_settings
    from edge_agent.engine.models.catalog import ModelStore
    from edge_agent.engine.runtime.llama import LlamaModel
    from tests.conftest import DEFAULT_MODEL, clone_state, free_port, start_server

    caplog.set_level(logging.DEBUG)
    state = clone_state(model_cache, tmp_path / "state")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[tenants.local]\nredact_prompt = true\n[retention]\ncontent_hours = 24\n')
    settings = load_settings(cfg, state_dir=state, **{"server.port": free_port(),
                                                      "runtime.context_length": 512})
    live = start_server(settings)
    try:
        prompt = (f"My email is {SECRET_EMAIL}, my phone {SECRET_PHONE} and my card "
                  f"{SECRET_CARD}. Please confirm.")
        r = httpx.post(f"{live.base_url}/api/generate", timeout=60, headers={
            "X-Request-Id": "redact-1"}, json={"model": DEFAULT_MODEL, "prompt": prompt,
                                                "raw": True, "stream": False,
                                                "options": {"num_predict": 8}})
        assert r.status_code == 200
        context = r.json()["context"][: r.json()["prompt_eval_count"]]
        live.app.state.parts.ledger.flush()
    finally:
        live.stop()
    # The model saw the redacted prompt.
    model = LlamaModel(ModelStore(state).get(DEFAULT_MODEL).blob_path(state), n_gpu_layers=0)
    seen = b"".join(model.piece(t) for t in context).decode()
    model.close()
    assert "<EMAIL>" in seen and "<PHONE>" in seen and "<CARD>" in seen
    assert SECRET_EMAIL not in seen
    # No raw value in the database, its WAL, or any log line.
    raw = b"".join(p.read_bytes() for p in state.glob("ledger.db*"))
    for value in (SECRET_EMAIL, SECRET_PHONE, SECRET_CARD, "4111111111111111"):
        assert value.encode() not in raw
        assert all(value not in rec.getMessage() and value not in str(rec.__dict__)
                   for rec in caplog.records)
    db = sqlite3.connect(state / "ledger.db")
    request_id = db.execute("SELECT id FROM requests WHERE trace_id = 'redact-1'").fetchone()[0]
    spans = db.execute("SELECT entity_type, direction, message_index, start, \"end\", operator "
                       "FROM redactions WHERE request_id = ? ORDER BY start",
                       [request_id]).fetchall()
    assert [s[0] for s in spans if s[1] == "prompt"] == ["EMAIL", "PHONE", "CARD"]
    stored = db.execute("SELECT text FROM contents WHERE request_id = ? AND direction = "
                        "'prompt'", [request_id]).fetchone()[0]
    for entity, _direction, _i, start, end, operator in spans:
        if _direction == "prompt":
            assert stored[start:end] == f"<{entity}>" and operator == "tag"
    # The answer, kept too: redacted after the response, on the ledger's writer, and
    # there by the time the writer is flushed.
    answers = db.execute("SELECT text FROM contents WHERE request_id = ? AND direction = "
                         "'response'", [request_id]).fetchall()
    assert len(answers) == 1 and answers[0][0] == r.json()["response"]
