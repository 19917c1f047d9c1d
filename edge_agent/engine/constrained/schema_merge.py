"""Schemas that must all hold, merged into one: `allOf`, and keywords beside a union or `$ref`.

A grammar enforces one schema per value, so `allOf: [A, B]` becomes the schema whose values
satisfy both (types intersected, properties merged key by key, bounds tightened, enums
filtered), and a union beside other keywords (`{"required": [...], "oneOf": [...]}`) is
distributed into each alternative. The port merged only an `allOf`'s properties and dropped
every other keyword of its parts, and read a union with siblings as the union alone.

What cannot be merged exactly — two different patterns' formats, `patternProperties` on both
sides — raises `Unmergeable` naming the keyword, and the converter refuses the schema: the
merge never widens what a schema allows.
"""

from __future__ import annotations

import json
from typing import Any

# Keywords that describe, never constrain: dropped from merges, ignored by the converter.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "$comment", "default", "$schema", "$id",
    "id", "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding",
    "contentSchema", "$defs", "definitions", "$anchor", "$dynamicAnchor", "$vocabulary",
    "discriminator", "nullable", "xml", "externalDocs", "markdownDescription", "errorMessage",
})


def _annotation(key: str) -> bool:
    """OpenAPI's and editors' `x-…` extensions describe too: no validator reads them."""
    return key in ANNOTATIONS or key.startswith("x-")


_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


class Unmergeable(ValueError):
    """Two schemas whose conjunction a schema cannot state here; `keyword` names why."""

    def __init__(self, keyword: str, message: str) -> None:
        super().__init__(message)
        self.keyword = keyword


def types_of(schema: dict[str, Any]) -> set[str] | None:
    """The types `type` allows (integer within number), None when it does not say."""
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = set(kind if isinstance(kind, list) else [kind])
    if "number" in kinds:
        kinds.add("integer")
    return kinds


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The schema of the values valid for both `a` and `b` (neither holding a `$ref` or a
    union at the top: the caller resolves and distributes those first)."""
    out = {k: v for k, v in a.items() if not _annotation(k)}
    for key, value in b.items():
        if _annotation(key):
            continue
        if key not in out:
            out[key] = value
            continue
        mine = out[key]
        if _same(mine, value):
            continue
        out[key] = _merge_keyword(key, mine, value, a, b)
    if "properties" in a or "properties" in b or "additionalProperties" in out:
        _merge_objects(out, a, b)
    if ("prefixItems" in a) != ("prefixItems" in b) and "items" in out:
        _merge_arrays(out, a, b)
    return out


def _same(x: Any, y: Any) -> bool:
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def _merge_keyword(key: str, mine: Any, value: Any, a: dict[str, Any], b: dict[str, Any]
                   ) -> Any:
    if key == "type":
        ta, tb = types_of(a) or set(_TYPES), types_of(b) or set(_TYPES)
        both = ta & tb
        if "number" in both and not ("number" in ta and "number" in tb):
            both.discard("number")
        kinds = [t for t in _TYPES if t in both and not (t == "integer" and "number" in both)]
        if not kinds:
            raise Unmergeable("type", f"'type' {mine!r} and {value!r} have no value in common")
        return kinds[0] if len(kinds) == 1 else kinds
    if key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
        return max(mine, value)
    if key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
        return min(mine, value)
    if key == "required":
        return list(dict.fromkeys([*mine, *value]))
    if key == "uniqueItems":
        return bool(mine) or bool(value)
    if key == "enum":
        kept = [v for v in mine if any(_same(v, w) for w in value)]
        if not kept:
            raise Unmergeable("enum", "two 'enum's have no value in common")
        return kept
    if key == "const":
        raise Unmergeable("const", "two different 'const' values")
    if key in ("items", "additionalProperties", "additionalItems"):
        if isinstance(mine, list) or isinstance(value, list):
            raise Unmergeable(key, f"two different tuple '{key}' cannot be combined here")
        if mine is False or value is False:
            return False
        if mine is True:
            return value
        if value is True:
            return mine
        return {"allOf": [mine, value]}
    if key == "properties":
        props = dict(mine)
        for name, sub in value.items():
            props[name] = sub if name not in props else {"allOf": [props[name], sub]}
        return props
    if key == "dependentRequired":
        deps = {k: list(v) for k, v in mine.items()}
        for name, names in value.items():
            deps[name] = list(dict.fromkeys([*deps.get(name, []), *names]))
        return deps
    if key in ("allOf", "anyOf", "oneOf"):
        return None  # the caller flattens combinators before merging
    raise Unmergeable(key, f"two different '{key}' values cannot be combined here")


def _merge_arrays(out: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> None:
    """A side's `items` holds at every position the other side's `prefixItems` names."""
    for side in (a, b):
        if isinstance(side.get("items"), list):
            raise Unmergeable("items", "a tuple 'items' beside 'prefixItems' cannot be "
                              "combined here")
    prefixed, other = (a, b) if "prefixItems" in a else (b, a)
    rest = other.get("items", True)
    if rest is True:
        return
    out["prefixItems"] = [{"allOf": [p, rest]} if rest is not False else False
                          for p in prefixed["prefixItems"]]


def _merge_objects(out: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> None:
    """A property named by one side only must also satisfy the other side's rule for its
    name (its additionalProperties, or nothing: absent)."""
    if "patternProperties" in a or "patternProperties" in b:
        if ("patternProperties" in a) != ("patternProperties" in b) or \
                not _same(a.get("patternProperties"), b.get("patternProperties")):
            raise Unmergeable("patternProperties",
                              "'patternProperties' in only one of the combined schemas")
    props = dict(out.get("properties") or {})
    for side, other in ((a, b), (b, a)):
        for name in side.get("properties") or {}:
            if name in (other.get("properties") or {}):
                continue
            extra = other.get("additionalProperties", True)
            if extra is False:
                if name in (out.get("required") or []):
                    raise Unmergeable("required", f"'{name}' is required by one combined "
                                      "schema and forbidden by another")
                props.pop(name, None)
            elif extra is not True:
                props[name] = {"allOf": [props[name], extra]}
    if props or "properties" in out:
        out["properties"] = props
