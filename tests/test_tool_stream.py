"""Tool calls read while they are generated: streamed as OpenAI-style deltas as soon as the
name is known, and never leaked as the internal JSON when the output limit cuts them.

The cuts are made on a server of this module's own with `runtime.structured_close_tokens`
off: by default the budget's last tokens would close most of these calls instead
(tests/test_closing.py), and what is tested here is the answer the limit does cut."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from edge_agent.config import load_settings
from edge_agent.engine.constrained.tool_calls import ToolAnswerReader
from edge_agent.engine.request import ToolCallEvent
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

STORY: Any = {"type": "function", "function": {
    "name": "write_story", "description": "Publish a long story",
    "parameters": {"type": "object", "properties": {"story": {"type": "string"}},
                   "required": ["story"]}}}
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TELL = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]
INTERNAL = ('"tool_call"', '"response"', "{")


def _feed(text: str, step: int) -> tuple[list[str | ToolCallEvent], ToolAnswerReader]:
    reader = ToolAnswerReader()
    out: list[str | ToolCallEvent] = []
    for i in range(0, len(text), step):
        out += reader.feed(text[i:i + step])
    return out, reader


@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_call_is_announced_by_name_then_its_arguments_follow(step: int) -> None:
    text = '{ "tool_call": {"name": "add", "arguments": {"a": 1, "s": "x\\"}{y", "n": [{}]}}}'
    out, reader = _feed(text, step)
    assert all(isinstance(e, ToolCallEvent) for e in out)
    first, rest = out[0], out[1:]
    assert isinstance(first, ToolCallEvent)
    assert (first.name, first.arguments, first.id) == ("add", "", reader.call_id)
    args = "".join(e.arguments for e in rest if isinstance(e, ToolCallEvent))
    assert json.loads(args) == {"a": 1, "s": 'x"}{y', "n": [{}]}
    answer = reader.finish()
    assert answer.complete and answer.content == ""
    assert answer.calls[0].id == reader.call_id and answer.calls[0].arguments["a"] == 1


def test_a_lone_surrogate_in_arguments_cannot_break_the_response() -> None:
    _, reader = _feed('{"tool_call": {"name": "add", "arguments": {"s": "a\\ud800b"}}}', 5)
    args = reader.finish().calls[0].arguments
    assert args == {"s": "a?b"} and json.dumps(args, ensure_ascii=False).encode()


@pytest.mark.parametrize("step", [1, 2, 5])
def test_a_plain_answer_streams_as_text_whole_characters_only(step: int) -> None:
    text = '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"q\\"\\n"}'
    out, reader = _feed(text, step)
    assert "".join(str(e) for e in out) == 'café 😀 "q"\n'
    assert reader.finish().content == 'café 😀 "q"\n'


@pytest.mark.parametrize(("text", "content", "calls", "complete"), [
    ('{"tool_call": {"na', "", 0, False),
    ('{"tool_call": {"name": "add", "arguments": {"a": 1, "b"', "", 0, False),
    ('{"tool_call": {"name": "add", "arguments": {"a": 1}', "", 1, True),  # args closed
    ('{"response": "half an ans', "half an ans", 0, False),
    ('{"response": "cut in \\u00', "cut in ", 0, False),
])
def test_a_cut_answer_keeps_what_completed_and_never_the_json(
        text: str, content: str, calls: int, complete: bool) -> None:
    _, reader = _feed(text, 4)
    answer = reader.finish()
    assert (answer.content, len(answer.calls), answer.complete) == (content, calls, complete)


@pytest.fixture
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.openai_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def cutting(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    """A server that lets the output limit cut a call (closing within the budget off)."""
    state = clone_state(model_cache, tmp_path_factory.mktemp("cutting") / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 2048,
        "runtime.structured_close_tokens": 0}))
    yield live
    live.stop()


def _named(tool: Any) -> Any:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


@pytest.mark.integration
@pytest.mark.parametrize(("tools", "messages", "max_tokens"), [
    ([WEATHER], ASK, 6),  # cut inside the name
    ([STORY], TELL, 24),  # the model rambles inside a string argument
])
def test_openai_cut_tool_call_gives_empty_content_and_length(
        cutting: LiveServer, tools: Any, messages: Any, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=cutting.openai_url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=tools,
                                       tool_choice=_named(tools[0]), temperature=0,
                                       max_tokens=max_tokens)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert choice.message.content in ("", None)


@pytest.mark.integration
def test_openai_streamed_call_arrives_as_deltas_once_the_name_is_known(
        client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=[WEATHER], tool_choice=_named(WEATHER),
        temperature=0, max_tokens=120, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks
              if c.choices and c.choices[0].delta.tool_calls]
    head, rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id and head.id.startswith("call_")
    assert head.type == "function" and head.function
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(rest) >= 2  # piece by piece, not one delta at the end
    assert all(d.index == 0 and d.id is None and d.function and d.function.name is None
               for d in rest)
    args = json.loads("".join(d.function.arguments or "" for d in rest if d.function))
    assert isinstance(args["city"], str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


@pytest.mark.integration
def test_openai_streamed_cut_call_ends_with_length_and_done(cutting: LiveServer) -> None:
    body = {"model": DEFAULT_MODEL, "messages": TELL, "tools": [STORY],
            "tool_choice": _named(STORY), "temperature": 0, "max_tokens": 24, "stream": True}
    with httpx.stream("POST", f"{cutting.openai_url}/chat/completions", json=body,
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
             if c["choices"][0]["delta"].get("tool_calls")]
    assert calls[0]["function"] == {"name": "write_story", "arguments": ""}


@pytest.mark.integration
def test_ollama_cut_call_never_shows_the_internal_json(cutting: LiveServer) -> None:
    client = ollama.Client(host=cutting.ollama_url)
    r = client.chat(model=DEFAULT_MODEL, messages=TELL, tools=[STORY],
                    options={"temperature": 0, "num_predict": 8})
    assert r.done_reason == "length" and not r.message.tool_calls
    assert not any(mark in (r.message.content or "") for mark in INTERNAL)
    chunks = list(client.chat(model=DEFAULT_MODEL, messages=TELL, tools=[STORY], stream=True,
                              options={"temperature": 0, "num_predict": 8}))
    text = "".join(c.message.content or "" for c in chunks)
    assert text == (r.message.content or "")
    assert chunks[-1].done and chunks[-1].done_reason == "length"


@pytest.mark.integration
def test_ollama_keeps_the_whole_call_at_the_end(live_server: LiveServer) -> None:
    client = ollama.Client(host=live_server.ollama_url)
    chunks = list(client.chat(model=DEFAULT_MODEL, messages=ASK, tools=[WEATHER], stream=True,
                              options={"temperature": 0, "num_predict": 120}))
    with_calls = [c for c in chunks if c.message.tool_calls]
    if with_calls:  # Ollama has no forced tool: the model may answer in words instead
        assert len(with_calls) == 1 and not with_calls[0].done
        call = with_calls[0].message.tool_calls[0]  # type: ignore[index]
        assert call.function.name == "get_weather" and "city" in call.function.arguments
    else:
        assert "".join(c.message.content or "" for c in chunks)
    assert chunks[-1].done
