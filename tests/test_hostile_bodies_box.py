"""Hostile bodies at every route of the box, from a fixed table: no answer is a 5xx, every
refusal is in the dialect's error shape, every refused request to a model-serving route
leaves its ledger row, and the box still generates afterwards.

The routes are read from the app `create_app` builds (those the API document leaves out
too), so a route added later is in the table without a line here. Every route whose method
may carry a body (all but GET, HEAD and OPTIONS) gets every body of the table: oversized
(declared and chunked), malformed (cut JSON, bytes that are not UTF-8, JSON sent as a form
and a form sent as JSON, nothing), lone surrogates in every string and key, the wrong JSON
type for the body, and each field the API document names set to a type it is not (a number
for a string, an object for a list, numbers for a list of strings, 2**70, NaN, Infinity).
A route with path parameters gets hostile values for them (a lone surrogate as UTF-8
bytes, an escaped `../..`, 10 KB). Hypothesis and schemathesis send arbitrary values;
this table sends the known-bad ones every time, to every route.

A body starts from what the route's document requires (the installed model on
model-serving routes; a model that is not installed elsewhere, so that no body of the table
can change the box's models) and changes one thing.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from edge_agent.logs import LEDGER_PATHS
from tests.conftest import DEFAULT_MODEL, LiveServer
from tests.fuzzing import REQUEST_TIMEOUT_S, error_shape_problem, scheduler_problems

pytestmark = pytest.mark.integration

NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})
ABSENT_MODEL = "absent-model:1"  # never installed: management routes answer 404 for it
# Every string and key of a surrogate-laden body ends with this lone surrogate (JSON's
# `\ud800`: valid JSON, not valid Unicode).
SURROGATE = "\ud800"
HUGE = 2**70
BOUNDARY = "hostile-boundary"
PATH_VALUES = {"lone surrogate": "%ED%A0%80", "escaped ../..": "..%2F..",
               "10 KB": "a" * 10240, "NUL": "%00", "not UTF-8": "%FF%FE"}
UPLOAD_LIMIT = 1024  # batches.max_file_bytes while this module runs (its least)
# Content near enough to be served: the body's one hostile change is then what decides.
NEAR = {"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "input": "Hi"}


@dataclass(frozen=True)
class Op:
    """A route and one of its methods, with the body its API document describes."""

    method: str
    template: str  # as the app declares it ("/v1/models/{model_id:path}")
    params: tuple[str, ...]
    schema: dict[str, Any] | None  # the body's schema (None: the document gives none)
    form: bool  # the body is multipart/form-data

    @property
    def serving(self) -> bool:
        """A model-serving route: every request to it leaves a ledger row."""
        return self.template in LEDGER_PATHS

    @property
    def openai(self) -> bool:
        return self.template.startswith("/v1/")

    def url(self, value: str = "absent") -> str:
        return re.sub(r"\{[^}]+\}", value, self.template)

    def __str__(self) -> str:
        return f"{self.method} {self.template}"


@dataclass(frozen=True)
class Case:
    name: str
    content: bytes
    content_type: str = "application/json"
    chunked: bool = False  # sent with Transfer-Encoding: chunked, no Content-Length
    oversized: bool = False


def _route_contexts(app: FastAPI) -> Iterator[Any]:
    """Every route of the app with its full path and methods, whether FastAPI keeps
    included routers as they are (newer versions, resolved by `iter_route_contexts`) or
    copies their routes into the app's."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        yield from app.routes
        return
    yield from iter_route_contexts(app.routes)


def box_ops(app: FastAPI) -> list[Op]:
    document = app.openapi()
    ops = []
    for route in _route_contexts(app):
        template = getattr(route, "path", None)
        if not isinstance(template, str):
            continue
        described = re.sub(r"\{([^}:]+)(:[^}]*)?\}", r"{\1}", template)
        params = tuple(re.findall(r"\{([^}:]+)", template))
        for method in sorted(getattr(route, "methods", None) or ()):
            op = document["paths"].get(described, {}).get(method.lower(), {})
            content = op.get("requestBody", {}).get("content", {})
            schema = next(iter(content.values()), {}).get("schema") if content else None
            ops.append(Op(method, template, params, _resolve(schema, document),
                          "multipart/form-data" in content))
    return ops


def _resolve(schema: Any, document: dict[str, Any]) -> Any:
    if isinstance(schema, dict) and "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _resolve(document["components"]["schemas"][name], document)
    return schema


