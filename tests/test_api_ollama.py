"""The Ollama dialect, driven by the official `ollama` client against a live server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.conftest import DEFAULT_MODEL, LiveServer

pytestmark = pytest.mark.integration
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture
def client(live_server: LiveServer) -> ollama.Client:
    return ollama.Client(host=live_server.ollama_url)


def test_chat_streams_and_reports_ollama_stats(client: ollama.Client) -> None:
    chunks = list(client.chat(model=DEFAULT_MODEL, stream=True, options=GREEDY,
                              messages=[{"role": "user", "content": "Say hello."}]))
    assert len(chunks) > 2
    assert all(not c.done for c in chunks[:-1])
    final = chunks[-1]
    assert final.done and final.done_reason in ("stop", "length")
    text = "".join(c.message.content or "" for c in chunks)
    assert text.strip()
    assert final.eval_count and 0 < final.eval_count <= 24
    assert final.prompt_eval_count and final.prompt_eval_count > 0
    assert final.total_duration and final.eval_duration and final.prompt_eval_duration
    assert final.total_duration >= final.eval_duration  # nanoseconds, as Ollama
    # The same request, not streamed, gives the same greedy text.
    whole = client.chat(model=DEFAULT_MODEL, stream=False, options=GREEDY,
                        messages=[{"role": "user", "content": "Say hello."}])
    assert whole.message.content == text
    assert whole.eval_count == final.eval_count


def test_generate_stream_and_context(client: ollama.Client) -> None:
    chunks = list(client.generate(model=DEFAULT_MODEL, prompt="The capital of France is",
                                  raw=True, stream=True, options=GREEDY))
    text = "".join(c.response for c in chunks)
    assert "Paris" in text
    final = chunks[-1]
    assert final.done and final.context and len(final.context) == (
        final.prompt_eval_count + final.eval_count)
    whole = client.generate(model=DEFAULT_MODEL, prompt="The capital of France is", raw=True,
                            options=GREEDY)
    assert whole.response == text


def test_generate_with_system_prompt_uses_the_template(client: ollama.Client) -> None:
    r = client.generate(model=DEFAULT_MODEL, prompt="What is 2+2?", system="Answer in digits.",
                        options=GREEDY)
    assert r.done and r.response.strip()


def test_stop_option_ends_the_text(client: ollama.Client) -> None:
    r = client.generate(model=DEFAULT_MODEL, prompt="1, 2, 3, 4, 5,", raw=True,
                        options={"temperature": 0, "num_predict": 40, "stop": ["8"]})
    assert r.done_reason == "stop"
    assert "8" not in r.response and "7" in r.response


def test_format_schema_output_validates(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer"}}, "required": ["city", "population"]}
    r = client.chat(model=DEFAULT_MODEL, format=schema, options={"temperature": 0,
                                                                 "num_predict": 80},
                    messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    r = client.generate(model=DEFAULT_MODEL, prompt="Give me a JSON object about a cat.",
                        format="json", options={"temperature": 0, "num_predict": 80})
    assert isinstance(json.loads(r.response), dict)


def test_tools_give_calls_with_valid_arguments(client: ollama.Client) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "description": "Current weather in a city",
                                               "parameters": params}}]
    r = client.chat(model=DEFAULT_MODEL, tools=tools, options={"temperature": 0,
                                                               "num_predict": 100},
                    messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if r.message.tool_calls:
        call = r.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), params)
    else:
        assert r.message.content  # "auto": the model may answer instead
    chunks = list(client.chat(model=DEFAULT_MODEL, tools=tools, stream=True,
                              options={"temperature": 0, "num_predict": 100},
                              messages=[{"role": "user", "content": "Weather in Oslo?"}]))
    assert chunks[-1].done


def test_embed_and_legacy_embeddings(client: ollama.Client) -> None:
    r = client.embed(model=DEFAULT_MODEL, input=["hello world", "goodbye"])
    assert len(r.embeddings) == 2 and all(len(v) == 576 for v in r.embeddings)
    norm = sum(x * x for x in r.embeddings[0]) ** 0.5
    assert abs(norm - 1.0) < 1e-3
    assert r.embeddings[0] != r.embeddings[1]
    legacy = client.embeddings(model=DEFAULT_MODEL, prompt="hello world")
    assert len(legacy.embedding) == 576
    assert pytest.approx(legacy.embedding, abs=1e-5) == r.embeddings[0]
    short = client.embed(model=DEFAULT_MODEL, input="hello", dimensions=64)
    assert len(short.embeddings[0]) == 64


def test_listing_endpoints(client: ollama.Client, live_server: LiveServer) -> None:
    tags = client.list()
    assert DEFAULT_MODEL in [m.model for m in tags.models]
    entry = next(m for m in tags.models if m.model == DEFAULT_MODEL)
    assert entry.details and entry.details.quantization_level == "Q4_1"
    assert entry.digest and entry.digest.startswith("b179c952")
    show = client.show(DEFAULT_MODEL)
    assert show.template and "<|im_start|>" in show.template
    assert show.modelinfo and show.modelinfo["llama.context_length"] == 8192
    assert show.capabilities and "completion" in show.capabilities
    ps = client.ps()
    loaded = next(m for m in ps.models if m.model == DEFAULT_MODEL)
    assert loaded.size and loaded.size > 50_000_000 and loaded.context_length == 2048
    assert loaded.expires_at is not None
    assert httpx.get(f"{live_server.base_url}/api/version").json()["version"]
    assert httpx.get(live_server.base_url).status_code == 200
    assert httpx.head(live_server.base_url).status_code == 200


def test_unknown_model_is_404(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="nope:1b", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404
    assert "nope:1b" in err.value.error


def _post(live: LiveServer, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{live.base_url}{path}", timeout=60, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": DEFAULT_MODEL, "prompt": "x", "options": {"mirostat": 2}}, "mirostat"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "options": {"num_gpu": 1}}, "num_gpu"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "options": {"bogus": 1}}, "options.bogus"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "options": {"temperature": "hot"}},
     "options.temperature"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "suffix": "y"}, "does not support insert"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "think": True}, "does not support thinking"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "images": ["aGk="]}, "images"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "format": "yaml"}, "format"),
    ({"model": DEFAULT_MODEL, "prompt": "x", "keep_alive": "soon"}, "keep_alive"),
    ({"prompt": "x"}, "model"),
])
def test_bad_requests_get_400_in_ollama_shape(live_server: LiveServer, body: dict[str, object],
                                              needle: str) -> None:
    r = _post(live_server, "/api/generate", json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and needle in r.json()["error"]


def test_malformed_and_oversized_bodies(live_server: LiveServer) -> None:
    r = _post(live_server, "/api/chat", content=b'{"model": ', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = _post(live_server, "/api/chat", json=["not", "an", "object"])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    big = "x" * (live_server.settings.server.max_body_bytes + 1)
    r = _post(live_server, "/api/chat", json={"model": DEFAULT_MODEL, "messages": [
        {"role": "user", "content": big}]})
    assert r.status_code == 413 and set(r.json()) == {"error"}


def test_context_overflow_is_refused_not_truncated(live_server: LiveServer) -> None:
    long_prompt = "word " * 3000  # > 2048 tokens
    r = _post(live_server, "/api/generate", json={"model": DEFAULT_MODEL, "prompt": long_prompt,
                                                  "raw": True, "stream": False})
    assert r.status_code == 400
    assert "context window is 2048" in r.json()["error"]


def test_delete_unknown_model_is_404(live_server: LiveServer) -> None:
    r = httpx.request("DELETE", f"{live_server.base_url}/api/delete", json={"model": "nope:1"})
    assert r.status_code == 404 and set(r.json()) == {"error"}


@pytest.mark.integration
def test_embed_with_no_input_is_an_empty_answer(live_server: LiveServer) -> None:
    r = httpx.post(f"{live_server.base_url}/api/embed",
                   json={"model": DEFAULT_MODEL, "input": [], "dimensions": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["embeddings"] == []
    missing = httpx.post(f"{live_server.base_url}/api/embed",
                         json={"model": "nope:1", "input": []}, timeout=60)
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
