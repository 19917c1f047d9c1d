"""Client-supplied token ids, and bodies that parse as JSON but no later layer can take.

Every case here once reached the engine: a token id past int32 wedged the scheduler, ids
outside the vocabulary failed inside llama_decode, and deep nesting, lone surrogates and
5,000-digit integers were 500s. Each is now a 400 in the dialect's shape, before anything
is queued, and the server generates normally afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from edge_agent.api.body import MAX_JSON_DEPTH, check_values
from edge_agent.engine.prompt import bounded_sampling as _bounded
from edge_agent.engine.request import SamplingParams
from edge_agent.errors import InvalidRequest
from tests.conftest import DEFAULT_MODEL, LiveServer

pytestmark = pytest.mark.integration

M = DEFAULT_MODEL
BIG = 2**63
CHAT = [{"role": "user", "content": "hi"}]


def _post(live: LiveServer, path: str, body: dict[str, Any] | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(live.base_url + path, content=content.encode(),
                      headers={"content-type": "application/json"}, timeout=60)


def _refused(r: httpx.Response, path: str, param: str | None, *words: str) -> None:
    """A 400 in the dialect's own error shape, naming the parameter."""
    assert r.status_code == 400, r.text
    if path.startswith("/v1/"):
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        message = error["message"]
    else:
        message = r.json()["error"]
        assert isinstance(message, str)
        if param:
            assert param in message
    for word in words:
        assert word in message


# -- token ids ---------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [1, 2147483648]}, "prompt"),  # past int32
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [[999999]]}, "prompt"),  # inside int32, past the vocab
    ("/v1/completions", {"prompt": [49152]}, "prompt"),  # the first id past SmolLM2's vocab
    ("/api/generate", {"prompt": "hi", "context": [1, 999999], "stream": False}, "context"),
    ("/api/generate", {"prompt": "hi", "context": [2**40], "stream": False}, "context"),
    ("/api/generate", {"context": [-5], "stream": False}, "context"),
])
def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(
        live_server: LiveServer, path: str, body: dict[str, Any], param: str) -> None:
    r = _post(live_server, path, {"model": M, **body, "max_tokens": 2} if path.startswith("/v1")
              else {"model": M, **body, "options": {"num_predict": 2}})
    _refused(r, path, param, "vocabulary", "0 to 49151")


def test_an_id_past_int32_leaves_the_scheduler_working(live_server: LiveServer) -> None:
    """It used to fail inside every scheduler step, forever, for every request."""
    r = _post(live_server, "/v1/completions", {"model": M, "prompt": [1, 2**31],
                                               "max_tokens": 2})
    assert r.status_code == 400
    r = _post(live_server, "/v1/completions", {"model": M, "prompt": [1, 49151, 0],
                                               "max_tokens": 1})
    assert r.status_code == 200, r.text  # ids at the vocabulary's edges are fine
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = _post(live_server, "/api/generate", {"model": M, "prompt": " and", "stream": False,
                                             "context": [1, 2, 3],
                                             "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["context"][:3] == [1, 2, 3]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 2}, "prompt"),
    ("/api/generate", {"prompt": "hi", "context": [1] * 5000, "stream": False}, "context"),
])
def test_a_token_list_longer_than_the_context_is_context_length_exceeded(
        live_server: LiveServer, path: str, body: dict[str, Any], param: str) -> None:
    r = _post(live_server, path, {"model": M, **body})
    _refused(r, path, param, "5000 tokens", "2048")
    if path.startswith("/v1/"):
        assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("key", [str(2**31), "999999", "-5", str(BIG - 1)])
def test_logit_bias_ids_outside_the_vocabulary_are_refused(live_server: LiveServer,
                                                           key: str) -> None:
    r = _post(live_server, "/v1/chat/completions",
              {"model": M, "messages": CHAT, "max_tokens": 1, "logit_bias": {key: 5}})
    _refused(r, "/v1/chat/completions", "logit_bias", "vocabulary")


def test_sampler_settings_are_bounded_to_what_llama_cpp_can_take() -> None:
    """repeat_last_n is a buffer llama.cpp allocates per request (2^28 took 1 GB); -1 is
    Ollama's "the whole context", which llama.cpp would read as "off"."""
    s = _bounded(SamplingParams(repeat_last_n=2**30, top_k=2**40), n_vocab=49152, window=2048)
    assert (s.repeat_last_n, s.top_k) == (2048, 49152)
    assert _bounded(SamplingParams(repeat_last_n=-1), 49152, 2048).repeat_last_n == 2048
    assert _bounded(SamplingParams(repeat_last_n=64, top_k=40), 49152, 2048) == \
        SamplingParams(repeat_last_n=64, top_k=40)
    with pytest.raises(InvalidRequest) as err:
        _bounded(SamplingParams(logit_bias=((49152, 1.0),)), 49152, 2048)
    assert err.value.param == "logit_bias"


def test_bounded_sampler_settings_generate(live_server: LiveServer) -> None:
    r = _post(live_server, "/api/generate", {
        "model": M, "prompt": "hi", "stream": False,
        "options": {"num_predict": 2, "repeat_last_n": -1, "top_k": 2**40}})
    assert r.status_code == 200, r.text


# -- nesting -----------------------------------------------------------------------------

