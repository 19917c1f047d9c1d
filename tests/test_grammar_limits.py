"""Schemas a grammar cannot represent or afford are refused with a 400, and no grammar
reaches llama.cpp unless its parser accepted it in a child process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from edge_agent.engine.constrained import grammar_check
from edge_agent.engine.constrained.grammar_check import CheckedGrammar, audit, check
from edge_agent.engine.constrained.json_grammar import (
    MAX_PROPERTIES,
    MAX_REPETITION,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    convert,
    schema_to_grammar,
)
from edge_agent.engine.constrained.sampler import Sampler
from edge_agent.engine.constrained.schema_limits import MAX_STRING_LENGTH
from edge_agent.engine.constrained.tool_calls import tool_call_schema
from edge_agent.engine.request import SamplingParams
from edge_agent.errors import EdgeAgentError, InvalidRequest
from tests.conftest import DEFAULT_MODEL, LiveServer

NUL_NAME = "a\u0000b"
NUL_SCHEMA = {"type": "object", "properties": {NUL_NAME: {"type": "integer", "minimum": 0,
                                                          "maximum": 9}},
              "required": [NUL_NAME]}


def _refused(schema: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        schema_to_grammar(schema, param="format")
    return err.value


def _rule(grammar: str, name: str) -> str:
    return next(line for line in grammar.splitlines() if line.startswith(f"{name} ::= "))


# --- text that llama.cpp would read as something else --------------------------------------


def test_a_nul_in_a_property_name_becomes_a_json_escape_not_a_grammar_nul() -> None:
    grammar = schema_to_grammar(NUL_SCHEMA, param="format")
    assert isinstance(grammar, CheckedGrammar)
    kv = next(line for line in grammar.splitlines() if "-kv ::= " in line)
    # The model writes the six characters \u0000 inside the key, as JSON spells a NUL.
    assert kv.split(" ::= ")[1].startswith(r'"\"a\\u0000b\""')


def test_quotes_and_backslashes_in_constants_are_escaped_for_the_grammar() -> None:
    grammar = convert({"enum": ['x"y', "a\\b"]}, param="format")
    assert _rule(grammar, "root") == r'root ::= "\"x\\\"y\"" | "\"a\\\\b\""'
    check(grammar, param="format")  # and llama.cpp's parser takes it


@pytest.mark.parametrize(("grammar", "reason"), [
    ('root ::= "a\\u0000b"', "U+0000"),            # the old output for a NUL property name
    ('root ::= "a\\U00110000"', "U+110000"),
    ("root ::= [\\x00]", "no character"),
    ("root ::= [^\\x01-\\uD7FF\\uE000-\\U0010FFFF]", "every character"),
    ("root ::= []", "empty"),
    ('root ::= "\\d"', "escape"),
    ('root ::= "a" # comment', "'#'"),
    ("root ::= <[42]>", "'<'"),
    ('root ::= "a', "not closed"),
    ('root ::= "a\u0000"', "NUL"),
    ('root ::= "\ud800"', "surrogate"),
])
def test_the_audit_refuses_what_no_token_can_spell_or_our_converter_never_writes(
        grammar: str, reason: str) -> None:
    with pytest.raises(grammar_check._Refused, match=re.escape(reason)):
        audit(grammar)


def test_a_nul_in_a_pattern_is_written_as_json_writes_it() -> None:
    # Patterns are automata whose characters are written as JSON escapes them: the model
    # writes the six characters \u0000, never a raw NUL (nor a grammar NUL).
    grammar = schema_to_grammar({"type": "string", "pattern": "^a\\x00b$"}, param="format")
    assert r'"\\u0000"' in grammar


# --- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("schema", "param"), [
    ({"type": "string", "minLength": 2**63}, "format.minLength"),
    ({"type": "string", "maxLength": 2**63}, "format.maxLength"),
    ({"type": "array", "items": {"type": "string"}, "maxItems": 2**63}, "format.maxItems"),
    ({"type": "array", "items": {}, "minItems": 2**63}, "format.minItems"),
    ({"type": "object", "properties": {"s": {"type": "string",
                                             "maxLength": MAX_STRING_LENGTH + 1}}},
     "format.properties.s.maxLength"),
    ({"type": "array", "items": {}, "maxItems": MAX_REPETITION + 1}, "format.maxItems"),
    ({"type": "string", "pattern": "^a{9223372036854775808}$"}, "format.pattern"),
    ({"type": "string", "pattern": "^(ab){2,1001}$"}, "format.pattern"),
    ({"type": "string", "minLength": -1}, "format.minLength"),
    ({"type": "string", "minLength": "5"}, "format.minLength"),
    ({"type": "string", "minLength": 5, "maxLength": 4}, "format.minLength"),
    ({"type": "integer", "maximum": float("inf")}, "format.maximum"),
    ({"type": "integer", "minimum": float("nan")}, "format.minimum"),
    ({"type": "integer", "minimum": 2**63}, "format"),
    ({"type": "integer", "maximum": -(2**63)}, "format"),
])
def test_bounds_beyond_the_limits_are_refused_by_name(schema: dict[str, Any],
                                                       param: str) -> None:
    assert _refused(schema).param == param


def test_a_repetition_at_the_limit_is_accepted() -> None:
    schema_to_grammar({"type": "array", "minItems": 1, "maxItems": MAX_REPETITION},
                      param="format")


def test_a_string_bound_costs_rules_in_the_log_of_its_length() -> None:
    # Written in binary: 131,072 costs a few dozen rules, where nested groups took 1 MB.
    small = schema_to_grammar({"type": "string", "maxLength": 40}, param="format")
    huge = schema_to_grammar({"type": "string", "minLength": 3, "maxLength": 131_072},
                             param="format")
    assert len(huge) < len(small) + 2048
    assert len(schema_to_grammar({"type": "string", "maxLength": MAX_STRING_LENGTH},
                                 param="format")) < 8 * 1024


def test_beside_a_pattern_a_long_bound_meets_the_automatons_limit() -> None:
    # An automaton counts each length in a state of its own: there the bound stays limited.
    err = _refused({"type": "string", "pattern": "^[a-z]+$", "minLength": 100_000})
    assert err.param == "format.pattern" and "automaton states" in err.message


_HUGE = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from edge_agent.engine.constrained.json_grammar import convert
start = time.perf_counter()
grammar = convert({"type": "string", "minLength": 1000000000}, param="format")
print(json.dumps({"bytes": len(grammar), "seconds": time.perf_counter() - start}))
"""


