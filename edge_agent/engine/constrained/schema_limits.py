"""What a schema node may hold before it is converted: its keywords' shapes, and the limits.

Client schemas are checked node by node as the converter reaches them (`check_node`):
keywords of the wrong JSON type or empty where a value is needed are refused by name (the
port failed on them with an internal error), counts and patterns beyond the limits are
refused before anything is built from them, and the keywords no grammar here enforces are
refused wherever they appear.
"""

from __future__ import annotations

import math
import re
from typing import Any

from edge_agent.errors import InvalidRequest, UnsupportedParameter

MAX_REPETITION = 1_000  # minItems, maxItems, min/maxProperties, a pattern's {m,n}
# A string's bounds are written in binary (`repetition`): rules grow with the log of the
# count, so the limit only keeps the numbers sane. Beside a pattern or a format, the
# automaton's own state limit applies.
MAX_STRING_LENGTH = 2**32
MAX_PROPERTIES = 256  # per object, allOf parts together (optional ones convert in n² time)
MAX_PATTERN_CHARS = 1_000
# Keywords that constrain and that no grammar here enforces: refused wherever they apply.
_UNENFORCEABLE = ("dependentSchemas", "$dynamicRef", "$recursiveRef")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNTS = (("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"), ("minContains", "maxContains"))


def check_node(node: Any, path: str) -> None:
    """Refuses, by name, what a grammar cannot enforce and what exceeds a limit."""
    if node is True or node is False:
        return
    if not isinstance(node, dict):
        raise UnsupportedParameter("a JSON schema must be an object", param=path)
    for key in _UNENFORCEABLE:
        if key in node:
            raise UnsupportedParameter(
                f"JSON schema keyword '{key}' cannot be enforced here", param=f"{path}.{key}")
    ref = node.get("$ref")
    if ref is not None and not isinstance(ref, str):
        raise InvalidRequest("'$ref' must be a string", param=f"{path}.$ref")
    for key in BOUNDS:
        if key in node:
            value = node[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise InvalidRequest(f"'{key}' must be a finite number", param=f"{path}.{key}")
    for low, high in _COUNTS:
        lo = _count(node, low, path)
        hi = _count(node, high, path)
        if lo is not None and hi is not None and lo > hi:
            raise InvalidRequest(f"'{low}' {lo} exceeds '{high}' {hi}", param=f"{path}.{low}")
    if "pattern" in node:
        check_pattern(node["pattern"], f"{path}.pattern")
    fmt = node.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise InvalidRequest("'format' must be a string", param=f"{path}.format")
    _check_shapes(node, path)


def _count(node: dict[str, Any], key: str, path: str) -> int | None:
    """A repetition count as an int within its limit (written back for the converter)."""
    if key not in node:
        return None
    value = node[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"'{key}' must be a non-negative integer", param=f"{path}.{key}")
    limit = MAX_STRING_LENGTH if key in ("minLength", "maxLength") else MAX_REPETITION
    if value > limit:
        raise InvalidRequest(f"'{key}' {value} exceeds the limit of {limit}",
                             param=f"{path}.{key}")
    node[key] = value
    return value


def _check_shapes(node: dict[str, Any], path: str) -> None:
    """Keywords of the wrong JSON type, or empty where a value is needed, refused by name
    (the port would fail on them with an internal error, or emit an empty rule)."""
    for key in ("enum", "anyOf", "oneOf", "allOf"):
        if key in node and (not isinstance(node[key], list) or not node[key]):
            raise InvalidRequest(f"'{key}' must be a non-empty array", param=f"{path}.{key}")
    for key in ("properties", "patternProperties"):
        value = node.get(key)
        if value is not None and not isinstance(value, dict):
            raise InvalidRequest(f"'{key}' must be an object", param=f"{path}.{key}")
    props = node.get("properties")
    subschemas = [(f"properties.{k}", v) for k, v in (props or {}).items()]
    subschemas += [(f"patternProperties.{k}", v)
                   for k, v in (node.get("patternProperties") or {}).items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        value = node.get(key)
        if isinstance(value, list):
            subschemas += [(f"{key}.{i}", v) for i, v in enumerate(value)]
        elif key == "items" and value is not None:
            subschemas.append((key, value))
    for key in ("additionalProperties", "additionalItems"):
        if key in node:
            subschemas.append((key, node[key]))
    for where, sub in subschemas:
        if not isinstance(sub, (dict, bool)):
            raise UnsupportedParameter("a JSON schema must be an object",
                                       param=f"{path}.{where}")
    count = len(props or {}) + sum(len(part.get("properties") or ())
                                   for part in node.get("allOf") or () if isinstance(part, dict))
    if count > MAX_PROPERTIES:
        raise InvalidRequest(f"an object with {count} properties exceeds the limit of "
                             f"{MAX_PROPERTIES}", param=path)
    kind = node.get("type")
    if kind is not None and not isinstance(kind, str) and (
            not isinstance(kind, list) or not kind or not all(isinstance(t, str) for t in kind)):
        raise InvalidRequest("'type' must be a string or a non-empty array of strings",
                             param=f"{path}.type")
    required = node.get("required")
    if required is not None and (
            not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise InvalidRequest("'required' must be an array of strings", param=f"{path}.required")


def check_pattern(pattern: Any, path: str) -> None:
    if not isinstance(pattern, str):
        raise InvalidRequest("'pattern' must be a string", param=path)
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"a pattern of {len(pattern)} characters exceeds the limit of "
                             f"{MAX_PATTERN_CHARS}", param=path)
    for count in _quantifiers(pattern):
        if not count.isdigit() or len(count) > 6 or int(count) > MAX_REPETITION:
            raise InvalidRequest(f"pattern repetition {{{count}}} exceeds the limit of "
                                 f"{MAX_REPETITION}", param=path)


def _quantifiers(pattern: str) -> list[str]:
    """The numbers in a pattern's {m}, {m,}, {m,n}."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
        elif c == "[":
            i += 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "{":
            end = pattern.find("}", i)
            if end < 0:
                return out
            inner = pattern[i + 1 : end]
            if re.fullmatch(r"\s*\d+\s*(,\s*\d*\s*)?", inner):
                out += [n.strip() for n in inner.split(",") if n.strip()]
            i = end + 1
        else:
            i += 1
    return out
