"""JSON schema → llama.cpp grammar, refusing what a grammar cannot enforce or afford.

Builds on llama-cpp-python's port of llama.cpp's converter and adds integer ranges
(`minimum`, `maximum`, `exclusive*`), which the port ignores. Every other keyword that
would constrain the output but cannot be expressed as a grammar is refused by name: a
client asking for a schema gets output valid for it, or a 400 — never a silent pass.

The port trusts its schema, and a schema is client input: a repetition count became that
many copies of a rule (`minLength: 10**9` took the host's memory), a `$ref` was converted
again at every use (exponential along a chain), and names went into literals with their
backslashes unescaped (a NUL in a property name became a NUL in the grammar, which killed
the process). So the schema is copied (the port rewrites `$ref`s in place), every node the
converter visits is checked against the limits below first, names and references are
kept small, and the finished text goes through `grammar_check` before any sampler sees it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, BuiltinRule, SchemaConverter

from edge_agent.engine.grammar_check import MAX_GRAMMAR_BYTES, CheckedGrammar, check
from edge_agent.engine.schema_width import MAX_PARSE_STATES, WidthOracle, pattern_states
from edge_agent.errors import EdgeAgentError, InvalidRequest, UnsupportedParameter

MAX_REPETITION = 1_000  # minLength, maxLength, minItems, maxItems, a pattern's {m,n}
MAX_PROPERTIES = 256  # per object, allOf parts together (optional ones convert in n² time)
MAX_SCHEMA_NODES = 4_096  # schemas converted, counting each use of a $ref
MAX_SCHEMA_DEPTH = 64  # JSON nesting inside the schema document
MAX_PATTERN_CHARS = 1_000

_UNENFORCEABLE = ("multipleOf", "uniqueItems", "minProperties", "maxProperties",
                  "patternProperties", "not", "if", "then", "else", "contains", "minContains",
                  "maxContains", "dependentRequired", "dependentSchemas", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "dependencies")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNTS = (("minLength", "maxLength"), ("minItems", "maxItems"))
# The keywords that constrain one JSON type only: a schema whose `type` is a list is split
# into one schema per type, each keeping its own keywords and those of no type (the port
# turned `["string", "null"]` into a bare union, silently dropping maxLength and the rest).
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": set(_BOUNDS),
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
_INT_CAP = 10**15 - 1  # the converter's own integers are at most 16 digits
_MAX_NAME = 48  # rule names: property names can be any length
_SHARED_BODY = 200  # rule bodies longer than this are written once
_PORT_ERRORS = (AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError,
                RecursionError, OverflowError)


def schema_to_grammar(schema: Any, *, param: str) -> CheckedGrammar:
    """The grammar for `schema`, checked by llama.cpp's parser (a child process the first
    time a grammar is seen: call this off the event loop); a 400 naming `param` otherwise."""
    return check(convert(schema, param=param), param=param)


def convert(schema: Any, *, param: str) -> str:
    """The grammar text for `schema`, within the limits, not yet shown to llama.cpp."""
    root, parents = _copy(schema, param)
    converter = _Converter(parents, param)
    try:
        converter.visit(converter.resolve_refs(root, "request"), "")
    except EdgeAgentError:
        raise
    except _PORT_ERRORS as exc:
        raise UnsupportedParameter(f"unsupported JSON schema: {str(exc)[:200]}",
                                   param=param) from exc
    return str(converter.format_grammar())


_Parents = dict[int, tuple[int, str]]


def _copy(schema: Any, param: str) -> tuple[Any, _Parents]:
    """A copy the converter may rewrite, and each container's parent and key (by id) for
    naming a node in errors. Iterative, so depth is refused before anything recurses."""
    parents: _Parents = {}
    root = _shallow(schema)
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node))
        for key in keys:
            child = node[key]
            if isinstance(child, (dict, list)):
                child = node[key] = _shallow(child)
                parents[id(child)] = (id(node), str(key))
                if depth + 1 > MAX_SCHEMA_DEPTH:
                    raise InvalidRequest(
                        f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels",
                        param=_path(parents, child, param))
                stack.append((child, depth + 1))
    return root, parents


def _shallow(node: Any) -> Any:
    if isinstance(node, dict):
        return dict(node)
    return list(node) if isinstance(node, list) else node


def _path(parents: _Parents, node: Any, param: str) -> str:
    keys = []
    at = id(node)
    while at in parents:
        at, key = parents[at]
        keys.append(key if len(key) <= 64 else key[:64] + "…")
    return ".".join([param, *reversed(keys)])


def _short(name: str) -> str:
    """Rule names stay short: they are repeated in the grammar (up to MAX_REPETITION times)."""
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{name[:_MAX_NAME - 11]}-{digest}"


# JSON forbids raw control characters in strings; the port's rule lets them through
# (llama.cpp's own converter excludes them, as here).
_JSON_CHAR = BuiltinRule(
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
    r'[0-9a-fA-F])', [])
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')


class _Converter(SchemaConverter):  # type: ignore[misc]
    def __init__(self, parents: _Parents, param: str) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._parents = parents
        self._param = param
        self._visits = 0
        self._size = 0
        self._ref_rules: dict[str, str] = {}
        self._bodies: dict[str, str] = {}
        # Parses llama.cpp may follow at once (see schema_width): here, the most so far,
        # and per $ref the factor its target adds (or, while it converts, its entry value).
        self._states = 1
        self._peak = 1
        self._ref_factor: dict[str, int] = {}
        self._resolving: dict[str, int] = {}
        self._widths = WidthOracle(self._refs)
        self._split: list[dict[str, Any]] = []  # per-type parts made here, kept for _path

    def _path(self, node: Any) -> str:
        return _path(self._parents, node, self._param)

    def _format_literal(self, literal: str) -> str:
        # The port escapes quotes but not backslashes, so JSON's own escapes (`\u0000` for a
        # NUL in a name, `\"` for a quote) were read back by llama.cpp as grammar escapes.
        return '"' + _LITERAL_ESCAPE_RE.sub(lambda m: _LITERAL_ESCAPES[m.group(0)], literal) + '"'

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return str(super()._add_primitive(name, _JSON_CHAR if name == "char" else rule))

    def _add_rule(self, name: str, rule: str) -> str:
        # A long body already written under another name (strings with the same bounds, say)
        # is referred to, not copied: a maxLength of 1,000 is some 8 KB of grammar.
        twin = self._bodies.get(rule) if len(rule) > _SHARED_BODY else None
        known = len(self._rules)
        key = str(super()._add_rule(_short(name), twin or rule))
        if len(self._rules) > known:
            self._grow(len(key) + len(twin or rule) + 5)
        if twin is None and len(rule) > _SHARED_BODY:
            self._bodies.setdefault(rule, key)
        return key

    def _grow(self, n: int) -> None:
        self._size += n
        if self._size > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"the JSON schema needs a grammar over the limit of "
                                 f"{MAX_GRAMMAR_BYTES} bytes", param=self._param)

    def _resolve_ref(self, ref: str) -> str:
        """Each reference converted once, under a name reserved before its target is visited
        (the port converted a target again at every use and named a recursive reference by
        a guess that could point at another rule)."""
        known = self._ref_rules.get(ref)
        if known is not None:
            entry = self._resolving.get(ref)
            if entry is None:
                self._enter(self._states * self._ref_factor[ref], self._param)
            elif self._states > entry:
                raise UnsupportedParameter(
                    "a recursive $ref passes through alternatives that may match the same "
                    "text: llama.cpp's work would double at every level", param=self._param)
            return known
        base = INVALID_RULE_CHARS_RE.sub("-", ref.split("/")[-1]) or "ref"
        key = self._add_rule(f"ref-{base}", f"\x00{ref}")  # unique placeholder, replaced below
        self._ref_rules[ref] = key
        entry, outer_peak = self._states, self._peak
        self._resolving[ref], self._peak = entry, entry
        try:
            target = self.visit(self._refs[ref], key)
        finally:
            del self._resolving[ref]
        self._ref_factor[ref] = -(-self._peak // entry)
        self._peak = max(outer_peak, self._peak)
        self._rules[key] = target
        return key

    def _enter(self, states: int, path: str) -> None:
        if states > MAX_PARSE_STATES:
            raise UnsupportedParameter(
                f"alternatives here may match the same text into nested values: llama.cpp "
                f"would follow {states} parses at once (the limit is {MAX_PARSE_STATES})",
                param=path)
        self._peak = max(self._peak, states)

    def visit(self, schema: Any, name: str) -> str:
        self._visits += 1
        if self._visits > MAX_SCHEMA_NODES:
            raise InvalidRequest(f"the JSON schema expands to over {MAX_SCHEMA_NODES} schemas "
                                 "($ref uses included)", param=self._param)
        path = self._path(schema)
        if not isinstance(schema, dict):
            raise UnsupportedParameter("a JSON schema must be an object", param=path)
        _check_node(schema, path)
        for part in _all_of_parts(schema):  # merged by the port, never visited: check here
            _check_node(part, self._path(part))
            ref = part.get("$ref")
            if isinstance(ref, str) and ref in self._refs:
                _check_node(self._refs[ref], self._path(self._refs[ref]))
        saved = self._states
        try:
            self._states *= self._widths.node_width(schema)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=path) from exc
        self._enter(self._states, path)
        if "pattern" in schema:
            self._enter(self._states * _pattern_states(schema, path), f"{path}.pattern")
        try:
            return self._visit(schema, _short(name), path)
        finally:
            self._states = saved

    def _visit(self, schema: dict[str, Any], name: str, path: str) -> str:
        kinds = schema.get("type")
        if isinstance(kinds, list) and "$ref" not in schema and "anyOf" not in schema \
                and "oneOf" not in schema:
            return self._typed_union(schema, kinds, name, path)
        if schema.get("type") == "integer" and any(k in schema for k in _BOUNDS):
            lo, hi = _int_bounds(schema)
            if lo > hi:
                raise UnsupportedParameter(f"integer range [{lo}, {hi}] is empty", param=path)
            return str(self._add_rule(name or "root", f"({_int_range(lo, hi)}) space"))
        if schema.get("items") == {} and "prefixItems" not in schema:
            schema["items"] = {"type": "object"}  # what the port makes of {} anywhere else
        return str(super().visit(schema, name))

    def _typed_union(self, schema: dict[str, Any], kinds: list[str], name: str, path: str
                     ) -> str:
        """`type: [a, b, …]` as a union of one schema per type, each with the keywords
        that constrain it; an `enum`/`const` keeps its values of those types."""
        kinds = list(dict.fromkeys(kinds))
        if "number" in kinds and "integer" in kinds:
            kinds.remove("integer")  # a number already takes every integer
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            kept = [v for v in values if any(_is_type(v, k) for k in kinds)]
            if not kept:
                raise UnsupportedParameter(
                    f"no value of 'enum'/'const' is of the types {kinds}", param=path)
            part = {k: v for k, v in schema.items() if k not in ("type", "const", "enum")}
            part["enum"] = kept
            return self._part(part, schema, "enum", name)
        foreign = set().union(*_TYPE_KEYWORDS.values())
        parts = []
        for i, kind in enumerate(kinds):
            own = _TYPE_KEYWORDS.get(kind, set())
            parts.append({**{k: v for k, v in schema.items()
                             if k != "type" and (k in own or k not in foreign)},
                          "type": kind})
            self._remember(parts[-1], schema, f"type.{i}")
        if len(parts) == 1:
            return self.visit(parts[0], name)
        return str(self._add_rule(name or "root", self._generate_union_rule(name, parts)))

    def _part(self, part: dict[str, Any], schema: dict[str, Any], key: str, name: str) -> str:
        self._remember(part, schema, key)
        return self.visit(part, name)

    def _remember(self, part: dict[str, Any], schema: dict[str, Any], key: str) -> None:
        """`part` is named after `schema` in errors (and kept alive: ids name nodes)."""
        self._split.append(part)
        self._parents[id(part)] = (id(schema), key)


def _is_type(value: Any, kind: str) -> bool:
    """Whether `value` is of JSON Schema type `kind`."""
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    return kind == "object" and isinstance(value, dict)


def _pattern_states(node: dict[str, Any], path: str) -> int:
    pattern = node.get("pattern")
    if not isinstance(pattern, str):
        return 1
    try:
        return pattern_states(pattern)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=f"{path}.pattern") from exc


def _check_node(node: Any, path: str) -> None:
    """Refuses, by name, what a grammar cannot enforce and what exceeds a limit."""
    if not isinstance(node, dict):
        raise UnsupportedParameter("a JSON schema must be an object", param=path)
    for key in _UNENFORCEABLE:
        if key in node:
            raise UnsupportedParameter(
                f"JSON schema keyword '{key}' cannot be enforced here", param=f"{path}.{key}")
    bounds = [k for k in _BOUNDS if k in node]
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if bounds and ("integer" not in kinds or "number" in kinds):
        raise UnsupportedParameter(
            "numeric bounds are enforced only on 'integer' schemas", param=path)
    for key in bounds:
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise InvalidRequest(f"'{key}' must be a finite number", param=f"{path}.{key}")
    fmt = node.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise UnsupportedParameter(f"string format '{fmt}' cannot be enforced here",
                                   param=f"{path}.format")
    for low, high in _COUNTS:
        lo = _count(node, low, path)
        hi = _count(node, high, path)
        if lo is not None and hi is not None and lo > hi:
            raise InvalidRequest(f"'{low}' {lo} exceeds '{high}' {hi}", param=f"{path}.{low}")
    if "pattern" in node:
        _check_pattern(node["pattern"], f"{path}.pattern")
        for key in ("minLength", "maxLength"):
            if key in node:
                raise UnsupportedParameter(
                    f"'{key}' beside 'pattern' cannot be enforced here (write the length "
                    f"into the pattern, as {{2,8}})", param=f"{path}.{key}")
    _check_shapes(node, path)


def _count(node: dict[str, Any], key: str, path: str) -> int | None:
    """A repetition count as an int within MAX_REPETITION (written back for the converter)."""
    if key not in node:
        return None
    value = node[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"'{key}' must be a non-negative integer", param=f"{path}.{key}")
    if value > MAX_REPETITION:
        raise InvalidRequest(f"'{key}' {value} exceeds the limit of {MAX_REPETITION}",
                             param=f"{path}.{key}")
    node[key] = value
    return value


def _check_shapes(node: dict[str, Any], path: str) -> None:
    """Keywords of the wrong JSON type, or empty where a value is needed, refused by name
    (the port would fail on them with an internal error, or emit an empty rule)."""
    for key in ("enum", "anyOf", "oneOf", "allOf"):
        if key in node and (not isinstance(node[key], list) or not node[key]):
            raise InvalidRequest(f"'{key}' must be a non-empty array", param=f"{path}.{key}")
    props = node.get("properties")
    if props is not None and not isinstance(props, dict):
        raise InvalidRequest("'properties' must be an object", param=f"{path}.properties")
    subschemas = [(f"properties.{k}", v) for k, v in (props or {}).items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        value = node.get(key)
        if isinstance(value, list):
            subschemas += [(f"{key}.{i}", v) for i, v in enumerate(value)]
        elif key == "items" and value is not None:
            subschemas.append((key, value))
    extra = node.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool):
        subschemas.append(("additionalProperties", extra))
    for where, sub in subschemas:
        if not isinstance(sub, dict):
            raise UnsupportedParameter("a JSON schema must be an object",
                                       param=f"{path}.{where}")
    count = len(props or {}) + sum(len(part.get("properties") or ())
                                   for part in _all_of_parts(node) if isinstance(part, dict))
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


def _all_of_parts(node: dict[str, Any]) -> list[Any]:
    """The schemas an `allOf` merges: its parts, or the alternatives of a part's `anyOf`."""
    parts = node.get("allOf")
    out: list[Any] = []
    for part in parts if isinstance(parts, list) else ():
        alts = part.get("anyOf") if isinstance(part, dict) else None
        out += alts if isinstance(alts, list) else [part]
    return out


def _check_pattern(pattern: Any, path: str) -> None:
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
    """The numbers in a pattern's {m}, {m,}, {m,n}, read as the port reads them."""
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
                return out  # the port refuses an unbalanced brace itself
            out += [n.strip() for n in pattern[i + 1 : end].split(",") if n.strip()]
            i = end + 1
        else:
            i += 1
    return out


def _int_bounds(schema: dict[str, Any]) -> tuple[int, int]:
    lo, hi = -_INT_CAP, _INT_CAP
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
