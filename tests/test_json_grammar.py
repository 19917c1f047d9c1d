from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llama_cpp as ll
import pytest

from edge_agent.engine.json_grammar import _int_range, schema_to_grammar
from edge_agent.engine.runtime import LlamaModel
from edge_agent.errors import UnsupportedParameter
from tests.support.grammar_engine import grammar_sampler, takes


def _as_regex(gbnf_alternation: str) -> re.Pattern[str]:
    alts = []
    for alt in gbnf_alternation.split(" | "):
        parts = []
        for piece in alt.split(" "):
            parts.append(re.escape(piece.strip('"')) if piece.startswith('"') else piece)
        alts.append("".join(parts))
    return re.compile("^(?:" + "|".join(alts) + ")$")


@pytest.mark.parametrize(("lo", "hi"), [(0, 100), (5, 23), (-40, 7), (-150, -3), (13, 13),
                                        (99, 1001), (0, 9), (120, 4567)])
def test_integer_ranges_match_exactly_their_numbers(lo: int, hi: int) -> None:
    pattern = _as_regex(_int_range(lo, hi))
    for n in range(lo - 300, hi + 300):
        assert bool(pattern.match(str(n))) == (lo <= n <= hi), n
    if hi > 0:
        assert not pattern.match("0" + str(hi))  # no leading zeros


def test_bounded_integer_schema_compiles_to_a_grammar() -> None:
    grammar = schema_to_grammar({"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
        param="format")
    assert "[0-9]" in grammar and "age" in grammar


@pytest.mark.parametrize(("schema", "param"), [
    ({"type": "integer", "multipleOf": 5}, "format.multipleOf"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "format.uniqueItems"),
    ({"type": "object", "properties": {"c": {"type": "string", "format": "color"}}},
     "format.properties.c.format"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "format"),
    ({"type": "string", "pattern": "^(?=a)b"}, "format.pattern"),
    ({"type": "string", "pattern": "a\\1"}, "format.pattern"),
    ({"type": "string", "not": {"maxLength": 3}}, "format.not"),
    ({"type": "array", "contains": {"type": "integer"}}, "format.contains"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "format.if"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "format.oneOf"),
    ({"type": "object", "enum": ["AAA"]}, "format.enum"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
     "format.properties.a"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "format.required"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "format.type"),
])
def test_what_a_grammar_cannot_enforce_is_refused_by_name(schema: dict[str, object],
                                                          param: str) -> None:
    with pytest.raises(UnsupportedParameter) as err:
        schema_to_grammar(schema, param="format")
    assert err.value.param == param


def test_strings_exclude_raw_control_characters() -> None:
    grammar = schema_to_grammar({"type": "object", "properties": {"a": {"type": "string"}}},
                                param="format")
    char = next(line for line in grammar.splitlines() if line.startswith("char ::="))
    assert r"\x00-\x1F" in char


# -- a `type` list keeps every other keyword --------------------------------------------------

@pytest.fixture(scope="module")
def vocab_model(model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(model_path, n_gpu_layers=0)
    yield model
    model.close()


def _accepts(model: LlamaModel, schema: dict[str, Any], text: str) -> bool:
    """Whether llama.cpp's grammar for `schema` takes `text` whole, token by token."""
    sampler = grammar_sampler(model, schema_to_grammar(schema, param="format"))
    try:
        return takes(model, sampler, text)
    finally:
        ll.llama_sampler_free(sampler)


@pytest.mark.parametrize(("schema", "good", "bad"), [
    ({"type": ["string", "null"], "maxLength": 3}, ['"abc"', "null", '""'], ['"abcd"', "1"]),
    ({"type": ["null", "string"], "minLength": 2}, ['"ab"', "null"], ['"a"', "2"]),
    ({"type": ["null", "string"], "pattern": "^[a-z]+$"}, ['"ab"', "null"], ['"AB"']),
    ({"type": ["integer", "null"], "minimum": 1, "maximum": 5}, ["3", "null"], ["0", "6"]),
    ({"type": ["array", "null"], "items": {"type": "integer"}, "maxItems": 2},
     ["[1,2]", "null"], ["[1,2,3]", '["a"]']),
    ({"type": ["object", "null"], "properties": {"a": {"type": "integer"}},
      "required": ["a"], "additionalProperties": False},
     ['{"a":1}', "null"], ["{}", '{"b":1}']),
    ({"type": ["string", "integer"], "enum": ["x", 2, True, None]}, ['"x"', "2"],
     ["true", "null", '"y"']),
])
def test_a_type_list_keeps_the_keywords_of_each_type(
        vocab_model: LlamaModel, schema: dict[str, Any], good: list[str],
        bad: list[str]) -> None:
    for text in good:
        jsonschema.validate(json.loads(text), schema)
        assert _accepts(vocab_model, schema, text), text
    for text in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), schema)
        assert not _accepts(vocab_model, schema, text), text


def test_a_type_list_with_no_value_of_its_types_is_refused() -> None:
    with pytest.raises(UnsupportedParameter) as err:
        schema_to_grammar({"type": ["string", "null"], "enum": [1, 2]}, param="format")
    assert err.value.param == "format.enum" and "type" in err.value.message
