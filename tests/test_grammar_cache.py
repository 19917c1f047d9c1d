"""A request's grammar is compiled once per schema (or set of tools): repeats come from the
cache, a schema written in another order is another grammar, and refusals are not kept."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.engine import prompt
from edge_agent.engine.constrained.grammar_cache import RequestGrammars
from edge_agent.engine.constrained.grammar_check import CheckedGrammar
from edge_agent.engine.request import GenerationRequest
from edge_agent.errors import InvalidRequest, UnsupportedParameter

ORDER = {"type": "object", "properties": {"id": {"type": "string"},
                                          "qty": {"type": "integer"}},
         "required": ["id", "qty"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def _maker(calls: list[int], text: str = 'root ::= "x"') -> Any:
    def make() -> CheckedGrammar:
        calls.append(1)
        return CheckedGrammar(text)
    return make


def test_the_same_inputs_are_compiled_once() -> None:
    cache = RequestGrammars()
    calls: list[int] = []
    first = cache.get(["schema", ORDER], _maker(calls))
    again = cache.get(["schema", {**ORDER}], _maker(calls))
    assert again is first and calls == [1]
    assert (cache.hits, cache.misses) == (1, 1)


def test_property_order_is_part_of_the_key() -> None:
    """The grammar writes properties in the schema's order: another order, another grammar."""
    cache = RequestGrammars()
    calls: list[int] = []
    reordered = {"type": "object", "required": ORDER["required"],
                 "properties": dict(reversed(list(ORDER["properties"].items())))}
    cache.get(["schema", ORDER], _maker(calls))
    cache.get(["schema", reordered], _maker(calls))
    assert calls == [1, 1]


def test_a_refused_schema_is_refused_again_not_remembered() -> None:
    cache = RequestGrammars()
    calls: list[int] = []

    def refuse() -> CheckedGrammar:
        calls.append(1)
        raise InvalidRequest("no", param="format")

    for _ in range(2):
        with pytest.raises(InvalidRequest):
            cache.get(["schema", ORDER], refuse)
    assert calls == [1, 1] and len(cache) == 0


def test_the_cache_is_bounded_and_keeps_the_recently_used() -> None:
    cache = RequestGrammars(capacity=2)
    calls: list[int] = []
    for name in ("a", "b", "a", "c", "a", "b"):
        cache.get(["schema", {"const": name}], _maker(calls))
    # a, b (miss, miss); a (hit); c (miss, evicts b); a (hit); b (miss, evicts c)
    assert len(calls) == 4 and len(cache) == 2


def test_grammar_for_converts_a_repeated_schema_and_tool_set_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt, "GRAMMARS", RequestGrammars())
    converted: list[Any] = []
    real = prompt.schema_to_grammar

    def counting(schema: Any, *, param: str) -> CheckedGrammar:
        converted.append(schema)
        return real(schema, param=param)

    monkeypatch.setattr(prompt, "schema_to_grammar", counting)
    schema_req = GenerationRequest(model="m", json_schema=ORDER)
    first = prompt.grammar_for(schema_req)
    assert prompt.grammar_for(GenerationRequest(model="m", json_schema=dict(ORDER))) == first
    tools_req = GenerationRequest(model="m", tools=TOOLS, tool_choice="required")
    call = prompt.grammar_for(tools_req)
    assert prompt.grammar_for(tools_req) == call
    assert len(converted) == 2
    prompt.grammar_for(GenerationRequest(model="m", tools=TOOLS, tool_choice="auto"))
    assert len(converted) == 3  # another choice, another grammar
    assert prompt.grammar_for(GenerationRequest(model="m")) is None


def test_a_refusal_still_names_the_dialects_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt, "GRAMMARS", RequestGrammars())
    bad = {"type": "integer", "multipleOf": 0.5}
    for param in ("format", "response_format.json_schema.schema"):
        with pytest.raises(UnsupportedParameter) as err:
            prompt.grammar_for(GenerationRequest(model="m", json_schema=bad, schema_param=param))
        assert err.value.param == f"{param}.multipleOf"
