"""JSON schema → llama.cpp grammar: every constraining keyword enforced, or refused by name.

The promise: a schema accepted here gives a grammar whose every text is valid for it. A
keyword that constrains the output is either written into the grammar or refused with a 400
naming it; only keywords that constrain nothing (`title`, `description`, `default`, unknown
extensions…, see `schema_merge.ANNOTATIONS`) are ignored. The grammar may leave out valid
texts (a bounded number never has an exponent, a tuple is written whole) but never admits
an invalid one. `tests/test_json_schema_suite.py` holds this to the official JSON Schema
Test Suite: every invalid instance of every schema accepted here must be refused.

Built on llama-cpp-python's port of llama.cpp's converter, of which it keeps the rule
book-keeping, literals, `$ref` resolution and repetition; it dispatches every schema itself:

- `allOf`, and keywords beside a union or a `$ref`, are merged into one schema
  (`schema_merge`); a `oneOf` is taken only when its alternatives' grammars exclude each
  other (else two could match and the instance be invalid); `not` becomes the union of its
  keywords' negations, `if`/`then`/`else` the union of "if and then" and "not if and else";
- `enum`/`const` keep the values valid for the schema's other keywords (`type: object` with
  a string enum is refused as unsatisfiable);
- strings with a `pattern`, a `format` or a key rule are automata (`string_language`):
  patterns searched as JSON Schema searches, lengths beside them intersected, and every
  character written as JSON writes it, so a string cannot end before its quote;
- objects: `required` names outside `properties`, `patternProperties`,
  `additionalProperties` with keys other than the named ones, `dependentRequired`;
- numbers and integers with bounds (`numeric_range`), `int32`/`int64`;
- `uniqueItems` over a finite set of values (written in one order, so never repeated),
  `contains` (the first items written to match), `min/maxProperties` (counted per position).

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
import re
import urllib.parse
from typing import Any

import jsonschema
from llama_cpp.llama_grammar import (
    INVALID_RULE_CHARS_RE,
    PRIMITIVE_RULES,
    BuiltinRule,
    SchemaConverter,
)
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from edge_agent.engine.constrained import string_language as sl
from edge_agent.engine.constrained.grammar_check import MAX_GRAMMAR_BYTES, CheckedGrammar, check
from edge_agent.engine.constrained.numeric_range import (
    FRACTION_RULE,
    INT_CAP,
    NONZERO_FRACTION_RULE,
    Bounds,
    int_range,
    number_range,
)
from edge_agent.engine.constrained.repetition import repeat
from edge_agent.engine.constrained.schema_limits import (
    BOUNDS,
    MAX_PATTERN_CHARS,
    MAX_PROPERTIES,
    MAX_REPETITION,
    check_node,
    check_pattern,
)
from edge_agent.engine.constrained.schema_merge import ANNOTATIONS, Unmergeable, merge, types_of
from edge_agent.engine.constrained.schema_width import (
    MAX_ALTERNATIVES,
    MAX_PARSE_STATES,
    WidthOracle,
)
from edge_agent.errors import EdgeAgentError, InvalidRequest, UnsupportedParameter

MAX_SCHEMA_NODES = 4_096  # schemas converted, counting each use of a $ref
MAX_SCHEMA_DEPTH = 64  # JSON nesting inside the schema document
MAX_UNIQUE_VALUES = 32  # uniqueItems: the values an item may take
MAX_DEPENDENCIES = 6  # dependentRequired: optional properties that require others
_MAX_INLINE = 16  # $refs inlined into one merge (allOf through a $ref)

MAX_MULTIPLE = 64  # multipleOf: a grammar state per remainder
MAX_COUNTED_PROPERTIES = 32  # min/maxProperties: a grammar state per count
# What a `not` folds into (see _Converter._negated): strings it excludes, keys it forbids.
_NOT_TEXTS = "\x00not-texts"
_NOT_PATTERN = "\x00not-pattern"
_STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength", _NOT_PATTERN, _NOT_TEXTS)
_NOT_KEY = "\x00not-key"
_FRACTIONAL = "\x00fractional"
_NOT_PROPS = "\x00not-properties"  # name -> a schema its value must fail
_UNEVALUATED = ("unevaluatedProperties", "unevaluatedItems")  # merged as additional*/items
_CONDITIONS = ("not", "if", "then", "else")  # folded into unions of what they allow
_UNIONS = ("anyOf", "oneOf")
_CONFLICTS = ("type", "enum", "const")  # merged keywords that leave no value, not a limit
_MAX_ONEOF_OVERLAPS = 8  # pairs of a oneOf's alternatives written apart with `not`
_COMBINERS = ("allOf", "anyOf", "oneOf", "$ref")
# The keywords that constrain one JSON type only: a schema whose `type` is a list is split
# into one schema per type, each keeping its own keywords and those of no type (the port
# turned `["string", "null"]` into a bare union, silently dropping maxLength and the rest).
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {*BOUNDS, "format", "multipleOf"},
    "number": {*BOUNDS, "format", "multipleOf"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
              "contains", "minContains", "maxContains"},
    "object": {"properties", "required", "additionalProperties", "patternProperties",
               "dependentRequired", "dependencies", "minProperties", "maxProperties",
               "propertyNames"},
}
_KIND_ORDER = ("object", "array", "string", "number", "integer", "boolean", "null")
_INT_FORMATS = {"int32": (-(2**31), 2**31 - 1), "int64": (-INT_CAP, INT_CAP),
                "uint32": (0, 2**32 - 1), "uint64": (0, INT_CAP), "int8": (-128, 127),
                "uint8": (0, 255), "int16": (-(2**15), 2**15 - 1), "uint16": (0, 2**16 - 1)}
_NUMBER_FORMATS = ("double", "float")  # a bounded grammar number always fits either
# Sound subsets of each format: every text matched is valid for it (a date never names a
# 30 February; an e-mail address is a dotted local part at a dotted host name).
_DATE = ("[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|"
         "30)|02-(0[1-9]|1[0-9]|2[0-8]))")
_TIME = ("([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?"
         "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
_HEX = "[0-9a-fA-F]"
_LABEL = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_PCHAR = "([a-zA-Z0-9._~!$&'()*+,;=:@-]|%[0-9a-fA-F]{2})"
_FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "email": f"^[a-zA-Z0-9_+-]+(\\.[a-zA-Z0-9_+-]+)*@{_LABEL}(\\.{_LABEL})+$",
    "hostname": f"^{_LABEL}(\\.{_LABEL})*$",
    "ipv4": "^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}"
            "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$",
    "uri": f"^[a-zA-Z][a-zA-Z0-9+.-]*://{_LABEL}(\\.{_LABEL})*(:[0-9]{{1,5}})?"
           f"(/{_PCHAR}*)*(\\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?$",
}
_FORMATS["byte"] = "^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"  # base64
_FORMATS["json-pointer"] = "^(/([^~/]|~[01])*)*$"
_FORMATS["uri-reference"] = _FORMATS["iri"] = _FORMATS["iri-reference"] = _FORMATS["uri"]
_FORMATS["idn-email"] = _FORMATS["email"]
_FORMATS["idn-hostname"] = _FORMATS["hostname"]


# Formats with a meaning: JSON Schema's, OpenAPI's, and those jsonschema's validators check.
# One of them not enforced here is refused by name; any other name is an annotation, which
# JSON Schema tells implementations to ignore (as every validator does): `format: "path"`.
_DEFINED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
    "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
    "uri-template", "json-pointer", "relative-json-pointer", "regex", "color", "byte",
    "float", "double",
}) | _INT_FORMATS.keys() | {f"uuid{n}" for n in range(1, 6)}


def _format_of(node: dict[str, Any]) -> str | None:
    """The node's format, None where it has none or its name is only an annotation."""
    fmt = node.get("format")
    return fmt if fmt in _DEFINED_FORMATS else None


_MAX_PART = 24  # a bounded format's longest part (a longer one costs states, not validity)


def _label(k: int) -> str:
    return f"[a-zA-Z0-9]([a-zA-Z0-9-]{{0,{k - 2}}}[a-zA-Z0-9])?"


