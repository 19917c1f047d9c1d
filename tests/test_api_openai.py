"""The OpenAI dialect, driven by the official `openai` client against a live server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import (
    DEFAULT_MODEL,
    NO_EOS,
    LiveServer,
    clone_state,
    free_port,
    load_settings,
    start_server,
)
from tests.support.pace import Pace

pytestmark = pytest.mark.integration
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.openai_url, api_key="unused", max_retries=0)


def test_chat_non_streamed_has_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=HELLO,  # type: ignore
                                       max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.model == DEFAULT_MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage and r.usage.completion_tokens <= 20 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streams_with_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=HELLO, max_completion_tokens=20,  # type: ignore
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage
    assert usage_chunk.usage.completion_tokens > 0
    same = client.chat.completions.create(model=DEFAULT_MODEL, messages=HELLO,  # type: ignore
                                          max_tokens=20, temperature=0)
    assert same.choices[0].message.content == text


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is",
                                  max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].text and r.usage and r.usage.completion_tokens <= 12
    chunks = list(client.completions.create(model=DEFAULT_MODEL,
                                            prompt="The capital of France is",
                                            max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    two = client.completions.create(model=DEFAULT_MODEL, prompt=["Hello", "Goodbye"],
                                    max_tokens=4, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    echo = client.completions.create(model=DEFAULT_MODEL, prompt="Once", max_tokens=3,
                                     temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Once")


def test_stop_sequences_end_the_text(client: openai.OpenAI) -> None:
    r = client.completions.create(model=DEFAULT_MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=40,
                                  temperature=0, stop=["8", "nine"])
    assert r.choices[0].finish_reason == "stop"
    assert "7" in r.choices[0].text and "8" not in r.choices[0].text


def test_multibyte_utf8_streams_intact(client: openai.OpenAI) -> None:
    prompt = "日本の首都は東京です。中国の首都は"
    whole = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=30,
                                      temperature=0)
    text = whole.choices[0].text
    assert any(ord(ch) > 0x2FFF for ch in text), text  # the model really answered in CJK
    assert "\ufffd" not in text
    pieces = [c.choices[0].text for c in client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    emoji = client.chat.completions.create(
        model=DEFAULT_MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": "Reply with three party emoji: 🎉🎉🎉"}])
    assert "\ufffd" not in (emoji.choices[0].message.content or "")


def test_json_schema_response_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=DEFAULT_MODEL, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    r = client.chat.completions.create(
        model=DEFAULT_MODEL, temperature=0, max_tokens=400,
        messages=[{"role": "user", "content": "Give the name and age of a dog as JSON."}],
        response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD: Any = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_tool_calls_have_valid_json_arguments(client: openai.OpenAI, choice: Any) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK,  # type: ignore
                                       tools=[WEATHER, ADD], tool_choice=choice,
                                       temperature=0, max_tokens=120)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls"
    calls = choice0.message.tool_calls
    assert calls and calls[0].type == "function"
    fn = calls[0].function  # type: ignore[union-attr]
    tool = {"get_weather": WEATHER, "add": ADD}[fn.name]
    jsonschema.validate(json.loads(fn.arguments), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert fn.name == "get_weather"


def test_tool_calls_stream_and_a_tool_result_round_trip(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore
        temperature=0, max_tokens=120, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and
              c.choices[0].delta.tool_calls]
    assert deltas and deltas[0][0].function and deltas[0][0].function.name == "get_weather"
    args = json.loads("".join(d[0].function.arguments or "" for d in deltas
                              if d[0].function))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = client.chat.completions.create(
        model=DEFAULT_MODEL, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30,
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": deltas[0][0].id or "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": deltas[0][0].id or "c1",
             "content": '{"temperature": 18}'}])  # type: ignore
    assert follow.choices[0].message.content
    assert not follow.choices[0].message.tool_calls


def test_auto_tool_choice_answers_or_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK,  # type: ignore
                                       tools=[WEATHER], temperature=0, max_tokens=120)
    msg = r.choices[0].message
    if msg.tool_calls:
        jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments),  # type: ignore
                            WEATHER["function"]["parameters"])
    else:
        assert msg.content and not msg.content.startswith('{"response"')


def test_embeddings_float_and_base64(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model=DEFAULT_MODEL, input=["hello world", "bye"])
    assert [d.index for d in r.data] == [0, 1]
    assert all(len(d.embedding) == 576 for d in r.data)
    assert r.usage.prompt_tokens > 0
    raw = client.embeddings.create(model=DEFAULT_MODEL, input="hello world",
                                   encoding_format="float")
    assert pytest.approx(raw.data[0].embedding, abs=1e-5) == r.data[0].embedding


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert DEFAULT_MODEL in ids
    assert client.models.retrieve(DEFAULT_MODEL).id == DEFAULT_MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope:1b")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_unknown_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope:1b", messages=HELLO)  # type: ignore
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "model"
    assert "nope:1b" in body["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"made_up": 1}, "made_up"),
    ({"temperature": "hot"}, "temperature"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages.0.content.0"),
])
def test_unsupported_or_invalid_parameters_name_the_param(client: openai.OpenAI,
                                                          extra: dict[str, Any],
                                                          param: str) -> None:
    body: dict[str, Any] = {"model": DEFAULT_MODEL, "messages": HELLO, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/chat/completions", body=body, cast_to=object)
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body["param"] == param


def test_no_op_values_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=HELLO,  # type: ignore
                                       n=1, logprobs=False, max_tokens=4, user="till-3",
                                       parallel_tool_calls=True, seed=7)
    assert r.choices[0].message.content is not None


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=10,
                                       messages=[{"role": "user", "content": "word " * 3000}])
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert "2048" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=HELLO, max_tokens=4000)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "max_tokens"


def test_malformed_and_oversized_bodies_in_openai_shape(live_server: LiveServer) -> None:
    url = f"{live_server.openai_url}/chat/completions"
    r = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": DEFAULT_MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    big = "x" * (live_server.settings.server.max_body_bytes + 1)
    r = httpx.post(url, json={"model": DEFAULT_MODEL, "messages": [
        {"role": "user", "content": big}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{live_server.openai_url}/nothing-here")
    assert r.status_code == 404 and "error" in r.json() and "message" in r.json()["error"]


@pytest.fixture(scope="module")
def idle_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[LiveServer]:
    """A server of its own for the test that counts the worker's running jobs: on the
    session's server another test's stream may still be ending."""
    state = clone_state(model_cache, tmp_path_factory.mktemp("idle") / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 2048}))
    yield live
    live.stop()


def test_a_client_that_disconnects_stops_its_generation(idle_server: LiveServer) -> None:
    live_server = idle_server
    registry = live_server.app.state.parts.registry
    worker = next(m for m in registry.loaded() if m.info.name == DEFAULT_MODEL).worker
    # Greedy, and no end-of-generation token can be drawn: the answer runs to max_tokens
    # the same way every time, so only the disconnect can end it early.
    body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": 1500, "temperature": 0,
            "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    began = time.monotonic()
    arrivals: list[float] = []
    with httpx.stream("POST", f"{live_server.openai_url}/chat/completions", json=body,
                      timeout=60) as r:
        seen = []
        lines = r.iter_lines()  # one iterator: httpx streams a response once
        for line in lines:
            seen.append(line)
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 4:
                    break  # generation is under way, at a pace these tokens measure
        if worker.running != 1:  # say how it ended, to tell a lost job from a stray one
            running = worker.running
            rest = list(lines)
            loaded = [(m.info.name, m.info.digest[:12], m.worker is worker)
                      for m in registry.loaded()]
            pytest.fail(f"the generation was not running ({running}): {worker.stats}, "
                        f"loaded (name, digest, this worker) {loaded}, "
                        f"stream {seen[-2:]} … {rest[-4:]}")
    # A cancelled job ends within a few steps: 3 s on an idle box, and as many steps at the
    # pace just measured on a loaded one (tens of times slower). The 1,500 tokens would
    # take 15 times as long as that, however slow the box.
    deadline = time.monotonic() + Pace.of(began, arrivals).bound(3, tokens=5, requests=0)
    while worker.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.running == 0
    model = next(m for m in registry.loaded() if m.info.name == DEFAULT_MODEL)
    assert model.in_use == 0