# -- the table ---------------------------------------------------------------------------------

def _kinds(schema: Any) -> set[str]:
    """The JSON types a field's schema accepts ("any" where it names none)."""
    if not isinstance(schema, dict):
        return {"any"}
    if "enum" in schema and "type" not in schema:
        return {type(v).__name__.replace("str", "string") for v in schema["enum"]}
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        return set().union(*(_kinds(s) for s in alternatives))
    kind = schema.get("type")
    if isinstance(kind, list):
        return set(kind)
    return {kind} if kind else {"any"}


def _string_items(schema: Any) -> bool:
    """Whether the field may be a list of strings."""
    if not isinstance(schema, dict):
        return False
    alternatives = schema.get("anyOf") or schema.get("oneOf") or [schema]
    return any(isinstance(s, dict) and s.get("type") == "array"
               and "string" in _kinds(s.get("items")) for s in alternatives)


def _example(name: str, schema: Any, op: Op) -> Any:
    """A value the field takes (the start of a body, before its hostile change)."""
    if name == "model":
        return DEFAULT_MODEL if op.serving else ABSENT_MODEL
    if name in NEAR:
        return NEAR[name]
    if isinstance(schema, dict) and schema.get("enum"):
        return schema["enum"][0]
    kinds = _kinds(schema)
    for kind, value in (("string", "absent"), ("integer", 1), ("number", 1.0),
                        ("boolean", False), ("array", []), ("object", {})):
        if kind in kinds:
            return value
    return None


def base_body(op: Op) -> dict[str, Any]:
    schema = op.schema or {}
    required = set(schema.get("required", ()))
    return {name: _example(name, field, op) for name, field in
            schema.get("properties", {}).items() if name in required or name in NEAR
            or name == "model"}


def wrong_values(schema: Any) -> list[Any]:
    """Values of the wrong type for a field, by what its schema accepts; and, for every
    field, those no field takes (2**70, NaN, Infinity)."""
    kinds = _kinds(schema)
    values: list[Any] = []
    if "string" in kinds and not kinds & {"integer", "number", "any"}:
        values.append(12345)
    if "array" in kinds and "object" not in kinds:
        values.append({"not": "a list"})
    if _string_items(schema):
        values.append([1, 2, 3])
    if "object" in kinds and "array" not in kinds:
        values.append(["not", "an", "object"])
    if kinds & {"integer", "number", "boolean"} and "string" not in kinds:
        values.append("12 apples")
    if "boolean" in kinds and "object" not in kinds:
        values.append({"not": "a boolean"})
    return [*values, HUGE, float("nan"), float("inf"), float("-inf")]


def _alternatives(schema: Any) -> list[dict[str, Any]]:
    if not isinstance(schema, dict):
        return []
    return [s for s in schema.get("anyOf") or schema.get("oneOf") or [schema]
            if isinstance(s, dict)]


def documented_fields(schema: dict[str, Any], prefix: tuple[str | int, ...] = ()
                      ) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """Every field the document names, with its path: the body's own, and those of the
    objects inside it (Ollama's `options`, a message of `messages`), two levels down."""
    for name, field in schema.get("properties", {}).items():
        yield (*prefix, name), field
        if len(prefix) >= 2:
            continue
        for alt in _alternatives(field):
            items = alt.get("items")
            if alt.get("type") == "object" and alt.get("properties"):
                yield from documented_fields(alt, (*prefix, name))
            elif alt.get("type") == "array" and isinstance(items, dict) and \
                    items.get("properties"):
                yield from documented_fields(items, (*prefix, name, 0))


