"""How many parses of the same text a schema's grammar can make llama.cpp follow at once.

llama.cpp follows a grammar with one stack per way the text so far can be parsed, and
checks every candidate token against every stack at every step. Where two alternatives of
a union can both still match when nested values begin (two arrays; two objects that open
with the same key and values that may be the same text; a named property that is also an
additional one), each nested level holds both, and the stacks multiply: under a recursive
union of two array shapes, each `[` the model wrote doubled the time of the next token
(20 s a token at depth 12, and it grows without end). Patterns and key rules cost nothing
here: they are written as deterministic automata (`string_language`), one parse each.

The converter asks `WidthOracle.node_width` for each schema it visits, multiplies along the
nesting, and refuses a schema whose product passes
MAX_PARSE_STATES anywhere, or whose multiplying union recurs through a `$ref`. The bounds
are conservative (they may count parses that never coexist) and read only the schema
around a node; schemas as people and tool libraries write them have width 1 almost
everywhere (tool calls differ in a constant name; `Optional[...]` pairs with null).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MAX_PARSE_STATES = 16
MAX_ALTERNATIVES = 256  # per anyOf/oneOf: their conflicts are checked pairwise
_CONTAINERS = frozenset({"object", "array"})
_MAX_STEPS = 200_000  # comparisons one conversion may spend on widths

# (required keys in the order the converter writes them, properties, any first key,
#  additional properties that may nest)
_Shape = tuple[list[str], dict[str, Any], bool, bool]


class WidthOracle:
    """Widths of the schemas of one conversion (`refs`: the converter's resolved $refs)."""

    def __init__(self, refs: dict[str, Any],
                 merged: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self._refs = refs
        self._kinds: dict[int, frozenset[str]] = {}
        self._steps = 0
        # An alternative with an allOf is judged as the converter merges it (`merged`),
        # each kept here, so that ids stay unique.
        self._merge = merged
        self._merged: dict[int, tuple[Any, Any]] = {}

    def node_width(self, schema: dict[str, Any]) -> int:
        """How many alternatives of this node may carry on together into nested values."""
        if "$ref" in schema:
            return 1
        alts = schema.get("oneOf") or schema.get("anyOf")
        if isinstance(alts, list):
            if len(alts) > MAX_ALTERNATIVES:
                raise ValueError(f"{len(alts)} alternatives exceed the limit of "
                                 f"{MAX_ALTERNATIVES}")
            return self._union_width(alts)
        return 1  # an additional key is never a named one: they part at the key

    def _union_width(self, alts: list[Any]) -> int:
        """An upper bound of the largest group of alternatives in conflict (all the arrays;
        among objects, one more than the most conflicts any has), capped past the limit."""
        arrays = sum(1 for a in alts if "array" in self.kinds(a))
        objects = [self._resolve(a) for a in alts if "object" in self.kinds(a)]
        best = max(arrays, 1)
        for i, a in enumerate(objects):
            degree = 0
            for j, b in enumerate(objects):
                if i != j and self._objects_conflict(a, b):
                    degree += 1
                    if degree >= MAX_PARSE_STATES:
                        return MAX_PARSE_STATES + 1
            best = max(best, degree + 1)
        return best

    def _step(self) -> None:
        self._steps += 1
        if self._steps > _MAX_STEPS:
            raise ValueError("the schema's alternatives are too many to compare")

    def _resolve(self, schema: Any) -> Any:
        seen: set[str] = set()
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
            ref = schema["$ref"]
            if ref in seen or ref not in self._refs:
                return None
            seen.add(ref)
            schema = self._refs[ref]
        if self._merge is not None and isinstance(schema, dict) and "allOf" in schema:
            known = self._merged.get(id(schema))
            if known is None:
                known = self._merged[id(schema)] = (schema, self._merge(schema))
            return known[1] if isinstance(known[1], dict) else None
        return schema

    def kinds(self, schema: Any, depth: int = 0) -> frozenset[str]:
        """The containers ('object', 'array') the grammar for `schema` may open (in the
        converter's order of cases); literals and scalars open none."""
        schema = self._resolve(schema)
        if not isinstance(schema, dict) or depth > 32:
            return _CONTAINERS  # unknown: assume the worst
        known = self._kinds.get(id(schema))
        if known is None:
            self._step()
            known = self._kinds[id(schema)] = self._kinds_of(schema, depth)
        return known

    def _kinds_of(self, schema: dict[str, Any], depth: int) -> frozenset[str]:
        kind = schema.get("type")
        alts = schema.get("oneOf") or schema.get("anyOf")
        if isinstance(alts, list):
            return frozenset().union(*(self.kinds(a, depth + 1) for a in alts))
        if isinstance(kind, list):
            return frozenset().union(*(_type_kinds(t) for t in kind))
        if "const" in schema or "enum" in schema:
            return frozenset()
        if kind in (None, "object") and (
                "properties" in schema or "allOf" in schema or
                ("additionalProperties" in schema and schema["additionalProperties"] is not True)):
            return frozenset({"object"})
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            return frozenset({"array"})
        return frozenset({"object"}) if not schema else _type_kinds(kind)

    def _object_shape(self, schema: Any) -> _Shape | None:
        """The converter's object rule for `schema`, or None where it writes no such rule
        (the generic object: any key first)."""
        if not isinstance(schema, dict) or "$ref" in schema or "allOf" in schema:
            return None
        extra = schema.get("additionalProperties")
        if "properties" not in schema and ("additionalProperties" not in schema or
                                           extra is True):
            return None
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        wanted = set(required) if isinstance(required, list) else set()
        keys = [k for k in props if k in wanted]
        open_extra = extra is True or isinstance(extra, dict)
        nests = extra is True or (isinstance(extra, dict) and bool(self.kinds(extra)))
        return keys, props, open_extra, nests

    def _nest_together(self, a: dict[str, Any], sa: _Shape, b: dict[str, Any], sb: _Shape
                       ) -> bool:
        """Whether both may enter a nested value at once: only under a key both may write,
        whose values may both open a container (else the parses part before nesting)."""
        extra_a, extra_b = _extra_value(a), _extra_value(b)
        for key in set(sa[1]) | set(sa[0]) | set(sb[1]) | set(sb[0]):
            self._step()
            va = sa[1].get(key, extra_a if key not in sa[0] or key not in sa[1] else None)
            vb = sb[1].get(key, extra_b if key not in sb[0] or key not in sb[1] else None)
            if key in sa[0] and key not in sa[1]:
                va = extra_a if extra_a is not None else _ANY
            if key in sb[0] and key not in sb[1]:
                vb = extra_b if extra_b is not None else _ANY
            if va is not None and vb is not None and self.kinds(va) & self.kinds(vb):
                return True
        if extra_a is not None and extra_b is not None and \
                self.kinds(extra_a) & self.kinds(extra_b):
            return True
        return False

    def _objects_conflict(self, a: Any, b: Any) -> bool:
        """Whether two object alternatives may both be alive when one enters a nested value:
        walk their keys while they are the same and their values may be the same text."""
        self._step()
        sa, sb = self._object_shape(a), self._object_shape(b)
        if sa is None or sb is None:
            return True
        if not self._nest_together(a, sa, b, sb):
            return False
        (ka, pa, xa, _), (kb, pb, xb, _) = sa, sb
        if not ka or not kb:  # the first key is any optional one (or an additional one)
            first_a = {ka[0]} if ka else set(pa)
            first_b = {kb[0]} if kb else set(pb)
            return bool(first_a & first_b) or (not ka and xa) or (not kb and xb)
        for key_a, key_b in zip(ka, kb, strict=False):
            self._step()
            if key_a != key_b:
                return False
            va, vb = pa[key_a], pb[key_b]
            if self.kinds(va) & self.kinds(vb):
                return True
            if _literals_differ(self._resolve(va), self._resolve(vb)):
                return False
        return True  # the same keys all the way: assume the worst


_ANY = {"type": ["object", "array"]}  # a required name no property lists: any value


def _extra_value(schema: dict[str, Any]) -> Any:
    extra = schema.get("additionalProperties")
    return {} if extra is True else extra if isinstance(extra, dict) else None


def _type_kinds(kind: Any) -> frozenset[str]:
    if kind == "object":
        return frozenset({"object"})
    return frozenset({"array"}) if kind == "array" else frozenset()


def _literals_differ(a: Any, b: Any) -> bool:
    texts_a, texts_b = _literal_texts(a), _literal_texts(b)
    return texts_a is not None and texts_b is not None and not texts_a & texts_b


def _literal_texts(schema: Any) -> set[str] | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {json.dumps(schema["const"], sort_keys=True)}
    if isinstance(schema.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in schema["enum"]}
    return None
