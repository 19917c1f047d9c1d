"""What OpenAI client libraries send and match on: context-overflow wording, harmless new
parameters and nulls, the prompt-cache hint, and streams that always end cleanly."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from typing import Any, cast

import httpx
import openai
import pytest

from edge_agent.engine.request import SamplingParams
from edge_agent.engine.scheduling.scheduler import GenerationJob, ModelScheduler, _Slot
from tests.conftest import DEFAULT_MODEL, LiveServer

HELLO = [{"role": "user", "content": "Say hello."}]
LONG = [{"role": "user", "content": "word " * 3000}]  # > 2048 tokens


@pytest.fixture
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.openai_url, api_key="unused", max_retries=0)


def _refused(client: openai.OpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as err:
        client.post(path, body={"model": DEFAULT_MODEL, **body}, cast_to=object)
    assert isinstance(err.value.body, dict)
    return err.value.body


# -- context overflow, in the words clients match on ------------------------------------------

@pytest.mark.integration
def test_context_overflow_is_worded_as_openai_words_it(client: openai.OpenAI) -> None:
    body = _refused(client, "/chat/completions", {"messages": LONG, "max_tokens": 10})
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert re.fullmatch(r"This model's maximum context length is 2048 tokens\. However, your "
                        r"messages resulted in \d+ tokens\. Please reduce the length of the "
                        r"messages\.", body["message"])
    body = _refused(client, "/chat/completions", {"messages": HELLO, "max_tokens": 4000})
    m = re.fullmatch(r"This model's maximum context length is 2048 tokens\. However, you "
                     r"requested (\d+) tokens \((\d+) in the messages, 4000 in the completion\)"
                     r"\. Please reduce the length of the messages or completion\.",
                     body["message"])
    assert m and int(m[1]) == int(m[2]) + 4000 and body["param"] == "max_tokens"
    body = _refused(client, "/completions", {"prompt": "Hi", "max_tokens": 4000})
    m = re.fullmatch(r"This model's maximum context length is 2048 tokens, however you "
                     r"requested (\d+) tokens \((\d+) in your prompt; 4000 for the "
                     r"completion\)\. Please reduce your prompt; or completion length\.",
                     body["message"])
    assert m and int(m[1]) == int(m[2]) + 4000 and body["code"] == "context_length_exceeded"


@pytest.mark.integration
def test_context_overflow_in_the_ollama_dialect_uses_ollamas_phrase(
        live_server: LiveServer) -> None:
    r = httpx.post(f"{live_server.base_url}/api/chat", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": LONG, "stream": False})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error.startswith("the input length exceeds the context length")  # Ollama's words
    assert "exceeds the available context size" in error  # litellm's generic check
    assert "context window is 2048 tokens" in error
    r = httpx.post(f"{live_server.base_url}/api/generate", timeout=60, json={
        "model": DEFAULT_MODEL, "prompt": "Hi", "stream": False,
        "options": {"num_predict": 4000}})
    assert r.status_code == 400
    assert "exceeds the context length" in r.json()["error"]
    assert "options.num_predict" in r.json()["error"]


# -- harmless parameters and nulls ------------------------------------------------------------

def _ledger(live: LiveServer, want: list[str]) -> dict[str, dict[str, Any]]:
    """The rows, once those in `want` are there (a row is queued after the last byte)."""
    deadline = time.monotonic() + 10
    while True:
        assert live.app.state.parts.ledger.flush()
        db = sqlite3.connect(live.settings.state_dir / "ledger.db")
        db.row_factory = sqlite3.Row
        rows = {r["trace_id"]: dict(r) for r in db.execute("SELECT * FROM requests")}
        db.close()
        if all(w in rows for w in want) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


@pytest.mark.integration
def test_safety_identifier_and_user_are_kept_as_a_keyed_digest(
        client: openai.OpenAI, live_server: LiveServer) -> None:
    asks: list[dict[str, Any]] = [
        {"safety_identifier": "shopper-42", "prompt_cache_key": "till-3"},
        {"user": "shopper-42"},
        {"safety_identifier": "shopper-43", "user": "shopper-42"},  # the newer one wins
    ]
    for i, extra in enumerate(asks):
        r = client.chat.completions.create(model=DEFAULT_MODEL, messages=HELLO,  # type: ignore
                                           max_tokens=1, temperature=0,
                                           extra_headers={"X-Request-Id": f"compat-eu-{i}"},
                                           **extra)
        assert r.choices[0].finish_reason in ("stop", "length")
    rows = _ledger(live_server, [f"compat-eu-{i}" for i in range(3)])
    digests = [rows[f"compat-eu-{i}"]["end_user"] for i in range(3)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", d) for d in digests)
    assert digests[0] == digests[1] != digests[2]


@pytest.mark.integration
def test_null_means_the_default_for_nullable_parameters(live_server: LiveServer) -> None:
    nulls = dict.fromkeys([
        "stream", "stream_options", "n", "temperature", "top_p", "stop", "seed",
        "presence_penalty", "frequency_penalty", "logit_bias", "user"])
    chat_nulls = dict.fromkeys([
        "max_tokens", "logprobs", "top_logprobs", "metadata", "store", "service_tier",
        "reasoning_effort", "modalities", "audio", "prediction", "prompt_cache_key",
        "safety_identifier", "prompt_cache_retention", "verbosity", "moderation",
        "web_search_options", "tools", "tool_choice", "response_format",
        "parallel_tool_calls"])
    url = live_server.openai_url
    r = httpx.post(f"{url}/chat/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": HELLO, **nulls, **chat_nulls,
        "max_completion_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"  # stream: null is not a stream
    r = httpx.post(f"{url}/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "prompt": "The capital of France is", **nulls,
        "echo": None, "best_of": None, "suffix": None, "logprobs": None, "max_tokens": None})
    assert r.status_code == 200, r.text
    assert 0 < r.json()["usage"]["completion_tokens"] <= 16  # null: the default of 16


@pytest.mark.integration
def test_hints_are_accepted_and_what_cannot_be_honoured_is_refused(
        client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=HELLO, max_tokens=1,  # type: ignore
        prompt_cache_key="till-3", prompt_cache_retention="24h", reasoning_effort="none",
        verbosity="medium", extra_body={"prompt_cache_options": {"mode": "implicit"}})
    assert r.choices[0].message is not None
    for extra, param in [({"verbosity": "low"}, "verbosity"),
                         ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
                         ({"reasoning_effort": "high"}, "reasoning_effort"),
                         ({"service_tier": "flex"}, "service_tier"),
                         ({"web_search_options": {}}, "web_search_options"),
                         ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
                         ({"n": 2}, "n")]:
        body = _refused(client, "/chat/completions", {"messages": HELLO, **extra})
        assert body["param"] == param, extra


def _job(prompt: list[int], key: str | None) -> GenerationJob:
    return GenerationJob(prompt=prompt, params=SamplingParams(), grammar=None, max_tokens=1,
                         stops=[], emit=lambda e: None, cache_key=key)


def test_a_cache_key_prefers_the_sequence_it_used_last() -> None:
    mine, other = _Slot(0), _Slot(1)
    head = list(range(100, 120))  # 20 tokens both sequences share with every prompt below
    mine.tokens, mine.cache_key = [*head, 9, 9, 9, 9], "till-3"
    other.tokens, other.cache_key = [*head, *range(1, 11)], "till-4"
    pick = cast(Any, ModelScheduler._pick_slot)
    # Equal shared prefix (the head): the key's own sequence, though it holds more cells …
    assert pick(None, [mine, other], _job([*head, 7, 8], "till-3")) is mine
    assert pick(None, [mine, other], _job([*head, 7, 8, 7, 8, 7, 8], None)) is mine
    # … but a longer shared prefix still wins: reusing cells beats the hint.
    assert pick(None, [mine, other], _job([*head, *range(1, 11), 5], "till-3")) is other


def test_a_template_s_opening_does_not_take_a_cache_from_an_empty_sequence() -> None:
    """Sharing a few tokens (MIN_COPY_TOKENS or fewer) is no reason to throw away a long
    cache: the prompt goes to the empty sequence, and the tools' cells stay."""
    tools, empty = _Slot(0), _Slot(1)
    tools.tokens = [1, 2, 3, *range(100, 337)]  # a tool call's 240 cells
    pick = cast(Any, ModelScheduler._pick_slot)
    assert pick(None, [tools, empty], _job([1, 2, 3, 50, 51, 52], None)) is empty
    # Sharing more than that, it is reused.
    assert pick(None, [tools, empty], _job([1, 2, 3, *range(100, 110), 7], None)) is tools


