from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llama_cpp as ll
import pytest

from edge_agent.engine.constrained.json_grammar import _int_range, schema_to_grammar
from edge_agent.engine.runtime.llama import LlamaModel
from edge_agent.errors import UnsupportedParameter
from tests.support.grammar_engine import grammar_sampler, takes, walk


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
    ({"type": "number", "multipleOf": 0.01}, "format.multipleOf"),
    ({"type": "integer", "multipleOf": 3, "maximum": 10}, "format.multipleOf"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "format.uniqueItems"),
    ({"type": "object", "properties": {"c": {"type": "string", "format": "color"}}},
     "format.properties.c.format"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "format"),
    ({"type": "string", "pattern": "^(?=a)b"}, "format.pattern"),
    ({"type": "string", "pattern": "a\\1"}, "format.pattern"),
    ({"type": "string", "not": {"format": "email"}}, "format.not"),
    ({"type": "array", "contains": {"type": "integer"}, "maxContains": 1},
     "format.maxContains"),
    ({"if": {"format": "date"}, "then": {"maxLength": 3}}, "format.if"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "format.oneOf"),
    ({"type": "object", "enum": ["AAA"]}, "format.enum"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
     "format.properties.a"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "format.required"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "format.type"),
    # A format the specifications define is refused when it is not enforced, on any type.
    ({"type": "string", "format": "duration"}, "format.format"),
    ({"type": "integer", "format": "uri"}, "format.format"),
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


def _holds(model: LlamaModel, schema: dict[str, Any], good: list[str], bad: list[str]) -> None:
    """The grammar takes each good text and refuses each bad one, and jsonschema agrees
    that the good are valid (a bad text may be invalid JSON altogether)."""
    for text in good:
        jsonschema.validate(json.loads(text), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        assert _accepts(model, schema, text), text
    for text in bad:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if value is not None and "format" not in schema:  # jsonschema checks few formats
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(value, schema)
        assert not _accepts(model, schema, text), text


# -- what outside testers found: answers that finished and broke their schema ------------------

STAGE = {"type": "object", "properties": {
    "stage": {"type": "string", "pattern": "^test|acceptance|production$"},
    "connectionType": {"type": "string"}}, "required": ["stage", "connectionType"]}


def test_a_pattern_of_bare_alternatives_is_searched_and_never_ends_a_string_early(
        vocab_model: LlamaModel) -> None:
    # `^a|b|c$` is (^a)|(b)|(c$), searched: the port let the first alternative end the
    # string without its quote ("test, "connectionType": …).
    _holds(vocab_model, STAGE, good=[
        '{"stage":"test","connectionType":"tcp"}',
        '{"stage":"testing","connectionType":"tcp"}',
        '{"stage":"user-acceptance-2","connectionType":"tcp"}',
        '{"stage":"preproduction","connectionType":"tcp"}',
    ], bad=[
        '{"stage":"test, "connectionType":"tcp"}',
        '{"stage":"staging","connectionType":"tcp"}',
        '{"stage":"production-1","connectionType":"tcp"}',
        '{"stage":"a test","connectionType":"tcp"}',
    ])


def test_quotes_and_backslashes_a_pattern_allows_are_written_escaped(
        vocab_model: LlamaModel) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string",
                                                     "pattern": '^[a-z"\\\\]{1,4}$'}},
              "required": ["q"]}
    _holds(vocab_model, schema, good=['{"q":"a\\"b"}', '{"q":"\\\\a"}'],
           bad=['{"q":"a"b"}', '{"q":"A"}', '{"q":"abcde"}'])


def test_required_names_outside_properties_are_written(vocab_model: LlamaModel) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    _holds(vocab_model, schema, good=['{"a":1,"b":"x"}', '{"a":1,"b":[true]}'],
           bad=['{"a":1}', '{"b":2}'])
    typed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
             "additionalProperties": {"type": "integer"}}
    # Required properties come first, in the grammar's order.
    _holds(vocab_model, typed, good=['{"b":2}', '{"b":2,"a":1}'], bad=['{"b":"x"}', "{}"])


def test_an_object_with_a_string_enum_is_refused_as_unsatisfiable() -> None:
    with pytest.raises(UnsupportedParameter) as err:
        schema_to_grammar({"type": "object", "enum": ["AAA", "BBB"]}, param="format")
    assert err.value.param == "format.enum" and "type" in err.value.message


ADDRESS = {"type": "object", "properties": {
    "country": {"type": "string"}, "state": {"type": "string"}, "province": {"type": "string"}},
    "allOf": [{"oneOf": [
        {"properties": {"country": {"const": "US"}}, "required": ["country", "state"]},
        {"properties": {"country": {"const": "CA"}}, "required": ["country", "province"]}]}],
    "additionalProperties": False}


def test_a_top_level_all_of_one_of_is_enforced(vocab_model: LlamaModel) -> None:
    _holds(vocab_model, ADDRESS, good=[
        '{"country":"US","state":"NY"}', '{"country":"CA","province":"QC"}',
    ], bad=[
        '{"country":"US"}', '{"country":"US","province":"QC"}', '{"state":"NY"}', "{}",
        '{"country":"FR","state":"x"}',
    ])


