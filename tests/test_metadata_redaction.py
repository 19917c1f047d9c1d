"""Client-supplied metadata (trace ids, model names, paths) is redacted before it is stored,
and model output gets a lenient pass."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from edge_agent.config import TenantPolicy
from edge_agent.engine.request import GenerationRequest
from edge_agent.gateway.privacy import RequestPrivacy
from edge_agent.governance.redaction import (
    LONG_MODEL_NAME,
    Detectors,
    MetadataRedactor,
    Redactor,
)
from edge_agent.governance.tenants import TenantContext
from edge_agent.ledger.store import CONTENTS, REDACTIONS
from edge_agent.logs import RequestContext, access_var, note
from tests.conftest import DEFAULT_MODEL, LiveServer

FIXTURE = Path(__file__).parent / "fixtures" / "redaction.jsonl"
SSN_ID = "req-078-05-1120"
EMAIL_MODEL = "model-jane.doe@example.com"
RAW = ("078-05-1120", "jane.doe", "example.com")


@pytest.fixture(scope="module")
def redactor() -> Redactor:
    return Redactor(Detectors(["US", "GB", "DE", "FR"], ["us", "es", "it"]), b"k" * 32)


@pytest.fixture(scope="module")
def meta(redactor: Redactor) -> MetadataRedactor:
    return MetadataRedactor(redactor, lambda name: name == DEFAULT_MODEL)


@pytest.mark.parametrize("value", [
    "4bf92f3577b34da6a3ce929d0e0e4736",  # W3C trace id, uuid4().hex
    "550e8400-e29b-41d4-a716-446655440000",  # UUID
    "01ARZ3NDEKTSV4RRFFQ69G5FAV",  # ULID
    "ledger-ok-1", "redact-1", "checkout.v2:retry-3",
])
def test_trace_ids_that_look_like_ids_are_kept(meta: MetadataRedactor, value: str) -> None:
    assert meta.trace_id(value) == value


@pytest.mark.parametrize("value", [
    SSN_ID, "jane.doe@example.com", "call-4155552671", "4111111111111111",
    "user-DE81-6307-1422-8229-7547-26",
])
def test_trace_ids_with_personal_data_become_a_keyed_digest(
        meta: MetadataRedactor, redactor: Redactor, value: str) -> None:
    replaced = meta.trace_id(value)
    assert replaced.startswith("redacted-") and len(replaced) == len("redacted-") + 24
    assert meta.trace_id(value) == replaced  # stable: a repeated id still correlates
    other = MetadataRedactor(Redactor(redactor.detectors, b"x" * 32), lambda n: False)
    assert other.trace_id(value) != replaced  # keyed per device


def test_unknown_model_names_are_redacted_installed_ones_kept(meta: MetadataRedactor) -> None:
    assert meta.model(DEFAULT_MODEL) == DEFAULT_MODEL
    assert meta.model("nope:1") == "nope:1"  # no personal data: a typo stays visible
    assert meta.model(EMAIL_MODEL) == "<EMAIL>"
    assert meta.model("bot-+49 30 12345678") == "bot-<PHONE>"
    assert meta.model("m\ud800x") == "m\ufffdx"
    assert meta.model("x" * 300) == LONG_MODEL_NAME

    def broken(name: str) -> bool:
        raise OSError("File name too long")

    assert MetadataRedactor(meta.redactor, broken).model(EMAIL_MODEL) == "<EMAIL>"
    assert meta.path("/api/jane.doe@example.com") == "/api/<EMAIL>"
    assert meta.path("/" + "a" * 3000 + "/x").endswith("...")


@pytest.mark.parametrize(("text", "entity"), [
    ("Sure, I will call 49 3012345678 tomorrow.", "PHONE"),
    ("Sure, I will call +33 123 456789 tomorrow.", "PHONE"),
    ("Your number is 0049 30 1234 5678.", "PHONE"),
    ("The card starts 4111 1111 1111 and expires soon.", "CARD"),
    ("The card is 5500-0000-0000-00.", "CARD"),
    ("The IBAN begins DE81 6307 1422 82 for sure.", "IBAN"),
    ("The IBAN begins FR76300060000112 for sure.", "IBAN"),
    ("Your SSN 078-05-1120 is on file.", "PHONE"),
])
def test_the_lenient_pass_catches_what_a_model_repeats_differently(
        redactor: Redactor, text: str, entity: str) -> None:
    redacted, spans = redactor.redact(text, lenient=True)
    assert [s.entity for s in spans] == [entity], redacted
    assert not any(ch.isdigit() for ch in redacted), redacted


def test_the_lenient_pass_finds_everything_the_strict_one_does(redactor: Redactor) -> None:
    """Prompt-side precision is the strict pass's (tests/test_redaction.py); the lenient
    pass only adds, so its recall on the labelled fixture is complete too."""
    for line in FIXTURE.read_text().splitlines():
        sample = json.loads(line)
        text = sample["text"]
        lenient = {(f.entity, text[f.start:f.end])
                   for f in redactor.detectors.find(text, lenient=True)}
        for entity in sample["entities"]:
            assert (entity["type"], entity["value"]) in lenient, text
    prose = "We open at 9, close at 18:30 on 2024-11-30; version 1.2.3 costs 12.99."
    assert redactor.redact(prose, lenient=True)[0] == prose


def test_responses_get_the_lenient_pass_prompts_the_strict_one(redactor: Redactor) -> None:
    rows: list[tuple[str, dict[str, Any]]] = []
    privacy = RequestPrivacy(redactor, keep_content=True,
                             record=lambda table, row: rows.append((table, row)))
    text = "Call 49 3012345678 or +33 123 456789."
    assert privacy.redact_and_log(text, "response", 0, "assistant") == \
        "Call <PHONE> or <PHONE>."
    assert privacy.redact_and_log(text, "prompt", 0, "user") == text  # strict: unchanged
    spans = [row for table, row in rows if table == REDACTIONS]
    assert [(s["direction"], s["detector"]) for s in spans] == [
        ("response", "loose-phone"), ("response", "loose-phone")]
    stored = [row["text"] for table, row in rows if table == CONTENTS]
    assert "3012345678" not in stored[0]


class _Counting:
    """A redactor that counts its calls, to see where (and when) redaction runs."""

    def __init__(self, inner: Redactor) -> None:
        self.inner, self.calls = inner, 0
        self.policy_version, self.key = inner.policy_version, inner.key

    def redact(self, text: str, *, lenient: bool) -> Any:
        self.calls += 1
        return self.inner.redact(text, lenient=lenient)


def test_kept_text_is_redacted_after_the_response_not_on_its_path(redactor: Redactor) -> None:
    """Content kept (and the model seeing the prompt as sent): nothing is redacted while
    the request runs; one job per text goes to `later` and makes, when run, the rows the
    immediate path makes, under the request's id. A prompt the model must see redacted is
    redacted at once."""
    counting = _Counting(redactor)
    jobs: list[tuple[Any, str | None]] = []
    recorded: list[tuple[str, dict[str, Any]]] = []
    privacy = RequestPrivacy(counting, keep_content=True,  # type: ignore[arg-type]
                             record=lambda table, row: recorded.append((table, row)),
                             later=lambda job, *, request_id=None: jobs.append(
                                 (job, request_id)))
    token = access_var.set({"id": "req-1"})
    try:
        req = GenerationRequest(model="m", messages=[{"role": "user",
                                                      "content": "mail a@example.com"}])
        assert privacy.redact_prompt(req, None) is req
        privacy.keep_answer("Call 49 3012345678 now.")
    finally:
        access_var.reset(token)
    assert counting.calls == 0 and recorded == [] and len(jobs) == 2
    rows = [row for job, request_id in jobs for row in job()]
    assert {request_id for _, request_id in jobs} == {"req-1"}
    assert counting.calls == 2
    assert {row["request_id"] for _, row in rows} == {"req-1"}
    assert [(row["direction"], row["text"]) for table, row in rows if table == CONTENTS] == [
        ("prompt", "mail <EMAIL>"), ("response", "Call <PHONE> now.")]
    assert sorted(row["entity_type"] for table, row in rows if table == REDACTIONS) == \
        ["EMAIL", "PHONE"]
    hiding = TenantContext("t", TenantPolicy(redact_prompt=True))
    seen = privacy.redact_prompt(req, hiding)
    assert seen.messages == [{"role": "user", "content": "mail <EMAIL>"}]
    assert counting.calls == 3 and len(jobs) == 2 and len(recorded) == 2  # span + content


async def _endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    note(model=EMAIL_MODEL, dialect="ollama", error_type="not_found_error")
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_the_access_line_and_the_ledger_row_carry_no_raw_identifier(
        meta: MetadataRedactor, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    rows: list[dict[str, Any]] = []
    app = RequestContext(_endpoint, record=rows.append, scrub=meta)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/api/generate", headers={"X-Request-Id": SSN_ID})

    response = asyncio.run(call())
    (row,) = rows
    assert row["trace_id"].startswith("redacted-") and row["model"] == "<EMAIL>"
    assert response.headers["x-request-id"] == row["trace_id"]  # the id as stored
    (line,) = [r for r in caplog.records if r.name == "edge_agent.access"]
    for value in RAW:
        assert value not in json.dumps(row) and value not in str(line.__dict__)


@pytest.mark.integration
def test_a_live_request_stores_no_raw_identifier(live_server: LiveServer,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    base = live_server.base_url
    ids = {"/api/generate": f"{SSN_ID}-a", "/v1/chat/completions": f"{SSN_ID}-b"}
    bodies = {"/api/generate": {"model": EMAIL_MODEL, "prompt": "hi"},
              "/v1/chat/completions": {"model": EMAIL_MODEL,
                                       "messages": [{"role": "user", "content": "hi"}]}}
    echoed = []
    for path, trace in ids.items():
        r = httpx.post(f"{base}{path}", headers={"X-Request-Id": trace}, json=bodies[path],
                       timeout=60)
        assert r.status_code in (400, 404)  # the name rule may refuse it first
        echoed.append(r.headers["x-request-id"])
    # The row is recorded after the last byte is sent: it may trail the response a little.
    deadline = time.monotonic() + 10
    while True:
        assert live_server.app.state.parts.ledger.flush()
        db = sqlite3.connect(live_server.settings.state_dir / "ledger.db")
        stored = dict(db.execute(f"SELECT trace_id, model FROM requests WHERE trace_id IN "
                                 f"({', '.join('?' * len(echoed))})", echoed).fetchall())
        db.close()
        if len(stored) == len(echoed) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # A name refused by the name rule (400) is not recorded at all; one looked up is redacted.
    assert sorted(stored) == sorted(echoed) and set(stored.values()) <= {"<EMAIL>", None}
    raw = b"".join(p.read_bytes() for p in live_server.settings.state_dir.glob("ledger.db*"))
    for value in ("078-05-1120", "jane.doe@example.com"):  # the state is shared: no "example.com"
        assert value.encode() not in raw
        assert all(value not in str(rec.__dict__) for rec in caplog.records
                   if rec.name == "edge_agent.access")