def _with(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """The body with the field at `path` set to `value`, the containers on the way made
    where the body has none (an object, a list's first item)."""
    out: dict[str, Any] = json.loads(json.dumps(body))
    here: Any = out
    for step, following in zip(path, path[1:], strict=False):
        fresh: Any = [] if isinstance(following, int) else {}
        if isinstance(step, int):
            if len(here) <= step:
                here.append(fresh)
        elif not isinstance(here.get(step), type(fresh)):
            here[step] = fresh
        here = here[step]
    here[path[-1]] = value
    return out


def _dumps(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as literals


def _surrogates(value: Any, keys: bool = True) -> Any:
    if isinstance(value, str):
        return value + SURROGATE
    if isinstance(value, list):
        return [_surrogates(v, keys) for v in value]
    if isinstance(value, dict):
        return {(k + SURROGATE if keys else k): _surrogates(v, keys) for k, v in value.items()}
    return value


def _form(*parts: tuple[str, bytes, bytes | None]) -> bytes:
    """A multipart/form-data body of (name, value, filename) parts, as bytes: a name or a
    filename may hold bytes no text has."""
    out = b""
    for name, value, filename in parts:
        disposition = b'form-data; name="' + name.encode() + b'"'
        if filename is not None:
            disposition += b'; filename="' + filename + b'"'
        out += (b"--" + BOUNDARY.encode() + b"\r\nContent-Disposition: " + disposition
                + b"\r\nContent-Type: application/octet-stream\r\n\r\n" + value + b"\r\n")
    return out + b"--" + BOUNDARY.encode() + b"--\r\n"


FORM = f"multipart/form-data; boundary={BOUNDARY}"


def cases(op: Op, limit: int) -> list[Case]:
    """The table for one route and method."""
    body = base_body(op)
    plain = _dumps(body)
    big = b'{"model": "' + b"a" * (2 * limit) + b'"}'
    line = _dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": DEFAULT_MODEL, **NEAR}})
    table = [
        Case("oversized, Content-Length", big, oversized=True),
        Case("oversized, chunked", big, chunked=True, oversized=True),
        Case("cut JSON", plain[: len(plain) // 2]),
        Case("not UTF-8", b'{"model": "\xff\xfe\xed\xa0\x80"}'),
        Case("JSON as a form", plain, content_type=FORM),
        Case("a form as JSON", _form(("file", line, b"a.jsonl"), ("purpose", b"batch", None))),
        Case("empty", b""),
        Case("surrogates in every string and key", _dumps(_surrogates(
            {**body, "list": ["a", "b"], "nested": {"texts": ["c"]}}))),
        Case("surrogates in every string", _dumps(_surrogates(
            {**body, "stop": ["a", "b"]}, keys=False))),
        Case("a list for the object", _dumps([body])),
        Case("a number for the object", b"5"),
        Case("a string for the object", b'"text"'),
        Case("null for the object", b"null"),
        Case("NaN literal", b'{"model": NaN}'),
        Case("Infinity literal", b'{"model": -Infinity}'),
        Case("a huge integer", b'{"model": ' + str(HUGE).encode() + b"}"),
        Case("a 5,000-digit integer", b'{"model": ' + b"9" * 5000 + b"}"),
    ]
    for path, field in documented_fields(op.schema or {}):
        for value in wrong_values(field):
            name = ".".join(map(str, path))
            table.append(Case(f"{name} = {value!r:.40}", _dumps(_with(body, path, value))))
    if op.form:
        table += [
            Case("a form: a file name with a lone surrogate", _form(
                ("file", line, b"\xed\xa0\x80.jsonl"), ("purpose", b"batch", None)), FORM),
            Case("a form: purpose not UTF-8", _form(
                ("file", line, b"a.jsonl"), ("purpose", b"\xff\xfe", None)), FORM),
            Case("a form: purpose with a lone surrogate", _form(
                ("file", line, b"a.jsonl"), ("purpose", b"batch\xed\xa0\x80", None)), FORM),
            Case("a form: lines with lone surrogates", _form(
                ("file", _dumps(_surrogates(json.loads(line))), b"a.jsonl"),
                ("purpose", b"batch", None)), FORM),
            Case("a form: a line not UTF-8", _form(
                ("file", b'{"custom_id": "\xff"}', b"a.jsonl"), ("purpose", b"batch", None)),
                FORM),
            Case("a form: lines of the wrong type", _form(
                ("file", b'[1]\n5\n"x"\n{"custom_id": 5, "method": [], "url": {}, '
                 b'"body": "x"}\n{"custom_id": "b", "body": {"model": NaN}}', b"a.jsonl"),
                ("purpose", b"batch", None)), FORM),
            Case("a form: cut", _form(("file", line, b"a.jsonl"))[:60], FORM),
            Case("a form without its boundary", _form(("file", line, b"a.jsonl")),
                 "multipart/form-data"),
        ]
    return table


# -- the run -----------------------------------------------------------------------------------

@dataclass
class Sent:
    op: Op
    what: str
    status: int
    request_id: str


@pytest.fixture(scope="module")
def box(fuzz_live: LiveServer) -> Iterator[LiveServer]:
    """The fuzz server (the module's own), its uploads capped low so that one oversized
    body is over every route's limit."""
    batches = fuzz_live.settings.batches
    saved, batches.max_file_bytes = batches.max_file_bytes, UPLOAD_LIMIT
    try:
        yield fuzz_live
    finally:
        batches.max_file_bytes = saved


def _check(op: Op, what: str, r: httpx.Response) -> None:
    where = f"{op} ({what}): {r.status_code} {r.content[:300]!r}"
    assert r.status_code < 500, where
    if r.status_code >= 300 and op.method != "HEAD":
        try:
            payload = r.json()
        except ValueError:
            pytest.fail(f"{where}: not JSON")
        problem = error_shape_problem(op.template, payload)
        assert problem is None, f"{where}: {problem}"


def _send(client: httpx.Client, op: Op, url: str, case: Case | None, n: int
          ) -> httpx.Response:
    headers = {"X-Request-Id": f"hostile-{n}"}
    if case is None:
        return client.request(op.method, url, headers=headers)
    headers["Content-Type"] = case.content_type
    if case.oversized:  # the rest of the body may be left unread: a connection of its own
        headers["Connection"] = "close"
    content: Any = case.content
    if case.chunked:
        content = iter([case.content[i:i + 8192]
                        for i in range(0, len(case.content), 8192)])
    return client.request(op.method, url, headers=headers, content=content)


def _ledger(live: LiveServer, ids: list[str]) -> dict[str, int]:
    """The statuses the ledger holds for these requests, once every row is written."""
    if not ids:
        return {}
    live.ledger_row(ids[-1])  # flushes, waiting for the last row
    assert live.app.state.parts.ledger.flush()
    db = sqlite3.connect(live.settings.state_dir / "ledger.db")
    try:
        marks = ",".join("?" * len(ids))
        return dict(db.execute(f"SELECT trace_id, status FROM requests WHERE trace_id IN "
                               f"({marks})", ids).fetchall())
    finally:
        db.close()


def test_every_route_takes_hostile_bodies_without_a_server_error(box: LiveServer) -> None:
    ops = box_ops(box.app)
    with_body = [op for op in ops if op.method not in NO_BODY]
    # The table covers what the box serves: model-serving, management, uploads, batches.
    covered = {str(op) for op in with_body}
    assert {"POST /api/chat", "POST /v1/embeddings", "DELETE /api/delete", "POST /api/pull",
            "POST /v1/files", "POST /v1/batches"} <= covered, covered
    assert any(op.form for op in with_body) and any(op.params for op in ops)
    limit = box.settings.server.max_body_bytes
    sent: list[Sent] = []
    started = time.monotonic()
    with httpx.Client(base_url=box.base_url, timeout=REQUEST_TIMEOUT_S) as client:
        for op in ops:
            targets: list[tuple[str, str, Case | None]] = []
            if op.method not in NO_BODY:
                targets += [(op.url(), case.name, case) for case in cases(op, limit)]
            for name, value in PATH_VALUES.items():
                if op.params:
                    targets.append((op.url(value), f"path: {name}", None))
            for url, what, case in targets:
                r = _send(client, op, url, case, len(sent))
                _check(op, what, r)
                if case is not None and case.oversized and op.schema is not None:
                    assert r.status_code == 413, f"{op} ({what}): {r.status_code}"
                sent.append(Sent(op, what, r.status_code, r.headers["x-request-id"]))
    print(f"\n{len(sent)} hostile requests to {len(ops)} routes and methods in "
          f"{time.monotonic() - started:.1f} s:")
    for op in ops:
        statuses = Counter(s.status for s in sent if s.op == op)
        if statuses:
            print(f"  {op}: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))

    refused = [s for s in sent if s.op.serving and s.status >= 300]
    assert refused
    rows = _ledger(box, [s.request_id for s in refused])
    wrong = [(str(s.op), s.what, s.status, rows.get(s.request_id)) for s in refused
             if rows.get(s.request_id) != s.status]
    assert not wrong, f"refused requests without their ledger row: {wrong[:10]}"
    # Still alive: every listing reads what the table left (files, batches, models), and
    # a plain generation is answered.
    for op in ops:
        if op.method == "GET" and not op.params:
            r = httpx.get(f"{box.base_url}{op.template}", timeout=REQUEST_TIMEOUT_S)
            _check(op, "afterwards", r)
    assert scheduler_problems(box) == []