def test_a_one_of_whose_alternatives_overlap_is_written_each_without_the_others(
        vocab_model: LlamaModel) -> None:
    # Each alternative as itself and not the other: a value matching both is never written.
    schema = {"type": "object", "properties": {"state": {"type": "string"},
                                               "zip": {"type": "string"}},
              "allOf": [{"oneOf": [{"required": ["state"]}, {"required": ["zip"]}]}]}
    _holds(vocab_model, schema, ['{"state":"NY"}', '{"zip":"10001"}'],
           ['{"state":"NY","zip":"10001"}', "{}"])
    strings = {"oneOf": [{"type": "string", "maxLength": 5}, {"type": "string", "pattern": "^a"}]}
    _holds(vocab_model, strings, ['"bcd"', '"abcdefg"', '""'], ['"abc"', '"bcdefgh"', '"a"'])


def test_a_one_of_whose_overlap_cannot_be_written_apart_is_refused_by_name() -> None:
    # Telling these apart needs "an object with a key besides `a`": no `not` writes that.
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                         "additionalProperties": False},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    with pytest.raises(UnsupportedParameter) as err:
        schema_to_grammar(schema, param="format")
    assert err.value.param == "format.oneOf" and "anyOf" in err.value.message


# -- what users write every day, enforced -------------------------------------------------------

