"""A JSON answer closed within its max_tokens (`engine.constrained.closing`): which tokens
close where, and, on a live server with the real model, an answer that would be cut at
`length` ends whole with `stop`, valid for its schema, counted and in the ledger, while a
server with the setting off cuts it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from edge_agent.config import load_settings
from edge_agent.engine.constrained.closing import ClosingTokens, JsonLexer
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server


def test_the_lexer_knows_when_the_text_ends_inside_a_string() -> None:
    lexer = JsonLexer()
    for piece, inside in [(b'{"no', True), (b'te": ', False), (b'"say \\"', True),
                          (b'hi\\', True), (b'\\', True), (b'"', False), (b', "k": "\xc3', True),
                          (b'\xa9 }', True), (b'"}', False)]:
        lexer.feed(piece)
        assert lexer.in_string is inside, piece


def test_closing_tokens_end_what_is_open_and_nothing_else() -> None:
    pieces = [b'"', b'"}', b'" ]}', b'}', b' }\n', b']}', b'",', b'x', b'},{', b' ', b'<eos>',
              b'', b'{', b'":']
    eog = [p == b"<eos>" for p in pieces]
    closers = ClosingTokens(pieces, eog)
    inside, outside = JsonLexer(), JsonLexer()
    inside.feed(b'{"a": "text')
    outside.feed(b'{"a": 1')
    # What is chosen for closing: nothing after the closers but closers and whitespace.
    assert {pieces[t] for t in closers.in_string_ids} == {b'"', b'"}', b'" ]}', b"<eos>"}
    assert {pieces[t] for t in closers.outside_ids} == {b"}", b" }\n", b"]}", b"<eos>"}
    # The model's own choice stands when it ends what is open and starts nothing new.
    assert {pieces[t] for t in range(len(pieces)) if closers.closes(t, inside)} == {
        b'"', b'"}', b'" ]}', b'":', b"<eos>"}
    assert {pieces[t] for t in range(len(pieces)) if closers.closes(t, outside)} == {
        b"}", b" }\n", b"]}", b"<eos>"}


# -- on a live server ------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
ASK = [{"role": "user", "content": "Tell me a long story about a dragon and a knight. "
                                   "Answer as JSON."}]
MAX_TOKENS = 14  # the model's story runs on well past it


def _server(model_cache: Path, where: Path, close_tokens: int) -> LiveServer:
    state = clone_state(model_cache, where / "state")
    return start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 1024, "runtime.parallel": 1,
        "runtime.structured_close_tokens": close_tokens}))


@pytest.fixture(scope="module")
def closing(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    live = _server(model_cache, tmp_path_factory.mktemp("closing"), 48)
    yield live
    live.stop()


def _ask(live: LiveServer, request_id: str) -> Any:
    client = openai.OpenAI(base_url=live.openai_url, api_key="unused", max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "story", "schema": SCHEMA}},
        extra_headers={"X-Request-Id": request_id})


def _closed_count(live: LiveServer) -> float:
    for line in httpx.get(f"{live.base_url}/metrics").text.splitlines():
        if line.startswith(f'edge_agent_structured_closed_total{{model="{DEFAULT_MODEL}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.integration
def test_an_answer_that_would_be_cut_ends_whole_within_its_budget(
        closing: LiveServer, model_cache: Path, tmp_path: Path) -> None:
    before = _closed_count(closing)  # the module's other test closes one too
    raw = _ask(closing, "closing-on")
    assert raw.headers["x-edge-closed"] == "max_tokens"
    answer = raw.parse()
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    assert answer.usage.completion_tokens <= MAX_TOKENS
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert _closed_count(closing) == before + 1
    row = closing.ledger_row("closing-on")
    assert row["done_reason"] == "closed" and row["structured_failure"] == 0

    # The same request on a box with closing off runs into the limit: not a document.
    off = _server(model_cache, tmp_path, 0)
    try:
        raw_cut = _ask(off, "closing-off")
    finally:
        off.stop()
    assert "x-edge-closed" not in raw_cut.headers
    cut = raw_cut.parse()
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == MAX_TOKENS
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)
    # What closing changed is only the end: the two answers share their beginning.
    whole = choice.message.content
    assert cut.choices[0].message.content[:len(whole) // 2] == whole[:len(whole) // 2]


@pytest.mark.integration
def test_the_ollama_dialect_closes_the_same_answer(closing: LiveServer) -> None:
    r = httpx.post(f"{closing.base_url}/api/chat", timeout=120, json={
        "model": DEFAULT_MODEL, "messages": ASK, "format": SCHEMA, "stream": False,
        "options": {"temperature": 0, "num_predict": MAX_TOKENS}})
    assert r.status_code == 200 and r.headers["x-edge-closed"] == "max_tokens"
    assert r.json()["done_reason"] == "stop"
    jsonschema.validate(json.loads(r.json()["message"]["content"]), SCHEMA)