# Formats whose parts repeat, with every part at most k characters long.
_BOUNDED_FORMATS = {
    "email": lambda k: f"^[a-zA-Z0-9_+-]{{1,{k}}}(\\.[a-zA-Z0-9_+-]{{1,{k}}}){{0,2}}@"
                       f"{_label(k)}(\\.{_label(k)}){{1,2}}$",
    "hostname": lambda k: f"^{_label(k)}(\\.{_label(k)}){{0,3}}$",
    "uri": lambda k: f"^[a-zA-Z][a-zA-Z0-9+.-]{{0,9}}://{_label(k)}(\\.{_label(k)}){{0,3}}"
                     f"(:[0-9]{{1,5}})?(/{_PCHAR}{{0,{k}}}){{0,4}}(\\?({_PCHAR}|[/?]){{0,{k}}})?"
                     f"(#({_PCHAR}|[/?]){{0,{k}}})?$",
}
_BOUNDED_FORMATS["idn-email"] = _BOUNDED_FORMATS["email"]
_BOUNDED_FORMATS["idn-hostname"] = _BOUNDED_FORMATS["hostname"]
for _name in ("uri-reference", "iri", "iri-reference"):
    _BOUNDED_FORMATS[_name] = _BOUNDED_FORMATS["uri"]
for _n in range(1, 6):
    _FORMATS[f"uuid{_n}"] = _FORMATS["uuid"]
_MAX_NAME = 48  # rule names: property names can be any length
_SHARED_BODY = 200  # rule bodies longer than this are written once
_PORT_ERRORS = (AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError,
                RecursionError, OverflowError)
_BASE = "urn:edge-agent:request"


def schema_to_grammar(schema: Any, *, param: str) -> CheckedGrammar:
    """The grammar for `schema`, checked by llama.cpp's parser (a child process the first
    time a grammar is seen: call this off the event loop); a 400 naming `param` otherwise."""
    return check(convert(schema, param=param), param=param)


def convert(schema: Any, *, param: str) -> str:
    """The grammar text for `schema`, within the limits, not yet shown to llama.cpp."""
    root, parents = _copy(schema, param)
    converter = _Converter(parents, param)
    try:
        resolved = converter.resolve_refs(root, _BASE)
        converter.set_root(resolved)
        converter.visit(resolved, "")
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
        if not isinstance(node, (dict, list)):
            continue
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
# (llama.cpp's own converter excludes them, as here). A \u escape never names half of a
# surrogate pair: a pair is two escapes but one character, which lengths would miscount.
_JSON_CHAR = BuiltinRule(
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" ([0-9a-cA-Ce-fE-F] [0-9a-fA-F] | '
    r'[dD] [0-7]) [0-9a-fA-F] [0-9a-fA-F])', [])
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')