def test_a_billion_character_minimum_converts_at_once_in_bounded_memory() -> None:
    # In a child with 1 GiB of address space: as nested groups, this schema took ~25 GB.
    done = subprocess.run([sys.executable, "-c", _HUGE], capture_output=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr.decode()[-400:]
    result = json.loads(done.stdout)
    assert result["bytes"] < 4096
    assert result["seconds"] < 1.0


def test_strings_with_the_same_bounds_share_one_rule() -> None:
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 4096} for i in range(50)}}
    free = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    grammar = schema_to_grammar(schema, param="format")
    # one rule per property, and the bound's own rules once
    assert grammar.count(" ::= ") - schema_to_grammar(free, param="format").count(" ::= ") < 50 + 32
    assert len(grammar) < len(schema_to_grammar(free, param="format")) + 4096


def test_grammar_text_beyond_512_kib_is_refused() -> None:
    err = _refused({"enum": [f"value-{i:06d}" for i in range(40_000)]})
    assert err.param == "format" and str(512 * 1024) in err.message


def test_properties_schemas_and_nesting_are_bounded() -> None:
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                             for i in range(MAX_PROPERTIES + 1)}}
    assert _refused(many).param == "format"
    wide = {"type": "object", "properties": {
        f"p{i}": {"anyOf": [{"type": "string"}] * 20} for i in range(MAX_SCHEMA_NODES // 20)}}
    assert "schemas" in _refused(wide).message
    assert "alternatives" in _refused({"anyOf": [{"type": "string"}] * 257}).message
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    assert "nests deeper" in _refused(deep).message


def test_a_chain_of_refs_converts_each_target_once() -> None:
    # Names the port had to rewrite ('a.0' -> 'a-0') made it convert every use again:
    # 2^depth visits (18 levels: about half a minute). Each target is converted once now.
    depth = 18
    defs: dict[str, Any] = {f"a.{i}": {"type": "object", "properties": {
        "x": {"$ref": f"#/$defs/a.{i + 1}"}, "y": {"$ref": f"#/$defs/a.{i + 1}"}}}
        for i in range(depth)}
    defs[f"a.{depth}"] = {"type": "string"}
    schema = {"type": "object", "properties": {"r": {"$ref": "#/$defs/a.0"}}, "$defs": defs}
    start = time.perf_counter()
    grammar = convert(schema, param="format")
    assert time.perf_counter() - start < 2.0
    check(grammar, param="format")


def test_recursive_refs_point_at_their_own_rule() -> None:
    tree = {"type": "object", "properties": {"string": {"$ref": "#/$defs/string"}},
            "$defs": {"string": {"type": "object", "properties": {
                "kids": {"type": "array", "items": {"$ref": "#/$defs/string"}, "maxItems": 2}}}}}
    grammar = schema_to_grammar(tree, param="format")
    ref_rule = next(line for line in grammar.splitlines() if line.startswith("ref-string "))
    assert "object" not in ref_rule  # not the primitive rule that happens to share the name


# --- parses llama.cpp follows at once ----------------------------------------------------


def _arrays_union(item: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "array", "items": item},
                      {"type": "array", "items": item, "maxItems": 5}]}


def test_a_recursive_union_that_doubles_llamas_work_per_level_is_refused() -> None:
    # Sampled, each '[' the model wrote doubled the next token's time (20 s at depth 12).
    schema = {"type": "object", "properties": {"r": {"$ref": "#/$defs/n"}},
              "$defs": {"n": _arrays_union({"$ref": "#/$defs/n"})}}
    assert "recursive $ref" in _refused(schema).message


def test_nested_overlapping_unions_are_bounded_by_their_product() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(4):  # 2^4 = 16 parses at most: allowed
        schema = _arrays_union(schema)
    schema_to_grammar(schema, param="format")
    err = _refused(_arrays_union(schema))  # 32
    assert "32 parses" in err.message and err.param.startswith("format")


def test_unions_that_part_before_nesting_cost_nothing() -> None:
    # Many tools: every call opens with "name", but the constant names part them at once.
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {"q": {"type": "array", "items": {"type": "string"}}},
        "required": ["q"]}}} for i in range(40)]
    schema_to_grammar(tool_call_schema(tools, "auto"), param="tools")
    # A recursive expression tree whose shapes open with different keys.
    expr = {"anyOf": [
        {"type": "object", "properties": {"op": {"enum": ["+", "*"]},
                                          "args": {"type": "array",
                                                   "items": {"$ref": "#/$defs/e"}}},
         "required": ["op", "args"]},
        {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]},
    ]}
    schema_to_grammar({"$defs": {"e": expr}, "type": "object",
                       "properties": {"e": {"$ref": "#/$defs/e"}}}, param="format")