@pytest.mark.parametrize(("schema", "good", "bad"), [
    ({"type": "number", "minimum": 0, "maximum": 1}, ["0", "1", "0.25"], ["1.5", "-0.1", "2"]),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 100}, ["0.5", "100", "7"],
     ["0", "0.0", "-1", "100.5"]),
    ({"type": "number", "minimum": -5, "exclusiveMaximum": 0}, ["-5", "-0.5", "-1"],
     ["0", "-5.5", "1"]),
    ({"type": "integer", "format": "int32"}, ["2147483647", "-2147483648"],
     ["2147483648", "1.5"]),
    ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'],
     ['"123e4567"', '"123e4567-e89b-12d3-a456-42661417400z"']),
    ({"type": "string", "format": "date"}, ['"2024-02-28"', '"1999-12-31"'],
     ['"2024-02-30"', '"2024-13-01"', '"24-01-01"']),
    ({"type": "string", "format": "date-time"}, ['"2024-01-02T03:04:05Z"',
                                                  '"2024-01-02T03:04:05.123+02:00"'],
     ['"2024-01-02 03:04:05"', '"2024-01-02T25:00:00Z"']),
    ({"type": "string", "format": "email"}, ['"ada@example.com"', '"a.b+c@mail.example.org"'],
     ['"ada"', '"ada@"', '"@example.com"']),
    ({"type": "string", "format": "uri"}, ['"https://example.com/a/b?x=1#top"',
                                           '"http://localhost:8080/"'],
     ['"example.com"', '"https://exa mple.com"', '"https://x.org/%zz"']),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ['"abc"', '"a"'],
     ['"abcd"', '""', '"ab1"']),
    ({"type": ["string", "null"], "pattern": "^[a-z]+$", "minLength": 2}, ['"ab"', "null"],
     ['"a"', '"AB"']),
    ({"type": "string", "pattern": "[0-9]{3}"}, ['"abc123"', '"123"', '"x1234y"'],
     ['"12"', '"a1b2c3"']),
    ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
      "additionalProperties": False}, ['{"x-a":1}', "{}", '{"x-a":1,"x-b":2}'],
     ['{"x-a":"s"}', '{"y":1}']),
    ({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
      "additionalProperties": {"type": "string"}}, ['{"id":1}', '{"id":1,"name":"x"}'],
     ['{"id":1,"name":2}', '{"id":"1"}', '{"id":1,"id":"x"}']),
    ({"type": "object", "properties": {"card": {"type": "string"}, "cvc": {"type": "string"}},
      "dependentRequired": {"card": ["cvc"]}}, ['{}', '{"cvc":"1"}', '{"card":"4","cvc":"1"}'],
     ['{"card":"4"}']),
    ({"type": "array", "items": {"enum": ["r", "g", "b"]}, "uniqueItems": True, "minItems": 1},
     ['["r"]', '["r","b"]', '["r","g","b"]'], ['[]', '["r","r"]', '["g","g","b"]']),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
      "items": False}, ['[1,"a"]'], ['[1,"a",2]', '["a",1]']),
    ({"type": "integer", "multipleOf": 15}, ["0", "15", "-30", "1500"], ["5", "16", "015"]),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z_]+$"},
      "additionalProperties": {"type": "integer"}}, ['{"a_b":1}', "{}"], ['{"A":1}']),
    ({"type": "string", "not": {"enum": ["admin", "root"]}}, ['"ada"', '"admins"'],
     ['"admin"', '"root"']),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "integer"}, "not": {"required": ["secret"]}},
     ['{"a":1}', '{"b":2}'], ['{"secret":1}', '{"a":1,"secret":2}']),
    ({"not": {"type": ["string", "object", "array", "null", "boolean"]}}, ["1", "2.5"],
     ['"x"', "{}", "null"]),
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
      "minProperties": 1, "maxProperties": 1}, ['{"a":"x"}', '{"b":"y"}'],
     ["{}", '{"a":"x","b":"y"}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
     ["{}", '{"a":1,"b":2}'], ['{"a":1,"b":2,"c":3}']),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10}},
     ["[10]", "[12,1,2]"], ["[]", "[1]", "[1,2,3]"]),
    ({"type": "object"}, ['{"a":[1,{"b":null}]}', "{}"], ['[1]', '"x"']),
    ({"type": "array", "maxItems": 2}, ['[1,"x"]', "[]"], ['[1,2,3]']),
    ({"type": "object", "required": ["id"]}, ['{"id":1,"x":2}'], ["{}", '{"x":2}']),
    ({"type": "string", "not": {"maxLength": 3}}, ['"abcd"'], ['"abc"', '""']),
    # A format no specification defines is an annotation; byte and json-pointer are held.
    ({"type": "string", "format": "path"}, ['"a/b"', '"any text"'], ["1", "null"]),
    ({"type": "object", "properties": {"u": {"type": "string", "format": "URI"}}},
     ['{"u":"not a uri"}'], ['{"u":1}']),
    ({"type": "string", "format": "byte"}, ['"aGk="', '"YWJj"', '""'],
     ['"a"', '"aGk"', '"a=bc"']),
    ({"type": "string", "format": "json-pointer"}, ['""', '"/a/b"', '"/a~1b"'],
     ['"a"', '"/~2"']),
    ({"type": "number", "format": "float", "maximum": 2}, ["1.5", "2"], ["3", '"x"']),
    # `x-…` extensions differ between the parts of an allOf without stopping the merge.
    ({"allOf": [{"type": "object", "x-doc": "a"}, {"x-doc": "b", "required": ["k"]}]},
     ['{"k":1}'], ["{}", '{"j":1}']),
    # Long bounds are written in binary: every length at a block's edge is checked.
    ({"type": "string", "minLength": 33, "maxLength": 129},
     ['"' + "a" * n + '"' for n in (33, 34, 63, 64, 65, 127, 128, 129)],
     ['"' + "a" * n + '"' for n in (0, 31, 32, 130, 131, 256)]),
    ({"type": "string", "minLength": 50, "maxLength": 32767},
     ['"' + "ab" * 25 + '"', '"' + "x" * 600 + '"'], ['"' + "ab" * 24 + 'a"']),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4096},
                                       "b": {"type": ["string", "null"], "maxLength": 1024}}},
     ['{"a":"' + "é" * 300 + '","b":null}', '{"b":"' + "z" * 1024 + '"}'],
     ['{"b":"' + "z" * 1025 + '"}']),
    ({"type": "string", "format": "email", "maxLength": 255}, ['"ada@example.com"'],
     ['"ada"', '"' + "a" * 250 + '@example.com"']),
    # Under a short maxLength, the parts of an address are kept short enough to fit.
    ({"type": "string", "format": "email", "maxLength": 20}, ['"ab@cd.ef"'],
     ['"ada.lovelace@example.com"']),
    ({"type": "object", "additionalProperties": {"type": "string"},
      "dependentRequired": {"x": ["y"]}}, ['{"a":"b"}', '{"x":"1","y":"2"}'], ['{"x":"1"}']),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False,
      "dependentRequired": {"x": ["y"]}}, ["{}"], ['{"x":1}']),
    ({"type": "object", "properties": {"country": {"enum": ["US", "CA"]},
                                       "zip": {"type": "string"}},
      "required": ["country"],
      "if": {"properties": {"country": {"const": "US"}}},
      "then": {"required": ["zip"]}},
     ['{"country":"US","zip":"10001"}', '{"country":"CA"}', '{"country":"CA","zip":"x"}'],
     ['{"country":"US"}']),
])
def test_everyday_keywords_are_enforced(vocab_model: LlamaModel, schema: dict[str, Any],
                                        good: list[str], bad: list[str]) -> None:
    _holds(vocab_model, schema, good, bad)


@pytest.mark.parametrize("schema", [
    ADDRESS,
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"q": {"type": "string", "pattern": '^[a-z"\\\\]{1,4}$'}},
     "required": ["q"]},
])
def test_what_the_grammar_writes_is_valid(vocab_model: LlamaModel, schema: dict[str, Any]
                                          ) -> None:
    # Random walks through the grammar itself, token by token, as a sampler would be let.
    sampler = grammar_sampler(vocab_model, schema_to_grammar(schema, param="format"))
    rng = random.Random(7)
    try:
        texts = []
        for _ in range(3):
            ll.llama_sampler_reset(sampler)
            text = walk(vocab_model, sampler, rng, max_tokens=64, stop=0.5)
            if text is not None:
                texts.append(text)
                jsonschema.validate(json.loads(text), schema)
        assert texts  # at least one walk finished
    finally:
        ll.llama_sampler_free(sampler)