# -- streams end with [DONE] or an error event ------------------------------------------------

def _sse(live: LiveServer, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{live.openai_url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("prompts", "code"), [
    (["Hi", ""], None),
    (["Hi", "word " * 3000], "context_length_exceeded"),
    ([[1, 2, 3], [10**9]], None),  # a token id outside the vocabulary
], ids=["empty", "too-long", "bad-token-id"])
def test_a_later_prompt_is_refused_before_anything_is_generated(
        client: openai.OpenAI, live_server: LiveServer, stream: bool,
        prompts: list[Any], code: str | None) -> None:
    """Every prompt of a list is checked before the response starts: a 400 naming the
    prompt, stream or not (no stream opened), and no generation served (the request's
    ledger row is the refusal's, with no tokens generated)."""
    trace = f"compat-later-{len(prompts[1])}-{int(stream)}"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=DEFAULT_MODEL, prompt=prompts, stream=stream,
                                  max_tokens=2, temperature=0,
                                  extra_headers={"X-Request-Id": trace})
    assert isinstance(err.value.body, dict)
    assert err.value.body["param"] == "prompt.1" and err.value.body["code"] == code
    assert err.value.body["type"] == "invalid_request_error"
    row = _ledger(live_server, [trace])[trace]
    assert row["status"] == 400
    assert row["completion_tokens"] is None and row["done_reason"] is None


@pytest.mark.integration
def test_streams_that_succeed_end_with_done(live_server: LiveServer) -> None:
    for path, body in [("/completions", {"prompt": ["Hi", "Bye"]}),
                       ("/chat/completions", {"messages": HELLO})]:
        events = _sse(live_server, path, {"model": DEFAULT_MODEL, "stream": True,
                                          "max_tokens": 2, **body})
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e)
                                              for e in events[:-1])