def test_objects_that_share_only_scalar_keys_part_before_nesting() -> None:
    # Both shapes may open with "name", but only one may nest: the parses part at the key
    # that opens a container, so the recursion costs one parse, not two per level.
    node = {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string"},
                                          "kids": {"type": "array",
                                                   "items": {"$ref": "#/$defs/n"}}}},
        {"type": "object", "properties": {"name": {"type": "string"},
                                          "size": {"type": "integer"}}}]}
    schema_to_grammar({"$defs": {"n": node}, "$ref": "#/$defs/n"}, param="format")
    node["anyOf"][1]["properties"]["kids"] = {"type": "array"}  # now both may nest there
    assert "recursive $ref" in _refused({"$defs": {"n": node}, "$ref": "#/$defs/n"}).message


def test_alternatives_built_with_all_of_are_judged_merged() -> None:
    # OpenAPI's shape: each alternative extends a base with allOf; merged, they part at
    # their constant "kind" before any nested value, so the recursion costs nothing.
    def shape(kind: str, key: str) -> dict[str, Any]:
        return {"allOf": [{"$ref": "#/$defs/base"}, {
            "properties": {"kind": {"const": kind},
                           key: {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["kind"]}]}
    schema = {"$defs": {
        "base": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
        "node": {"anyOf": [shape("a", "kids"), shape("b", "more")]}},
        "$ref": "#/$defs/node"}
    schema_to_grammar(schema, param="format")


def test_an_additional_key_is_never_a_named_one_so_they_part_at_the_key() -> None:
    # Additional keys are written by an automaton that excludes the named ones: "c" can no
    # longer be read both ways, so a recursion through both costs one parse, not two.
    node = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
            "additionalProperties": {"$ref": "#/$defs/n"}}
    schema = {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}},
              "$defs": {"n": node}}
    schema_to_grammar(schema, param="format")
    flat = {"type": "object", "properties": {"c": {"type": "string"}},
            "additionalProperties": {"type": "string"}}
    schema_to_grammar(flat, param="format")


@pytest.mark.parametrize(("pattern", "ok"), [
    # Patterns are deterministic automata now: one parse, however many ways a regex matches.
    ("^(a?){30}$", True),
    ("^((a|aa){5}){5}$", True),
    ("^(" * 40 + "a" + ")" * 40 + "$", False),
    ("^([0-9]{1,3}[.]){3}[0-9]{1,3}$", True),
    ("^[a-z]{1,64}(-[a-z]{1,64})*$", True),
])
def test_patterns_that_match_one_text_many_ways_cost_one_parse(pattern: str, ok: bool) -> None:
    schema = {"type": "string", "pattern": pattern}
    if ok:
        schema_to_grammar(schema, param="format")
    else:
        assert _refused(schema).param == "format.pattern"


# --- shapes the converter used to crash on (500) ------------------------------------------


