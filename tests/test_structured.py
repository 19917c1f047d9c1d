from __future__ import annotations

import json

import jsonschema
import pytest

from edge_agent.engine.structured import (
    parse_tool_output,
    tool_call_schema,
    with_tool_messages,
)
from edge_agent.errors import InvalidRequest

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