def _schema_error(keyword: str, message: str, path: str) -> UnsupportedParameter:
    return UnsupportedParameter(message, param=f"{path}.{keyword}" if keyword else path)


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
        self._widths = WidthOracle(self._refs, lambda s: self._flat(s, self._param, 0))
        self._split: list[Any] = []  # parts made here, kept alive for _path (ids name nodes)
        self._registry: Registry[Any] = Registry()
        self._validator: Any = jsonschema.Draft202012Validator
        self._placeholders = 0
        self._choices: dict[str, str] = {}
        self._strings: dict[str, str] = {}  # a string schema's keywords -> its rule
        self._automata = 0

    def set_root(self, root: Any) -> None:
        """The document `$ref`s point into, for checking values against a schema."""
        resource = DRAFT202012.create_resource(root if isinstance(root, (dict, bool)) else {})
        self._registry = Registry().with_resource(_BASE, resource)
        try:
            self._validator = jsonschema.validators.validator_for(
                root, default=jsonschema.Draft202012Validator)
        except Exception:  # an unknown $schema: read as 2020-12
            self._validator = jsonschema.Draft202012Validator

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
        if twin is not None and name != "root":
            return twin
        known = len(self._rules)
        key = str(super()._add_rule(_short(name), twin or rule))
        if len(self._rules) > known:
            self._grow(len(key) + len(twin or rule) + 5)
        if twin is None and len(rule) > _SHARED_BODY:
            self._bodies.setdefault(rule, key)
        return key

    def _reserve(self, name: str) -> str:
        """A rule name whose body is set later (rules that refer to each other)."""
        self._placeholders += 1
        return self._add_rule(name, f"\x00{self._placeholders}")

    def _set(self, key: str, body: str) -> None:
        self._grow(len(body))
        self._rules[key] = body

    def _grow(self, n: int) -> None:
        self._size += n
        if self._size > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"the JSON schema needs a grammar over the limit of "
                                 f"{MAX_GRAMMAR_BYTES} bytes", param=self._param)

    def _remember(self, part: Any, schema: Any, key: str) -> Any:
        """`part` is named after `schema` in errors (and kept alive: ids name nodes)."""
        if isinstance(part, (dict, list)) and id(part) not in self._parents:
            self._split.append(part)
            self._parents[id(part)] = (id(schema), key)
        return part

    # -- $ref ---------------------------------------------------------------------------

    def resolve_refs(self, schema: Any, url: str) -> Any:
        """Every `$ref` in a schema position, rewritten to `url` + its fragment, its target
        found by JSON pointer. Only references into the document itself are taken, and none
        under a nested `$id` (which would move the base they are read against)."""
        stack: list[tuple[Any, bool]] = [(schema, False)]
        while stack:
            node, scoped = stack.pop()
            if not isinstance(node, dict):
                continue
            scoped = scoped or (node is not schema and isinstance(node.get("$id"), str))
            ref = node.get("$ref")
            if isinstance(ref, str):
                path = self._path(node)
                if not ref.startswith("#") or scoped:
                    raise UnsupportedParameter(
                        f"'$ref' {ref[:80]!r} cannot be resolved: only references into the "
                        "schema itself (#/…) are, outside any nested $id", param=path)
                if url + ref not in self._refs:
                    self._refs[url + ref] = _pointer(schema, ref[1:], path)
                node["$ref"] = url + ref
            for key, value in node.items():
                if key in _SCHEMA_ONE or key == "items":
                    stack.append((value, scoped))
                if key in _SCHEMA_LIST and isinstance(value, list):
                    stack += [(v, scoped) for v in value]
                if key in _SCHEMA_MAP and isinstance(value, dict):
                    stack += [(v, scoped) for v in value.values()]
        return schema

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
        key = self._reserve(f"ref-{base}")
        self._ref_rules[ref] = key
        entry, outer_peak = self._states, self._peak
        self._resolving[ref], self._peak = entry, entry
        try:
            target = self.visit(self._target(ref), key)
        finally:
            del self._resolving[ref]
        self._ref_factor[ref] = -(-self._peak // entry)
        self._peak = max(outer_peak, self._peak)
        self._rules[key] = target
        return key

    def _target(self, ref: str) -> Any:
        if ref not in self._refs:
            raise UnsupportedParameter(f"'$ref' {ref[len(_BASE):][:80]!r} cannot be resolved "
                                       "(only references into the schema itself are)",
                                       param=self._param)
        return self._refs[ref]

    def _enter(self, states: int, path: str) -> None:
        if states > MAX_PARSE_STATES:
            raise UnsupportedParameter(
                f"alternatives here may match the same text into nested values: llama.cpp "
                f"would follow {states} parses at once (the limit is {MAX_PARSE_STATES})",
                param=path)
        self._peak = max(self._peak, states)

    # -- dispatch -----------------------------------------------------------------------

    def visit(self, schema: Any, name: str) -> str:
        self._visits += 1
        if self._visits > MAX_SCHEMA_NODES:
            raise InvalidRequest(f"the JSON schema expands to over {MAX_SCHEMA_NODES} schemas "
                                 "($ref uses included)", param=self._param)
        path = self._path(schema)
        if schema is True:
            schema = {}
        if schema is False:
            raise UnsupportedParameter("the schema `false` allows no value", param=path)
        if not isinstance(schema, dict):
            raise UnsupportedParameter("a JSON schema must be an object", param=path)
        check_node(schema, path)
        saved = self._states
        try:
            self._states *= self._widths.node_width(schema)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=path) from exc
        self._enter(self._states, path)
        try:
            return self._visit(schema, _short(name), path)
        finally:
            self._states = saved

    def _visit(self, schema: dict[str, Any], name: str, path: str) -> str:
        rule_name = name or "root"
        node = self._combined(schema, path, 0)
        if node is not schema:
            self._remember(node, schema, "")
            if node is False:
                raise UnsupportedParameter("the schemas combined here allow no value",
                                           param=path)
            check_node(node, path)
            if not any(k in schema for k in _UNIONS) and any(k in node for k in _UNIONS):
                # a union made here (allOf, not, if): its alternatives count as any union's
                try:
                    self._states *= self._widths.node_width(node)
                except ValueError as exc:
                    raise InvalidRequest(str(exc), param=path) from exc
                self._enter(self._states, path)
        ref = node.get("$ref")
        if isinstance(ref, str):
            return self._add_rule(rule_name, self._resolve_ref(ref))
        for key in _UNIONS:
            if key in node:
                alts = node[key]
                alts = [a for a in alts if a is not False]  # they match nothing
                if not alts:
                    raise UnsupportedParameter(f"every alternative of '{key}' is false",
                                               param=f"{path}.{key}")
                if key == "oneOf":
                    alts = self._exclusive(alts, node, path)
                return self._add_rule(rule_name, " | ".join(
                    self.visit(self._remember(alt, node, f"{key}.{i}"), f"{rule_name}-{i}")
                    for i, alt in enumerate(alts)))
        return self._plain(node, name, path)

    # -- combining: allOf, and keywords beside a union or a $ref -----------------------------

    def _combined(self, schema: dict[str, Any], path: str, depth: int) -> Any:
        """`schema` with its `allOf` merged in, and its other keywords distributed into its
        union or merged with its `$ref`'s target; `schema` itself when there is nothing to
        combine. `False` when nothing can satisfy it."""
        unevaluated = {k: schema[k] for k in _UNEVALUATED if k in schema}
        rest = {k: v for k, v in schema.items() if k not in _COMBINERS and k not in unevaluated
                and k not in _CONDITIONS}
        constraining = any(k not in ANNOTATIONS for k in rest) or bool(unevaluated)
        parts: list[Any] = []
        if "not" in schema:
            alts = self._negation(schema["not"], f"{path}.not")
            parts.append({"anyOf": alts} if alts else False)
        if "if" in schema:  # (if and then) or (not if and else): never both
            branches = [{"allOf": [schema["if"], schema.get("then", True)]}]
            alts = self._negation(schema["if"], f"{path}.if")
            if alts:
                branches.append({"allOf": [{"anyOf": alts}, schema.get("else", True)]})
            parts.append({"anyOf": branches})
        if "allOf" in schema:
            parts += schema["allOf"]
        if isinstance(schema.get("$ref"), str) and (constraining or parts):
            parts.append({"$ref": schema["$ref"]})
        unions = [k for k in _UNIONS if k in schema]
        if len(unions) == 2:
            parts.append({"anyOf": schema["anyOf"]})
            unions = ["oneOf"]
        if not parts and (not unions or not constraining):
            return _fold_unevaluated(rest, unevaluated) if unevaluated else schema
        if depth > _MAX_INLINE:
            raise UnsupportedParameter("allOf or a $ref beside other keywords recurses "
                                       "too deeply to be merged", param=path)
        if unions:
            parts.append({unions[0]: schema[unions[0]]})
        result: Any = rest
        try:
            for part in parts:
                result = self._conjoin(result, part, path, depth)
        except Unmergeable as exc:
            raise _schema_error(exc.keyword, f"allOf: {exc}", path) from exc
        return _fold_unevaluated(result, unevaluated) if unevaluated else result

    def _conjoin(self, a: Any, b: Any, path: str, depth: int) -> Any:
        """The schema of what satisfies both (either may be a union: distributed)."""
        if a is False or b is False:
            return False
        a, b = self._flat(a, path, depth), self._flat(b, path, depth)
        if a is False or b is False:
            return False
        for x, y in ((a, b), (b, a)):
            for key in _UNIONS:
                if isinstance(x, dict) and key in x:
                    kept, why = [], None
                    for alt in x[key]:
                        try:  # an alternative that cannot hold beside the rest: left out
                            merged = self._without_empty_properties(
                                self._conjoin(alt, y, path, depth + 1), path, depth)
                        except Unmergeable as exc:
                            merged, why = False, exc
                        if merged is not False and self._may_hold(merged):
                            kept.append(merged)
                    if not kept:
                        if why is not None:
                            raise why
                        return False
                    if len(kept) > MAX_ALTERNATIVES:
                        raise InvalidRequest(f"combining these schemas gives over "
                                             f"{MAX_ALTERNATIVES} alternatives", param=path)
                    return {key: kept}
        return merge(a, b)

    def _without_empty_properties(self, node: Any, path: str, depth: int) -> Any:
        """`node` with each property whose merged schemas share no value (two types, enums
        or constants apart) made absent, which is what JSON Schema makes of it; False when
        such a property is required. Merging keeps properties as `allOf`s to be combined
        where they are written, so an alternative a `not` made (`zip` that is not a string,
        beside `zip: string`) would otherwise be refused there instead of left out here."""
        if not isinstance(node, dict):
            return node
        given = node.get("properties")
        props: dict[str, Any] = given if isinstance(given, dict) else {}
        failing: dict[str, Any] = node.get(_NOT_PROPS) or {}  # present, failing these
        kept = dict(props)
        for key in {*props, *failing}:
            parts = [props[key]] if key in props else []
            if key in failing:
                parts.append({"not": failing[key]})
            sub = parts[0] if len(parts) == 1 else {"allOf": parts}
            if not (isinstance(sub, dict) and ("allOf" in sub or "not" in sub)):
                continue
            try:
                flat = self._combined(sub, path, depth + 1)
            except UnsupportedParameter as exc:
                cause = exc.__cause__
                if not (isinstance(cause, Unmergeable) and cause.keyword in _CONFLICTS):
                    continue  # refused where it is written, naming what it is
                flat = False
            if flat is False:
                if key in failing or key in (node.get("required") or ()):
                    return False
                kept[key] = False
        return node if kept == props else {**node, "properties": kept}

    def _flat(self, schema: Any, path: str, depth: int) -> Any:
        """`schema` as a node without `allOf`, `$ref` or keywords beside a union."""
        if schema is True:
            return {}
        if not isinstance(schema, dict):
            return schema
        check_node(schema, path)
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if depth > _MAX_INLINE:
                raise UnsupportedParameter("allOf or a $ref beside other keywords recurses "
                                           "too deeply to be merged", param=path)
            target = self._target(ref)
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self._conjoin(target, rest, path, depth + 1) if rest else \
                self._flat(target, path, depth + 1)
        node = self._combined(schema, path, depth + 1)
        return node

    def _may_hold(self, node: Any) -> bool:
        """False for a merged alternative whose enum/const keeps no value."""
        values = _literal_values(node) if isinstance(node, dict) else None
        if values is None or any(k in node for k in (*_UNIONS, "$ref")):
            return True
        rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
        return any(self._valid(v, rest) and self._internal_ok(v, rest) for v in values)

    def _exclusive(self, alts: list[Any], node: dict[str, Any], path: str) -> list[Any]:
        """A oneOf's alternatives, each written so that it matches where no other does.

        Alternatives whose grammars write nothing another accepts are kept as they are.
        Where two may overlap, each is written as itself and not the others it may overlap
        (`allOf: [A, {not: B}]`), which `not` writes exactly or narrower: what comes out
        matches exactly one. Where a `not` cannot be written, or the overlapping pairs are
        too many to spell out, the oneOf is refused naming the first pair."""
        flat = [self._flat(a, path, 0) for a in alts]
        overlaps = [(i, j) for i, a in enumerate(flat) for j, b in enumerate(flat)
                    if i != j and a is not False and b is not False
                    and not self._excludes(a, b, 0)]
        if not overlaps:
            return alts
        i, j = overlaps[0]
        refusal = UnsupportedParameter(
            f"oneOf: alternatives {min(i, j)} and {max(i, j)} may both match one value, and "
            "one cannot be written without the other (say which with a property of "
            "different 'const' values, or use anyOf)", param=f"{path}.oneOf")
        if len(overlaps) > 2 * _MAX_ONEOF_OVERLAPS:
            raise refusal
        others: dict[int, list[int]] = {}
        for i, j in overlaps:
            others.setdefault(i, []).append(j)
        written: list[Any] = []
        for i, alt in enumerate(alts):
            if i not in others:
                written.append(alt)
                continue
            alone = {"allOf": [alt, *({"not": alts[j]} for j in others[i])]}
            try:
                combined = self._combined(alone, f"{path}.oneOf.{i}", 0)
            except (UnsupportedParameter, Unmergeable) as exc:
                raise refusal from exc
            if combined is not False:
                self._remember(alone, node, f"oneOf.{i}")
                written.append(alone)
        if not written:
            raise UnsupportedParameter("no value matches exactly one alternative of the oneOf",
                                       param=f"{path}.oneOf")
        return written

    def _excludes(self, a: Any, b: Any, depth: int) -> bool:
        """Whether no text a's grammar writes is valid for b (False when unsure)."""
        if depth > 8:
            return False
        a, b = self._flat(a, "", 0), self._flat(b, "", 0)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return a is False or b is False
        if any(k in a for k in _COMBINERS):
            alts = a.get("anyOf") or a.get("oneOf")
            return isinstance(alts, list) and all(
                self._excludes(self._flat(x, "", 0), b, depth + 1) for x in alts)
        if any(k in b for k in _COMBINERS):
            alts = b.get("anyOf") or b.get("oneOf")
            return isinstance(alts, list) and all(
                self._excludes(a, self._flat(y, "", 0), depth + 1) for y in alts)
        values = _literal_values(a)
        if values is not None:
            return not any(self._valid(v, b) for v in values)
        values = _literal_values(b)
        if values is not None and not any(self._valid(v, a) for v in values):
            return True
        kinds = set(self._kinds(a))
        if "number" in kinds:
            kinds.add("integer")  # a number grammar writes integers too
        allowed = types_of(b)
        if allowed is not None and not kinds & allowed:
            return True
        if kinds <= {"object"} and self._object_excludes(a, b, depth):
            return True
        if kinds <= {"string"} and ({"pattern", "format"} & (a.keys() | b.keys())):
            try:
                return sl.both(_string_language(a), _string_language(b)).empty
            except ValueError:
                return False
        if kinds <= {"integer", "number"} and any(k in b for k in BOUNDS):
            x, y = Bounds.of(a), Bounds.of(b)
            return x.hi < y.lo or y.hi < x.lo or (x.hi == y.lo and (x.hi_open or y.lo_open)) \
                or (y.hi == x.lo and (y.hi_open or x.lo_open))
        return False

    def _object_excludes(self, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
        props_a = a.get("properties") or {}
        written = set(props_a) | set(a.get("required") or [])
        extra = _writes_extra_keys(a)
        for key in b.get("required") or []:
            if key not in written and not extra:
                return True  # b needs a key a never writes
        for key in a.get("required") or []:
            if key in (b.get("properties") or {}):
                if self._excludes(props_a.get(key, {}), b["properties"][key], depth + 1):
                    return True
            elif b.get("additionalProperties") is False and "patternProperties" not in b:
                return True  # a always writes a key b forbids
        return False

    def _valid(self, value: Any, schema: dict[str, Any]) -> bool:
        """Whether `value` is valid for `schema` (its $refs resolved in the request), read
        in the draft the request names (2020-12 unless it says), or draft 7 where the schema
        uses draft 7's own keywords."""
        cls: Any = self._validator
        if cls in (jsonschema.Draft202012Validator, jsonschema.Draft201909Validator) and (
                "dependencies" in schema or isinstance(schema.get("items"), list)):
            cls = jsonschema.Draft7Validator
        try:
            validator = cls(schema, registry=self._registry,
                            format_checker=cls.FORMAT_CHECKER)
            return bool(validator.is_valid(value))
        except Exception as exc:  # a schema jsonschema cannot read: it cannot vouch either
            raise UnsupportedParameter(f"cannot check 'enum'/'const' values against this "
                                       f"schema: {str(exc)[:120]}", param=self._param) from exc

    # -- one schema, no combinators -----------------------------------------------------------

    def _negation(self, schema: Any, where: str) -> list[Any]:
        """Schemas whose union is what `schema` refuses: the negation of each of its
        keywords (a schema is a conjunction of them), where a grammar can write it."""
        flat = self._flat(schema, where, 0)
        if flat is False:
            return [{}]
        if not isinstance(flat, dict):
            raise InvalidRequest("'not' must be a schema", param=where)
        if "anyOf" in flat:  # neither alternative
            return [{"allOf": [{"not": alt} for alt in flat["anyOf"]]}]
        if "oneOf" in flat:
            raise UnsupportedParameter("'not' of a oneOf cannot be enforced here", param=where)
        out: list[Any] = []
        for key, value in flat.items():
            if key in ANNOTATIONS:
                continue
            if key == "type":
                gone = types_of(flat) or set()
                left = [t for t in _KIND_ORDER if t not in gone and t != "integer"]
                if "integer" in gone and "number" not in gone:
                    out.append({"type": "number", _FRACTIONAL: True})
                    left.remove("number")
                if left:
                    out.append({"type": left})
            elif key in ("enum", "const"):
                out += self._not_values(value if key == "enum" else [value], where)
            elif key == "pattern":
                out.append({"type": "string", _NOT_PATTERN: value})
            elif key == "required":
                out += [{"type": "object", _NOT_KEY: name} for name in value]
            elif key == "properties":
                # Not `properties`: a negation evaluates nothing (unevaluatedProperties).
                out += [{"type": "object", "required": [name], _NOT_PROPS: {name: sub}}
                        for name, sub in value.items()]
            elif key == "items" and isinstance(value, (dict, bool)):
                out.append({"type": "array", "contains": {"not": value}})
            elif key in _OPPOSITE:
                kind, other, shift = _OPPOSITE[key]
                if shift == 0:
                    out.append({"type": kind, other: value})
                elif value + shift >= 0:
                    out.append({"type": kind, other: value + shift})
            else:
                raise UnsupportedParameter(f"'not' of '{key}' cannot be enforced here",
                                           param=where)
        return out

    def _not_values(self, values: list[Any], where: str) -> list[Any]:
        """Every value but these: by type, strings through the string automaton."""
        texts = [v for v in values if isinstance(v, str)]
        if any(isinstance(v, (dict, list)) or (isinstance(v, (int, float)) and
                                               not isinstance(v, bool)) for v in values):
            raise UnsupportedParameter("'not' of numbers, arrays or objects cannot be "
                                       "enforced here", param=where)
        out: list[Any] = [{"type": ["object", "array", "number"]},
                          {"type": "string", _NOT_TEXTS: texts} if texts else {"type": "string"}]
        if None not in values:
            out.append({"type": "null"})
        booleans = [b for b in (False, True) if not any(v is b for v in values)]
        if booleans:
            out.append({"enum": booleans})
        return out

    def _internal_ok(self, value: Any, node: dict[str, Any]) -> bool:
        """Whether `value` keeps what a folded `not` says (jsonschema cannot see it)."""
        if isinstance(value, str):
            if value in node.get(_NOT_TEXTS, ()):
                return False
            if _NOT_PATTERN in node and sl.pattern(node[_NOT_PATTERN]).matches(value):
                return False
        if isinstance(value, dict) and node.get(_NOT_KEY) in value:
            return False
        if isinstance(value, dict) and any(k in value and self._valid(value[k], sub)
                                           for k, sub in node.get(_NOT_PROPS, {}).items()):
            return False
        return not (node.get(_FRACTIONAL) and _is_kind(value, "integer"))

    def _plain(self, node: dict[str, Any], name: str, path: str) -> str:
        rule_name = name or "root"
        values = _literal_values(node)
        if values is not None:
            key = "const" if "const" in node else "enum"
            rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
            kept = [v for v in values if self._valid(v, rest) and self._internal_ok(v, rest)]
            if not kept:
                others = sorted(k for k in rest if k not in ANNOTATIONS) or ["type"]
                raise UnsupportedParameter(
                    f"no value of '{key}' is valid for the schema's {', '.join(others)}: "
                    "nothing could be written", param=f"{path}.{key}")
            return self._add_rule(rule_name, " | ".join(
                self._generate_constant_rule(v) for v in kept))
        kinds = self._kinds(node)
        if not kinds:
            raise UnsupportedParameter("'type' allows no value here", param=f"{path}.type")
        if len(kinds) == 1:
            rule = self._kind_rule(kinds[0], node, name, path)
            return rule if rule == rule_name or rule_name != "root" else \
                self._add_rule(rule_name, rule)
        rules = [self._kind_rule(kind, node, f"{rule_name}-{kind}", path) for kind in kinds]
        return self._add_rule(rule_name, " | ".join(rules))

    def _kinds(self, node: dict[str, Any]) -> list[str]:
        """The JSON types the grammar writes for `node`, in a fixed order."""
        declared = types_of(node)
        if declared is not None:
            if "number" in declared:
                declared.discard("integer")
            return [k for k in _KIND_ORDER if k in declared]
        keys = node.keys() - {"format"}
        inferred = [k for k in _KIND_ORDER if k != "integer" and _TYPE_KEYWORDS.get(k, set())
                    & keys]
        fmt = _format_of(node)
        if fmt is not None:
            kind = "integer" if fmt in _INT_FORMATS else "number" if fmt in _NUMBER_FORMATS \
                else "string"
            if kind not in inferred and not (kind == "integer" and "number" in inferred):
                inferred.append(kind)
        inferred = [k for k in _KIND_ORDER if k in inferred]
        return inferred or ["object"]  # what the port makes of a schema that says nothing

    def _kind_rule(self, kind: str, node: dict[str, Any], name: str, path: str) -> str:
        if kind == "null":
            return str(self._add_primitive("null", PRIMITIVE_RULES["null"]))
        if kind == "boolean":
            return str(self._add_primitive("boolean", PRIMITIVE_RULES["boolean"]))
        if kind in ("integer", "number"):
            return self._number_rule(kind, node, name, path)
        if kind == "string":
            return self._string_rule(node, name, path)
        if kind == "array":
            return self._array_rule(node, name, path)
        return self._object_rule(node, name, path)

    # -- numbers ------------------------------------------------------------------------

    def _number_rule(self, kind: str, node: dict[str, Any], name: str, path: str) -> str:
        fmt = _format_of(node)
        limits = dict(node)
        if fmt in _INT_FORMATS:
            lo, hi = _INT_FORMATS[fmt]
            kind = "integer"
            limits["minimum"] = max(lo, node.get("minimum", lo))
            limits["maximum"] = min(hi, node.get("maximum", hi))
        elif fmt is not None and fmt not in _NUMBER_FORMATS:
            raise UnsupportedParameter(f"format '{fmt}' cannot be enforced on numbers",
                                       param=f"{path}.format")
        if node.get(_FRACTIONAL):
            if any(k in limits for k in (*BOUNDS, "multipleOf")) or fmt is not None:
                raise UnsupportedParameter("'not' integer beside other number keywords "
                                           "cannot be enforced here", param=f"{path}.not")
            nonzero = self._add_rule("fraction-nonzero", NONZERO_FRACTION_RULE)
            integral = self._add_primitive("integral-part", PRIMITIVE_RULES["integral-part"])
            return self._add_rule(f"{name or 'root'}-fractional",
                                  f'"-"? {integral} "." {nonzero} space')
        if "multipleOf" in node:
            return self._multiple_rule(node, limits, name, path)
        if not any(k in limits for k in BOUNDS) and (kind == "integer" or fmt is None):
            return str(self._add_primitive(kind, PRIMITIVE_RULES[kind]))
        bounds = Bounds.of(limits)
        if kind == "integer":
            lo, hi = bounds.integers()
            if lo > hi:
                raise UnsupportedParameter(f"integer range [{lo}, {hi}] is empty", param=path)
            return self._add_rule(f"{name or 'root'}-int", f"({int_range(lo, hi)}) space")
        if not any(k in limits for k in BOUNDS):  # a double: a number without exponent
            bounds = Bounds(-INT_CAP, False, INT_CAP, False)
        fraction = self._add_rule("fraction", FRACTION_RULE)
        nonzero = self._add_rule("fraction-nonzero", NONZERO_FRACTION_RULE)
        body = number_range(bounds, fraction, nonzero)
        if not body:
            raise UnsupportedParameter(
                "no number this grammar can write lies within these bounds (only whole "
                "units inside them are written)", param=path)
        return self._add_rule(f"{name or 'root'}-num", f"({body}) space")

    def _multiple_rule(self, node: dict[str, Any], limits: dict[str, Any], name: str,
                       path: str) -> str:
        """Integer multiples of a whole `multipleOf`: digits read as a remainder machine."""
        k = node["multipleOf"]
        where = f"{path}.multipleOf"
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0:
            raise InvalidRequest("'multipleOf' must be a number above 0", param=where)
        if not float(k).is_integer() or k > MAX_MULTIPLE:
            raise UnsupportedParameter(f"'multipleOf' is enforced for whole numbers up to "
                                       f"{MAX_MULTIPLE}", param=where)
        if any(b in limits for b in BOUNDS):
            raise UnsupportedParameter("'multipleOf' beside bounds cannot be enforced here",
                                       param=where)
        k = int(k)
        base = f"{name or 'root'}-x{k}"
        if k == 1:
            return str(self._add_primitive("integer", PRIMITIVE_RULES["integer"]))
        keys = [self._reserve(f"{base}-r{r}") for r in range(k)]
        for r, key in enumerate(keys):
            by: dict[int, list[int]] = {}
            for d in range(10):
                by.setdefault((10 * r + d) % k, []).append(d)
            alts = " | ".join(f"{_digits(ds)} {keys[t]}" for t, ds in sorted(by.items()))
            self._set(key, f"({alts})?" if r == 0 else f"({alts})")
        first: dict[int, list[int]] = {}
        for d in range(1, 10):
            first.setdefault(d % k, []).append(d)
        start = " | ".join(f"{_digits(ds)} {keys[t]}" for t, ds in sorted(first.items()))
        return self._add_rule(base, f'("0" | "-"? ({start})) space')

    # -- strings ------------------------------------------------------------------------

    def _string_rule(self, node: dict[str, Any], name: str, path: str) -> str:
        fmt = _format_of(node)
        if fmt is not None and fmt not in _FORMATS and fmt not in _INT_FORMATS:
            raise UnsupportedParameter(f"string format '{fmt}' cannot be enforced here",
                                       param=f"{path}.format")
        if "pattern" not in node and fmt not in _FORMATS and _NOT_TEXTS not in node and \
                _NOT_PATTERN not in node:
            if "minLength" in node or "maxLength" in node:
                char = self._add_primitive("char", PRIMITIVE_RULES["char"])
                body = repeat(char, node.get("minLength", 0), node.get("maxLength"),
                              add=self._add_rule, name=char)
                return self._add_rule(name or "root", rf'"\"" {body} "\"" space')
            return str(self._add_primitive("string", PRIMITIVE_RULES["string"]))
        # The same keywords are the same automaton: a schema with eight `format: uri` fields
        # writes its ~250 states once, not eight times.
        sig = json.dumps([node.get(k) for k in _STRING_KEYWORDS], default=str)
        if sig in self._strings:
            return self._strings[sig]
        try:
            language = _string_language(node)
        except ValueError as exc:
            where = "pattern" if "pattern" in node else "format"
            raise UnsupportedParameter(str(exc), param=f"{path}.{where}") from exc
        if language.empty:
            raise UnsupportedParameter("no string satisfies the pattern, format and lengths "
                                       "together", param=path)
        key = self._quoted(language, name or "root")
        if key != "root":
            self._strings[sig] = key
        return key

    def _quoted(self, language: sl.Dfa, name: str) -> str:
        """The rule writing a JSON string whose text is one of `language`'s."""
        if not language.moves[0]:
            return self._add_rule(name, r'"\"" "\"" space')
        # States are named by a short prefix of their own: every transition repeats a name.
        self._automata += 1
        keys: list[str | None] = [self._reserve(f"a{self._automata}-{q}") if row else None
                                  for q, row in enumerate(language.moves)]
        names = [k or "" for k in keys]
        for key, body in zip(keys, sl.rules(language, names, self._choice), strict=True):
            if key is not None:
                self._set(key, body)
        return self._add_rule(name, rf'"\"" {keys[0]} "\"" space')

    def _choice(self, body: str) -> str:
        """A rule for one character choice, shared by every automaton that writes it."""
        key = self._choices.get(body)
        if key is None:
            key = self._choices[body] = self._add_rule(f"char-{len(self._choices)}", body)
        return key

    # -- arrays -------------------------------------------------------------------------

    def _repeat(self, item: str, lo: int, hi: int | None, *, lead_comma: bool = False) -> str:
        """lo to hi of `item` separated by commas (each after a comma, with `lead_comma`),
        in rules that grow with the log of the count (engine/constrained/repetition.py)."""
        if hi == 0:
            return ""
        after = self._add_rule(f"{item}-next", f'"," space {item}')
        if lead_comma:
            return repeat(after, lo, hi, add=self._add_rule, name=after)
        rest = repeat(after, max(0, lo - 1), None if hi is None else hi - 1,
                      add=self._add_rule, name=after)
        first = f"{item} {rest}".rstrip()
        return first if lo else f"({first})?"

    def _array_rule(self, node: dict[str, Any], name: str, path: str) -> str:
        items = node.get("items")
        if isinstance(node.get("prefixItems"), list):
            tuple_, extra = node["prefixItems"], items
        elif isinstance(items, list):  # draft 7: items as a tuple, then additionalItems
            tuple_, extra = items, node.get("additionalItems")
        else:  # no tuple: items absent or true is any value
            tuple_, extra = [], True if items is None else items
        lo, hi = node.get("minItems", 0), node.get("maxItems")
        if "contains" in node:
            tuple_, extra = self._containing(node, tuple_, extra, lo, hi, path)
            lo = max(lo, len(tuple_))
        written = tuple_ if hi is None else tuple_[:hi]
        if written and any(s is False for s in written):
            first_false = next(i for i, s in enumerate(written) if s is False)
            written = written[:first_false]
            extra = False
        if extra is None and lo > len(written):
            extra = {}  # more items are needed than the tuple has: any value
        elif extra is None or len(written) < len(tuple_):
            extra = False
        more_lo = max(0, lo - len(written))
        more_hi = None if hi is None else max(0, hi - len(written))
        if extra is False:
            more_hi = 0
        if more_lo > (more_hi if more_hi is not None else more_lo):
            raise UnsupportedParameter("no array satisfies these items and lengths",
                                       param=path)
        unique = node.get("uniqueItems") is True and (len(written) + (more_hi or 0) > 1
                                                       or more_hi is None)
        base = name or "root"
        parts = [self.visit(self._remember(s, node, f"prefixItems.{i}"), f"{base}-tuple-{i}")
                 for i, s in enumerate(written)]
        if unique and written:
            raise UnsupportedParameter("'uniqueItems' beside 'prefixItems' cannot be enforced "
                                       "here", param=f"{path}.uniqueItems")
        body = ' "," space '.join(parts)
        if more_hi != 0:
            item_schema = extra if isinstance(extra, dict) else {}
            if item_schema == {} and node.get("items") == {}:
                item_schema = {"type": "object"}  # what the port makes of {} anywhere else
            self._remember(item_schema, node, "items")
            if unique:
                return self._unique_array(item_schema, more_lo, more_hi, base, path)
            item = self._value(extra if extra is True else item_schema, f"{base}-item")
            if parts:
                more = self._repeat(item, more_lo, more_hi, lead_comma=True)
                body = f"{body} {more}" if more else body
            else:
                body = self._repeat(item, more_lo, more_hi)
        return self._add_rule(base, f'"[" space {body} "]" space'.replace("space  ", "space "))

    def _containing(self, node: dict[str, Any], tuple_: list[Any], extra: Any, lo: int,
                    hi: int | None, path: str) -> tuple[list[Any], Any]:
        """`contains`: the first minContains items are written to match it (the rest may or
        may not); maxContains only where the array cannot hold more items than it allows."""
        where = f"{path}.contains"
        low = node.get("minContains", 1)
        high = node.get("maxContains")
        if high is not None and (hi is None or hi > high):
            raise UnsupportedParameter("'maxContains' below the array's longest length "
                                       "cannot be enforced here", param=f"{path}.maxContains")
        if low == 0:
            return tuple_, extra
        if tuple_:
            raise UnsupportedParameter("'contains' beside a tuple cannot be enforced here",
                                       param=where)
        if (hi is not None and hi < low) or (high is not None and high < low):
            raise UnsupportedParameter("no array holds that many items matching 'contains'",
                                       param=where)
        each = extra if isinstance(extra, dict) else {}
        if extra is False:
            raise UnsupportedParameter("'contains' where 'items' allows none", param=where)
        lead = self._remember({"allOf": [each, node["contains"]]}, node, "contains")
        return [lead] * low, each

    def _unique_array(self, item: Any, lo: int, hi: int | None, name: str, path: str) -> str:
        """Distinct items from a finite set, written in the set's order: never a repeat."""
        flat = self._flat(item, path, 0)
        values = _literal_values(flat) if isinstance(flat, dict) else None
        if values is None and isinstance(flat, dict) and self._kinds(flat) == ["boolean"]:
            values = [False, True]
        if values is None:
            raise UnsupportedParameter(
                "'uniqueItems' is enforced only when items take a few fixed values "
                "(an enum, a const or a boolean)", param=f"{path}.uniqueItems")
        others = {k: v2 for k, v2 in flat.items() if k not in ("enum", "const")}
        values = [v for v in values if self._valid(v, others) and self._internal_ok(v, others)]
        distinct: list[Any] = []
        for v in values:
            if not any(_json_equal(v, w) for w in distinct):
                distinct.append(v)
        if len(distinct) > MAX_UNIQUE_VALUES:
            raise UnsupportedParameter(f"'uniqueItems' over more than {MAX_UNIQUE_VALUES} "
                                       "values cannot be enforced here",
                                       param=f"{path}.uniqueItems")
        top = len(distinct) if hi is None else min(hi, len(distinct))
        if lo > top:
            raise UnsupportedParameter("fewer distinct values than 'minItems' asks for",
                                       param=f"{path}.minItems")
        literals = [self._generate_constant_rule(v) for v in distinct]
        # rule (i, n): the rest of the array from value i on, n items written so far.
        memo: dict[tuple[int, int], str] = {}

        def rest(i: int, n: int, first: bool) -> str:
            alts = []
            if n >= lo:
                alts.append("")
            if n < top:
                for j in range(i, len(distinct)):
                    if len(distinct) - j < lo - n:
                        break
                    lead = literals[j] if first else f'"," space {literals[j]}'
                    alts.append(f"{lead} space {follow(j + 1, n + 1)}".rstrip())
            body = " | ".join(a for a in alts if a)
            return f"({body})?" if "" in alts and body else f"({body})" if body else ""

        def follow(i: int, n: int) -> str:
            if n >= top or i >= len(distinct):
                return ""
            if (i, n) not in memo:
                key = self._reserve(f"{name}-u{i}-{n}")
                memo[(i, n)] = key
                self._set(key, rest(i, n, False) or '""')
            return memo[(i, n)]

        return self._add_rule(name, f'"[" space {rest(0, 0, True)} "]" space')

    # -- objects ------------------------------------------------------------------------

    def _object_rule(self, node: dict[str, Any], name: str, path: str) -> str:
        props: dict[str, Any] = dict(node.get("properties") or {})
        required = list(dict.fromkeys(node.get("required") or []))
        extra = node.get("additionalProperties")
        patterns: dict[str, Any] = dict(node.get("patternProperties") or {})
        deps = _dependencies(node, path)
        base = name or "root"
        if not props and not patterns and extra in (None, True) and not any(
                k in node for k in ("propertyNames", "minProperties", "maxProperties",
                                    _NOT_KEY, _NOT_PROPS)):
            extra = True  # an object that names no key: any keys, as the port wrote it
            if not required and not deps:
                return str(self._add_primitive("object", PRIMITIVE_RULES["object"]))
        languages = {}
        for pattern in patterns:
            check_pattern(pattern, f"{path}.patternProperties")
            try:
                languages[pattern] = sl.pattern(pattern)
            except ValueError as exc:
                raise UnsupportedParameter(str(exc), param=f"{path}.patternProperties") \
                    from exc
        names = self._key_language(node, path)
        # Every name that may be written by name: listed, required, or depended on.
        named = list(props)  # triggers too: an extra key could not require its dependencies
        for key in [*required, *deps, *(k for ks in deps.values() for k in ks)]:
            if key not in named:
                named.append(key)
        for key in list(named):
            if (names is not None and not names.matches(key)) or key == node.get(_NOT_KEY):
                if key in required:
                    raise UnsupportedParameter(f"required property '{key}' is not allowed by "
                                               "'propertyNames' or 'not'",
                                               param=f"{path}.required")
                named.remove(key)
                props.pop(key, None)
        values: dict[str, Any] = {}
        for key in named:
            rules = [props[key]] if key in props else []
            rules += [sub for p, sub in patterns.items() if languages[p].matches(key)]
            if key not in props and len(rules) == 0:
                rules = [{} if extra in (None, True) else extra]
            if key in node.get(_NOT_PROPS, {}):
                rules.append({"not": node[_NOT_PROPS][key]})
            if any(r is False for r in rules):
                if key in required:
                    raise UnsupportedParameter(f"required property '{key}' is not allowed by "
                                               "the object's other keywords",
                                               param=f"{path}.required")
                continue
            values[key] = rules[0] if len(rules) == 1 else {"allOf": rules}
            self._remember(values[key], node, f"properties.{key}" if key in props else
                           f"required.{key}")
        for key in required:
            if key not in values:
                raise UnsupportedParameter(f"required property '{key}' cannot be written",
                                           param=f"{path}.required")
        if extra is None and (node.get("minProperties") or 0) > len(values):
            extra = True  # absent means any: the count needs keys beyond the named ones
        # Extra keys: by pattern (matching no other pattern), then additional ones, never a
        # named key (it would carry a value its own schema refuses), nor a forbidden one.
        others = sl.literals([*named, *([node[_NOT_KEY]] if _NOT_KEY in node else [])])
        extras: list[tuple[sl.Dfa, Any, str]] = []
        for i, (pattern, sub) in enumerate(patterns.items()):
            if sub is False:
                continue
            keys = sl.without(languages[pattern], others)
            for other, lang in languages.items():
                if other != pattern:
                    keys = sl.without(keys, lang)
            if names is not None:
                keys = sl.both(keys, names)
            if not keys.empty:
                extras.append((keys, sub, f"patternProperties.{i}"))
        if extra not in (None, False):
            keys = sl.without(sl.anything(), others)
            for lang in languages.values():
                keys = sl.without(keys, lang)
            if names is not None:
                keys = sl.both(keys, names)
            if not keys.empty:
                extras.append((keys, {} if extra is True else extra, "additionalProperties"))
        kv: dict[str, str] = {}
        for key, sub in values.items():
            value = self._value(sub, f"{base}-{key}")
            literal = self._format_literal(json.dumps(key))
            kv[key] = self._add_rule(f"{base}-{key}-kv", f'{literal} space ":" space {value}')
        extra_kvs = []
        for i, (keys, sub, where) in enumerate(extras):
            self._remember(sub, node, where)
            value = self._value(sub, f"{base}-additional-{i}")
            key_rule = self._quoted(keys, f"{base}-key-{i}")
            extra_kvs.append(self._add_rule(f"{base}-additional-{i}-kv",
                                            f'{key_rule} ":" space {value}'))
        return self._add_rule(base, self._object_body(node, values, kv, required, deps,
                                                      extra_kvs, base, path))

    def _key_language(self, node: dict[str, Any], path: str) -> sl.Dfa | None:
        """The keys `propertyNames` allows (None: any)."""
        if "propertyNames" not in node:
            return None
        where = f"{path}.propertyNames"
        names = self._flat(node["propertyNames"], where, 0)
        if names is False:
            return sl.literals([])
        if not isinstance(names, dict) or any(k not in ANNOTATIONS and k not in _KEY_KEYWORDS
                                              for k in names):
            raise UnsupportedParameter("'propertyNames' is enforced only with string keywords "
                                       "(pattern, format, lengths, enum, const)", param=where)
        if "string" not in (types_of(names) or {"string"}):
            return sl.literals([])
        try:
            language = _string_language(names)
        except ValueError as exc:
            raise UnsupportedParameter(str(exc), param=where) from exc
        values = _literal_values(names)
        if values is not None:
            language = sl.both(language, sl.literals([v for v in values if isinstance(v, str)]))
        return language

    def _value(self, schema: Any, name: str) -> str:
        """A property's value: any JSON value where its schema says nothing."""
        if schema is True or (isinstance(schema, dict) and all(k in ANNOTATIONS
                                                                for k in schema)):
            return str(self._add_primitive("value", PRIMITIVE_RULES["value"]))
        return self.visit(schema, name)

    def _object_body(self, node: dict[str, Any], values: dict[str, Any], kv: dict[str, str],
                     required: list[str], deps: dict[str, list[str]], extra_kvs: list[str],
                     name: str, path: str) -> str:
        """Required properties first, then optional ones (those that require others before
        them), then extra keys; `dependentRequired` followed by tracking, per position, which
        names an earlier choice made required."""
        need = set(required)
        changed = True
        while changed:  # a required property's dependencies are required too
            changed = False
            for key in list(need):
                for dep in deps.get(key, []):
                    if dep not in need:
                        need.add(dep)
                        changed = True
        def closure(key: str) -> set[str]:
            out, todo = {key}, [key]
            while todo:
                for dep in deps.get(todo.pop(), []):
                    if dep not in out:
                        out.add(dep)
                        todo.append(dep)
            return out

        for key in [k for k in values if k not in need and not closure(k) <= values.keys()]:
            values = {k: v for k, v in values.items() if k != key}  # needs what cannot be
        order = [k for k in values if k in need]
        triggers = [k for k in values if k not in need and deps.get(k)]
        if len(triggers) > MAX_DEPENDENCIES:
            raise UnsupportedParameter(f"'dependentRequired' on more than {MAX_DEPENDENCIES} "
                                       "optional properties cannot be enforced here",
                                       param=f"{path}.dependentRequired")
        placed = set(order)
        for key in triggers:  # a trigger before what it requires
            order.append(key)
            placed.add(key)
            for dep in deps[key]:
                if dep in values and dep in placed and dep not in need and \
                        order.index(dep) < order.index(key):
                    raise UnsupportedParameter("'dependentRequired' whose properties require "
                                               "each other cannot be enforced here",
                                               param=f"{path}.dependentRequired")
        order += [k for k in values if k not in placed]
        for key in need:
            if key not in values:
                raise UnsupportedParameter(f"property '{key}' is required (by "
                                           "dependentRequired) but cannot be written",
                                           param=f"{path}.required")
        extras = ""
        if extra_kvs:
            extras = extra_kvs[0] if len(extra_kvs) == 1 else \
                self._add_rule(f"{name}-additional-kv", " | ".join(extra_kvs))
        # min/maxProperties: the count written so far is part of each position's state
        # (capped: past `low` with no `high` the count no longer matters).
        low, high = node.get("minProperties") or 0, node.get("maxProperties")
        if low <= len(need):
            low = 0
        if high is not None and not extras and high >= len(values):
            high = None
        cap = high if high is not None else max(low, 1)
        if cap > MAX_COUNTED_PROPERTIES:
            key = "maxProperties" if high is not None else "minProperties"
            raise UnsupportedParameter(f"'{key}' above {MAX_COUNTED_PROPERTIES} cannot be "
                                       "enforced here", param=f"{path}.{key}")
        memo: dict[tuple[int, frozenset[str], int], str | None] = {}

        def seq(i: int, must: frozenset[str], n: int) -> str | None:
            """Grammar for the properties from position i on, n written ("" when none may
            follow, None when no way on keeps the counts)."""
            lead_comma = n > 0
            if i == len(order):
                more = max(0, low - n)
                room = None if high is None else high - n
                if room is not None and room < more or (more and not extras):
                    return None
                if not extras or room == 0:
                    return ""
                if not lead_comma:
                    return self._repeat(extras, more, room)
                return self._repeat(extras, more, room, lead_comma=True)
            key = order[i]
            lead = f'"," space {kv[key]}' if lead_comma else kv[key]
            after = must | set(deps.get(key, []))
            rest = ref(i + 1, frozenset(after), n + 1) if high is None or n < high else None
            present = None if rest is None else f"{lead} {rest}".rstrip()
            if key in must:
                return present
            absent = ref(i + 1, must, n)
            if present is None or absent is None:
                return present if absent is None else absent
            return f"({present} | {absent})" if absent else f"({present})?"

        def ref(i: int, must: frozenset[str], n: int) -> str | None:
            """seq(i, …) as a rule of its own (each suffix written once)."""
            body_key = (i, must & frozenset(order[i:]), min(n, cap))
            if body_key not in memo:
                body = seq(*body_key)
                memo[body_key] = self._add_rule(f"{name}-r{i}-{body_key[2]}", body) \
                    if body else body
            return memo[body_key]

        inner = seq(0, frozenset(need), 0)
        if inner is None:
            raise UnsupportedParameter("no object satisfies these properties and counts",
                                       param=f"{path}.minProperties" if low else
                                       f"{path}.maxProperties")
        return f'"{{" space {inner} "}}" space' if inner else '"{" space "}" space'


def _writes_extra_keys(node: dict[str, Any]) -> bool:
    """Whether the object rule may write keys beyond the named ones (as `_object_rule`)."""
    extra = node.get("additionalProperties")
    if "patternProperties" in node or extra not in (None, False):
        return True
    props = node.get("properties") or {}
    return extra is None and (not props or (node.get("minProperties") or 0) > len(props))


def _fold_unevaluated(node: Any, unevaluated: dict[str, Any]) -> Any:
    """`unevaluatedProperties`/`Items` of a schema whose subschemas are merged in: what no
    merged keyword evaluates is what its own additionalProperties/items would take (per
    alternative of a union: the keys an alternative writes are those it evaluates)."""
    if not isinstance(node, dict):
        return node
    for key in _UNIONS:
        if key in node:
            return {key: [_fold_unevaluated(alt, unevaluated) for alt in node[key]]}
    out = dict(node)
    if "unevaluatedProperties" in unevaluated and "additionalProperties" not in out:
        out["additionalProperties"] = unevaluated["unevaluatedProperties"]
    if "unevaluatedItems" in unevaluated:
        if isinstance(out.get("items"), list):
            out.setdefault("additionalItems", unevaluated["unevaluatedItems"])
        else:
            out.setdefault("items", unevaluated["unevaluatedItems"])
    return out


# A bound's negation: (the type it constrains, the opposite keyword, the shift of a count).
_OPPOSITE = {"minimum": ("number", "exclusiveMaximum", 0),
             "maximum": ("number", "exclusiveMinimum", 0),
             "exclusiveMinimum": ("number", "maximum", 0),
             "exclusiveMaximum": ("number", "minimum", 0),
             "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
             "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
             "minProperties": ("object", "maxProperties", -1),
             "maxProperties": ("object", "minProperties", 1)}
_KEY_KEYWORDS = {"type", "pattern", "format", "minLength", "maxLength", "enum", "const"}


def _digits(ds: list[int]) -> str:
    return "[" + "".join(str(d) for d in ds) + "]"


def _is_kind(value: Any, kind: str) -> bool:
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


# Keywords whose values are schemas: one, a list, or a map of names to schemas.
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then",
               "else", "contains", "propertyNames", "unevaluatedItems",
               "unevaluatedProperties")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas",
               "dependencies")