def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_json_nested_a_thousand_deep_is_a_client_error(live_server: LiveServer,
                                                       path: str) -> None:
    r = _post(live_server, path, '{"model": "x", "messages": ' + _nested(1000) + "}")
    _refused(r, path, None, f"deeper than {MAX_JSON_DEPTH}")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_parseable_nesting_past_the_limit_is_refused_naming_the_field(
        live_server: LiveServer, path: str) -> None:
    schema = '{"a":' * 200 + "1" + "}" * 200
    tools = ('[{"type": "function", "function": {"name": "f", "parameters": ' + schema
             + "}}]")
    r = _post(live_server, path, f'{{"model": "{M}", "messages": {json.dumps(CHAT)}, '
              f'"tools": {tools}}}')
    _refused(r, path, "tools", f"deeper than {MAX_JSON_DEPTH}")


def test_the_depth_limit_is_exact() -> None:
    def nest(levels: int) -> dict[str, Any]:
        value: Any = 1
        for _ in range(levels - 1):
            value = [value]
        return {"x": value}  # the body itself is level 1
    check_values(nest(MAX_JSON_DEPTH))
    with pytest.raises(InvalidRequest, match="deeper than"):
        check_values(nest(MAX_JSON_DEPTH + 1))


# -- lone surrogates -----------------------------------------------------------------------

SURROGATE_CASES = [
    ("/v1/chat/completions",
     f'{{"model": "{M}", "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}',
     "messages.0.content"),
    ("/api/chat",
     f'{{"model": "{M}", "messages": [{{"role": "user", "content": "\\udfff"}}]}}',
     "messages.0.content"),
    ("/v1/completions", f'{{"model": "{M}", "prompt": "x\\udc00"}}', "prompt"),
    ("/v1/completions", f'{{"model": "{M}", "prompt": ["ok", "\\ud800"]}}', "prompt.1"),
    ("/api/generate", f'{{"model": "{M}", "prompt": "\\udc00", "stream": false}}', "prompt"),
    ("/api/generate", f'{{"model": "{M}", "prompt": "x", "system": "\\ud800"}}', "system"),
    ("/v1/embeddings", f'{{"model": "{M}", "input": "\\ud800"}}', "input"),
    ("/api/embed", f'{{"model": "{M}", "input": ["a", "\\ud800"]}}', "input.1"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": []}', "model"),
    ("/api/chat", '{"model": "sm\\ud800", "messages": []}', "model"),
    ("/api/show", '{"model": "\\ud800"}', "model"),
    ("/v1/chat/completions",
     f'{{"model": "{M}", "stop": ["\\ud800"], "messages": {json.dumps(CHAT)}}}', "stop.0"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES)
def test_lone_surrogates_are_a_client_error_naming_the_field(
        live_server: LiveServer, path: str, body: str, param: str) -> None:
    _refused(_post(live_server, path, body), path, param, "lone surrogate")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_lone_surrogate_in_a_key_is_a_client_error(live_server: LiveServer,
                                                     path: str) -> None:
    r = _post(live_server, path, f'{{"model": "{M}", "\\ud800": 1, "messages": []}}')
    _refused(r, path, None, "lone surrogate", "a key")


def test_escaped_surrogate_pairs_are_ordinary_text(live_server: LiveServer) -> None:
    r = _post(live_server, "/v1/chat/completions",
              f'{{"model": "{M}", "max_tokens": 1, '
              f'"messages": [{{"role": "user", "content": "\\ud83d\\ude00"}}]}}')
    assert r.status_code == 200, r.text


# -- numbers -------------------------------------------------------------------------------

NUMBER_CASES = [
    ("/v1/chat/completions", '"seed": 9223372036854775808', "seed", "64 bits"),
    ("/v1/chat/completions", '"seed": -9223372036854775809', "seed", "64 bits"),
    ("/v1/chat/completions", '"top_k": 9223372036854775808', "top_k", "64 bits"),
    ("/v1/chat/completions", '"max_tokens": 18446744073709551616', "max_tokens", "64 bits"),
    ("/v1/chat/completions", '"temperature": NaN', None, "NaN"),
    ("/v1/chat/completions", '"seed": ' + "9" * 5000, None, "5000 digits"),
    ("/api/chat", '"options": {"seed": 9223372036854775808}', "options.seed", "64 bits"),
    ("/api/chat", '"options": {"top_k": 9223372036854775808}', "options.top_k", "64 bits"),
    ("/api/chat", '"options": {"num_predict": 9223372036854775808}', "options.num_predict",
     "64 bits"),
    ("/api/chat", '"options": {"presence_penalty": 1e400}', "options.presence_penalty",
     "finite"),
    ("/api/chat", '"options": {"temperature": Infinity}', None, "Infinity"),
]


@pytest.mark.parametrize(("path", "field", "param", "word"), NUMBER_CASES)
def test_numbers_no_layer_can_take_are_client_errors(
        live_server: LiveServer, path: str, field: str, param: str | None, word: str) -> None:
    body = f'{{"model": "{M}", "messages": {json.dumps(CHAT)}, {field}}}'
    _refused(_post(live_server, path, body), path, param, word)


@pytest.mark.parametrize("value", ["²", "9" * 5000, "0", "-5"])
def test_timeout_header_takes_ascii_digits_only(live_server: LiveServer, value: str) -> None:
    """int() takes "²" (a Latin-1 header byte) and refuses 5,000 digits: both were 500s."""
    r = httpx.post(f"{live_server.base_url}/api/chat", json={"model": M, "messages": CHAT},
                   headers={"X-Timeout-Ms": value.encode("latin-1")}, timeout=60)
    _refused(r, "/api/chat", "X-Timeout-Ms", "whole number")
