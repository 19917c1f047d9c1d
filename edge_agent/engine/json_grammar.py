"""JSON schema → llama.cpp grammar, refusing what a grammar cannot enforce.

Builds on llama-cpp-python's port of llama.cpp's converter and adds integer ranges
(`minimum`, `maximum`, `exclusive*`), which the port ignores. Every other keyword that
would constrain the output but cannot be expressed as a grammar is refused by name: a
client asking for a schema gets output valid for it, or a 400 — never a silent pass.
"""

from __future__ import annotations

import json
from typing import Any

from llama_cpp.llama_grammar import BuiltinRule, SchemaConverter

from edge_agent.errors import UnsupportedParameter

_UNENFORCEABLE = ("multipleOf", "uniqueItems", "minProperties", "maxProperties",
                  "patternProperties", "not", "if", "then", "else", "contains", "minContains",
                  "maxContains", "dependentRequired", "dependentSchemas", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "dependencies")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
_INT_CAP = 10**15 - 1  # the converter's own integers are at most 16 digits


def schema_to_grammar(schema: dict[str, Any], *, param: str) -> str:
    _check(schema, param)
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(schema, "request")
        converter.visit(resolved, "")
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise UnsupportedParameter(f"unsupported JSON schema: {exc}", param=param) from exc
    return converter.format_grammar()


def _check(node: Any, path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check(item, f"{path}.{i}")
        return
    if not isinstance(node, dict):
        return
    for key in _UNENFORCEABLE:
        if key in node:
            raise UnsupportedParameter(
                f"JSON schema keyword '{key}' cannot be enforced here", param=f"{path}.{key}")
    if any(k in node for k in _BOUNDS) and node.get("type") != "integer":
        raise UnsupportedParameter(
            "numeric bounds are enforced only on 'integer' schemas", param=path)
    fmt = node.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise UnsupportedParameter(f"string format '{fmt}' cannot be enforced here",
                                   param=f"{path}.format")
    for key, value in node.items():
        if key not in ("enum", "const", "default", "examples"):
            _check(value, f"{path}.{key}")


# JSON forbids raw control characters in strings; the port's rule lets them through
# (llama.cpp's own converter excludes them, as here).
_JSON_CHAR = BuiltinRule(
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
    r'[0-9a-fA-F])', [])


class _Converter(SchemaConverter):  # type: ignore[misc]
    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return str(super()._add_primitive(name, _JSON_CHAR if name == "char" else rule))

    def visit(self, schema: dict[str, Any], name: str) -> str:
        if isinstance(schema, dict) and schema.get("type") == "integer" and any(
                k in schema for k in _BOUNDS):
            lo, hi = _int_bounds(schema)
            if lo > hi:
                raise ValueError(f"integer range [{lo}, {hi}] is empty")
            rule_name = name or "root"
            return str(self._add_rule(rule_name, f"({_int_range(lo, hi)}) space"))
        return str(super().visit(schema, name))


def _int_bounds(schema: dict[str, Any]) -> tuple[int, int]:
    lo, hi = -_INT_CAP, _INT_CAP
    import math

    if "minimum" in schema:
        lo = max(lo, math.ceil(schema["minimum"]))
    if "exclusiveMinimum" in schema:
        lo = max(lo, math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        hi = min(hi, math.floor(schema["maximum"]))
    if "exclusiveMaximum" in schema:
        hi = min(hi, math.ceil(schema["exclusiveMaximum"]) - 1)
    return lo, hi


def _int_range(lo: int, hi: int) -> str:
    """A GBNF alternation matching exactly the decimal integers in [lo, hi]."""
    alts: list[str] = []
    if lo < 0:
        neg_hi = -lo
        neg_lo = max(1, -hi)
        if neg_lo <= neg_hi:
            alts += [f'"-" {p}' for p in _natural_range(neg_lo, neg_hi)]
    if hi >= 0:
        alts += _natural_range(max(0, lo), hi)
    return " | ".join(alts)


def _natural_range(lo: int, hi: int) -> list[str]:
    out = []
    for width in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (width - 1) if width > 1 else 0)
        b = min(hi, 10**width - 1)
        if a <= b:
            out += [" ".join(p) for p in _fixed(str(a), str(b))]
    return out


def _digit(a: int, b: int) -> str:
    return json.dumps(str(a)) if a == b else f"[{a}-{b}]"


def _fixed(a: str, b: str) -> list[list[str]]:
    """Patterns for the same-width digit strings from a to b (leading zeros allowed)."""
    if not a:
        return [[]]
    if a[0] == b[0]:
        return [[json.dumps(a[0]), *p] for p in _fixed(a[1:], b[1:])]
    n = len(a) - 1
    lo_d, hi_d = int(a[0]), int(b[0])
    out: list[list[str]] = []
    tail: list[list[str]] = []
    full_lo, full_hi = lo_d, hi_d
    if a[1:] != "0" * n:
        out += [[json.dumps(a[0]), *p] for p in _fixed(a[1:], "9" * n)]
        full_lo = lo_d + 1
    if b[1:] != "9" * n:
        tail = [[json.dumps(b[0]), *p] for p in _fixed("0" * n, b[1:])]
        full_hi = hi_d - 1
    if full_lo <= full_hi:
        out.append([_digit(full_lo, full_hi), *(["[0-9]"] * n)])
    return out + tail