@pytest.mark.parametrize(("schema", "param"), [
    ({"type": "object", "properties": {"a": 5}}, "format.properties.a"),
    ({"type": "object", "properties": []}, "format.properties"),
    ({"allOf": [1]}, "format.allOf.0"),
    ({"anyOf": []}, "format.anyOf"),
    ({"enum": []}, "format.enum"),
    ({"type": 5}, "format.type"),
    ({"type": "array", "items": "string"}, "format.items"),
])
def test_malformed_schemas_are_400s_naming_the_node(schema: dict[str, Any],
                                                    param: str) -> None:
    assert _refused(schema).param == param


def test_properties_named_like_keywords_are_plain_properties() -> None:
    schema = {"type": "object", "properties": {"format": {"enum": ["c", "f"]},
                                               "minimum": {"type": "integer"},
                                               "not": {"type": "boolean"}}}
    grammar = schema_to_grammar(schema, param="format")
    assert r'"\"format\""' in grammar and r'"\"not\""' in grammar


def test_the_clients_schema_is_not_rewritten() -> None:
    schema = {"type": "object", "properties": {"r": {"$ref": "#/$defs/d"}},
              "$defs": {"d": {"type": "string"}}}
    before = json.dumps(schema)
    schema_to_grammar(schema, param="format")
    assert json.dumps(schema) == before
    schema_to_grammar(schema, param="format")  # and a second conversion still resolves


def test_a_tools_schema_is_refused_naming_its_tool() -> None:
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "bad", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "minLength": 2**63}}}}},
    ]
    with pytest.raises(InvalidRequest) as err:
        tool_call_schema(tools, "auto")
    assert err.value.param == "tools.1.function.parameters.properties.s.minLength"
    tool_call_schema(tools, "ok")  # a named choice leaves the other tool out of the grammar


# --- the child-process check ----------------------------------------------------------------


def test_llama_cpp_refusals_and_crashes_in_the_child_are_400s_and_cached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    err = pytest.raises(InvalidRequest, check, "root ::= undefined-rule", param="format")
    assert "undefined-rule" in err.value.message
    calls = []
    real_run = subprocess.run

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(grammar_check, "_CHILD", "import os, resource\n"
                        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\nos.abort()")
    monkeypatch.setattr(grammar_check.subprocess, "run", counting_run)
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="crashed"):
            check('root ::= "crash-me"', param="response_format.json_schema.schema")
    assert len(calls) == 1  # the verdict is cached


def test_the_sampler_takes_only_checked_grammars() -> None:
    with pytest.raises(EdgeAgentError, match="unchecked"):
        Sampler.build(None, SamplingParams(), 'root ::= "a"')  # type: ignore[arg-type]


# --- live, both dialects --------------------------------------------------------------------


@pytest.mark.integration
def test_a_nul_property_name_is_served_in_both_dialects(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Pick a digit."}]
    r = httpx.post(f"{live_server.openai_url}/chat/completions", timeout=120, json={
        "model": DEFAULT_MODEL, "messages": messages, "max_tokens": 24, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "d", "schema": NUL_SCHEMA}}})
    assert r.status_code == 200, r.text
    assert list(json.loads(r.json()["choices"][0]["message"]["content"])) == [NUL_NAME]
    r = httpx.post(f"{live_server.ollama_url}/api/chat", timeout=120, json={
        "model": DEFAULT_MODEL, "messages": messages, "stream": False, "format": NUL_SCHEMA,
        "options": {"temperature": 0, "num_predict": 24}})
    assert r.status_code == 200, r.text
    assert list(json.loads(r.json()["message"]["content"])) == [NUL_NAME]


@pytest.mark.integration
def test_out_of_range_schemas_are_400s_in_both_dialects(live_server: LiveServer) -> None:
    huge = {"type": "array", "items": {"type": "string"}, "maxItems": 2**63}
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{live_server.openai_url}/chat/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": messages, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": huge}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema.maxItems"
    r = httpx.post(f"{live_server.ollama_url}/api/generate", timeout=60, json={
        "model": DEFAULT_MODEL, "prompt": "Hi", "stream": False,
        "format": {"type": "string", "minLength": 2**63}})
    assert r.status_code == 400 and "minLength" in r.json()["error"]
    r = httpx.post(f"{live_server.openai_url}/chat/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": messages, "max_tokens": 8, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"q": {"type": "string",
                                                       "pattern": "^(?=a)$"}}}}}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools.0.function.parameters.properties.q.pattern"
    # and the server still generates
    r = httpx.post(f"{live_server.ollama_url}/api/generate", timeout=120, json={
        "model": DEFAULT_MODEL, "prompt": "Hi", "stream": False,
        "options": {"num_predict": 4}})
    assert r.status_code == 200, r.text