def _pointer(document: Any, fragment: str, path: str) -> Any:
    """The node a URI fragment's JSON pointer names."""
    target = document
    if fragment:
        if not fragment.startswith("/"):
            raise UnsupportedParameter(f"'$ref' #{fragment[:80]} names an anchor: only JSON "
                                       "pointers (#/…) are resolved", param=path)
        for part in urllib.parse.unquote(fragment)[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise UnsupportedParameter(f"'$ref' #{fragment[:80]} points at nothing in "
                                           "the schema", param=path)
    return target


def _string_language(node: dict[str, Any]) -> sl.Dfa:
    """The texts a string schema allows (ValueError: a pattern outside the subset)."""
    language = sl.anything()
    if isinstance(node.get(_NOT_PATTERN), str):
        language = sl.without(language, sl.pattern(node[_NOT_PATTERN]))
    if node.get(_NOT_TEXTS):
        language = sl.without(language, sl.literals(node[_NOT_TEXTS]))
    if isinstance(node.get("pattern"), str):
        language = sl.both(language, sl.pattern(node["pattern"]))
    fmt = node.get("format")
    high = node.get("maxLength")
    if fmt in _FORMATS:
        language = sl.both(language, _format_language(fmt, high))
    low = node.get("minLength", 0)
    longest = language.longest() if high is not None else None
    if low > language.shortest() or (high is not None and (longest is None or longest > high)):
        language = sl.with_length(language, low, high)
    return language


def _format_language(fmt: str, high: int | None) -> sl.Dfa:
    """A format's texts; under a maxLength, a format of unbounded parts is written with
    parts short enough that its longest text fits (a length automaton over it would be
    its size times the length)."""
    bounded = _BOUNDED_FORMATS.get(fmt)
    if high is None or bounded is None:
        return sl.pattern(_FORMATS[fmt])
    # The longest text grows linearly with k: measured at 2 and 4, the largest k that fits.
    at2, at4 = (sl.pattern(bounded(k)).longest() or 0 for k in (2, 4))
    slope = max(1, (at4 - at2) // 2)
    k = min(_MAX_PART if "email" in fmt or "host" in fmt else _MAX_PART // 2,
            (high - at2) // slope + 2)
    while k >= 2:
        language = sl.pattern(bounded(k))
        longest = language.longest()
        if longest is not None and longest <= high:
            return language
        k -= 1
    return sl.pattern(_FORMATS[fmt])  # short lengths: cut by the length automaton


def _literal_values(node: dict[str, Any]) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    enum = node.get("enum")
    return list(enum) if isinstance(enum, list) else None


def _json_equal(a: Any, b: Any) -> bool:
    return bool(jsonschema._utils.equal(a, b))


def _dependencies(node: dict[str, Any], path: str) -> dict[str, list[str]]:
    """dependentRequired, and draft 7's dependencies in their array form."""
    deps: dict[str, list[str]] = {}
    for key in ("dependentRequired", "dependencies"):
        value = node.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InvalidRequest(f"'{key}' must be an object", param=f"{path}.{key}")
        for name, names in value.items():
            if isinstance(names, list) and all(isinstance(n, str) for n in names):
                deps.setdefault(name, [])
                deps[name] += [n for n in names if n not in deps[name]]
            elif names is True or names == {}:
                continue
            else:
                raise UnsupportedParameter(f"'{key}' with a schema (dependentSchemas) cannot "
                                           "be enforced here", param=f"{path}.{key}.{name}"[:200])
    return deps


_int_range = int_range  # the name tests/test_json_grammar.py knows
__all__ = ["MAX_PATTERN_CHARS", "MAX_PROPERTIES", "MAX_REPETITION", "MAX_SCHEMA_DEPTH",
           "MAX_SCHEMA_NODES", "convert", "schema_to_grammar"]
