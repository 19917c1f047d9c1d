from __future__ import annotations

import json
import string
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from edge_agent.engine.constrained.tool_calls import (
    parse_tool_output,
    tool_call_schema,
    with_tool_messages,
)
from edge_agent.errors import InvalidRequest
from tests.conftest import DEFAULT_MODEL, LiveServer
from tests.support.pace import Pace, measure

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]


def test_required_schema_accepts_only_calls_to_known_tools_with_valid_arguments() -> None:
    schema = tool_call_schema(TOOLS, "required")
    jsonschema.validate({"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hi"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_call": {"name": "add", "arguments": {"a": "x"}}}, schema)


def test_auto_schema_also_allows_a_plain_answer_and_named_choice_narrows() -> None:
    jsonschema.validate({"response": "hi"}, tool_call_schema(TOOLS, "auto"))
    named = tool_call_schema(TOOLS, "add")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_call": {"name": "get_weather",
                                           "arguments": {"city": "Oslo"}}}, named)
    with pytest.raises(InvalidRequest) as err:
        tool_call_schema(TOOLS, "missing")
    assert err.value.param == "tool_choice"


def test_parse_tool_output() -> None:
    content, calls = parse_tool_output('{"tool_call": {"name": "add", "arguments": {"a": 1}}}')
    assert content is None and calls[0].name == "add" and calls[0].arguments == {"a": 1}
    assert calls[0].id.startswith("call_")
    assert parse_tool_output('{"response": "plain"}') == ("plain", ())
    assert parse_tool_output('{"tool_call": {"na') == ("", ())  # never the internal JSON


def test_earlier_tool_turns_are_rewritten_in_the_answer_format() -> None:
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "5", "name": "add"},
    ]
    out = with_tool_messages(messages, "TOOLS", keep_tool_role=False)
    assert out[0] == {"role": "system", "content": "TOOLS"}
    assert json.loads(out[2]["content"]) == {"tool_call": {"name": "add",
                                                            "arguments": {"a": 2, "b": 3}}}
    assert out[3]["role"] == "user" and "tool_response" in out[3]["content"]


# -- generated schemas within the documented subset (docs/api/tools-and-schemas.md), on the model --
# Every string, array and number is bounded, so that a finished answer fits in the tokens
# asked for; unions stay between a value and null (overlapping alternatives have limits of
# their own, tested in test_grammar_limits.py).

_names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=10)
_leaves = st.one_of(
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 500)).map(
        lambda b: {"type": "integer", "minimum": b[0], "maximum": b[0] + b[1]}),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet="abxyz é日", min_size=1, max_size=5), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
    st.integers(0, 99).map(lambda c: {"const": c}),
    st.sampled_from(["date", "time", "date-time", "uuid"]).map(
        lambda f: {"type": "string", "format": f}),
    st.just({"type": "string", "pattern": "^[a-z]{1,6}$"}),
    # A type list only bare: the converter drops keywords beside one (maxLength here).
    st.sampled_from([{"type": ["integer", "null"]}, {"type": ["boolean", "null"]}]),
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        return st.tuples(st.lists(st.sampled_from(sorted(props)), unique=True),
                         st.booleans()).map(lambda r: {
                             "type": "object", "properties": props, "required": r[0],
                             **({"additionalProperties": False} if r[1] else {})})
    return st.dictionaries(_names, children, min_size=1, max_size=4).flatmap(build)


def _nested(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (_object(children)
            | st.tuples(children, st.integers(1, 3)).map(
                lambda c: {"type": "array", "items": c[0], "maxItems": c[1]})
            | children.map(lambda c: {"anyOf": [c, {"type": "null"}]}))


SCHEMAS = _object(st.recursive(_leaves, _nested, max_leaves=5))
_SLOW = settings(max_examples=8, deadline=None, derandomize=True,
                 phases=[Phase.explicit, Phase.generate],  # a shrink would take minutes
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def pace(live_server: LiveServer) -> Pace:
    """The session server's speed, measured once: an answer of up to 512 tokens takes
    minutes on a loaded box, tens of times its time on an idle one."""
    return measure(live_server.base_url)


@pytest.mark.integration
@_SLOW
@given(schema=SCHEMAS, sampling=st.sampled_from([(0.0, 0), (0.8, 1), (1.2, 2)]))
def test_generated_schemas_give_valid_output(live_server: LiveServer, pace: Pace,
                                             schema: dict[str, Any],
                                             sampling: tuple[float, int]) -> None:
    temperature, seed = sampling
    r = httpx.post(f"{live_server.ollama_url}/api/chat", timeout=pace.bound(300, 512), json={
        "model": DEFAULT_MODEL, "stream": False, "format": schema,
        "options": {"temperature": temperature, "seed": seed, "num_predict": 512},
        "messages": [{"role": "user", "content": "Fill in this record: "
                      + ", ".join(schema["properties"])}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["done_reason"] == "stop", (schema, body["message"]["content"])
    jsonschema.validate(json.loads(body["message"]["content"]), schema)


@pytest.mark.integration
@_SLOW
@given(params=SCHEMAS, name=st.sampled_from(["lookup", "book_room", "send"]))
def test_generated_tool_parameters_give_valid_arguments(live_server: LiveServer, pace: Pace,
                                                        params: dict[str, Any],
                                                        name: str) -> None:
    tools = [{"type": "function", "function": {"name": name, "parameters": params}},
             {"type": "function", "function": {"name": "noop", "parameters": {
                 "type": "object", "properties": {}}}}]
    timeout = pace.bound(300, 512)
    r = httpx.post(f"{live_server.openai_url}/chat/completions", timeout=timeout, json={
        "model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 512, "tools": tools,
        "tool_choice": "required",
        "messages": [{"role": "user", "content": f"Call {name} with some "
                      + ", ".join(params["properties"])}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    schema = params if call["name"] == name else tools[1]["function"]["parameters"]
    jsonschema.validate(json.loads(call["arguments"]), schema)
