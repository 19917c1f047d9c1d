from __future__ import annotations

import re

import pytest

from edge_agent.engine.json_grammar import _int_range, schema_to_grammar
from edge_agent.errors import UnsupportedParameter


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
    ({"type": "number", "minimum": 1}, "format"),
    ({"type": "integer", "multipleOf": 5}, "format.multipleOf"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "format.uniqueItems"),
    ({"type": "object", "properties": {"e": {"type": "string", "format": "email"}}},
     "format.properties.e.format"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "format"),
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
