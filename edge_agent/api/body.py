"""Request bodies: size-limited reading and validation into pydantic models.

Bodies are parsed here rather than by FastAPI so that every failure is a 400 (or 413) in
the dialect's own shape, naming the offending parameter — never FastAPI's 422 body.

Past JSON syntax, a body must also be data every later layer can handle, so these are
refused here, once, for every endpoint: nesting deeper than `MAX_JSON_DEPTH` (deep enough
for any real schema; far deeper breaks recursive code — the JSON parser itself gives up at
about 1,000), lone UTF-16 surrogates in any string or key (`"\\ud800"` decodes to text
that cannot be encoded as UTF-8 for the tokenizer, a file name or the ledger), integers
outside the signed 64-bit range and the non-finite numbers JSON does not have (`NaN`,
`Infinity`, or `1e400`, which Python reads as infinity).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, NoReturn, TypeVar, cast

from fastapi import Request
from pydantic import BaseModel, ValidationError

from edge_agent.config import MAX_DRAFT
from edge_agent.errors import InvalidRequest, PayloadTooLarge
from edge_agent.gateway.controls import Controls, Priority, Tier

M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 64  # objects and arrays inside one another; the body itself is level 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INT_DIGITS = 20  # longer integer literals are refused before Python converts them
_SURROGATE = re.compile("[\ud800-\udfff]")  # after decoding, valid pairs are one character
_LONG_INT = re.compile(rb"[0-9]{19}")  # no shorter literal can leave the 64-bit range
_DRAFT = re.compile(r"[0-9]{1,2}")
_TIMEOUT_MS = re.compile(r"[0-9]{1,15}")  # ASCII digits only: int() also takes "١٢" and "²"

DEFERRABLE = "/v1/chat/completions"  # the endpoint whose requests may wait as a batch


class _NotJson(ValueError):
    """A literal Python's parser accepts but JSON does not have (NaN, Infinity, a 5,000-digit
    integer that Python would refuse to convert with a bare ValueError)."""


def _parse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON value")


def _parse_int(digits: str) -> int:
    if len(digits) > _INT_DIGITS:
        raise _NotJson(f"an integer of {len(digits)} digits is out of range")
    return int(digits)


async def read_body(request: Request, limit: int, what: str = "request body") -> bytes:
    """The body, refused (413) once it is past `limit` bytes, declared or as it arrives."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"{what} of {declared} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes")
    return bytes(body)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    body = await read_body(request, limit)
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        data = json.loads(body, parse_constant=_parse_constant, parse_int=_parse_int)
    except RecursionError as exc:
        raise InvalidRequest(
            f"request body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, _NotJson
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_values(data, ints=_LONG_INT.search(body) is not None)
    return data


def check_values(data: dict[str, Any], *, ints: bool = True) -> None:
    """Refuses what parses as JSON but no later layer can take (see the module docstring),
    naming the parameter as `validate` does (`messages.0.content`). Iterative, so that
    depth costs no recursion, and linear in the size of the body. `ints=False` skips the
    64-bit check (the caller knows no literal is long enough to need it)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels "
                                 f"(in '{path[0]}')", param=_param(path[:1]))
        if type(value) is list and set(map(type, value)) == {int}:  # token ids, fast
            if ints and not (INT64_MIN <= min(value) and max(value) <= INT64_MAX):
                bad = next(i for i, x in enumerate(value) if not INT64_MIN <= x <= INT64_MAX)
                _refuse((*path, bad), "integers must fit in 64 bits")
            continue
        items = value.items() if type(value) is dict else enumerate(value)
        for key, item in items:
            if type(key) is str and _SURROGATE.search(key):
                raise InvalidRequest(
                    f"a key in {_name(path)} is not valid Unicode (a lone surrogate)",
                    param=_param(path))
            kind = type(item)
            if kind is str:
                if _SURROGATE.search(item):
                    _refuse((*path, key), "text must be valid Unicode (a lone surrogate was "
                            "found)")
            elif kind is dict or kind is list:
                if item:
                    stack.append((item, (*path, key)))
            elif kind is int:
                if ints and not INT64_MIN <= item <= INT64_MAX:
                    _refuse((*path, key), "integers must fit in 64 bits")
            elif kind is float and not math.isfinite(item):
                _refuse((*path, key), "numbers must be finite")


def _refuse(path: tuple[str | int, ...], why: str) -> NoReturn:
    raise InvalidRequest(f"invalid value for '{_param(path)}': {why}", param=_param(path))


def _param(path: tuple[str | int, ...]) -> str | None:
    return ".".join(str(p) for p in path) or None


def _name(path: tuple[str | int, ...]) -> str:
    return f"'{_param(path)}'" if path else "the request body"


def validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise InvalidRequest(f"unrecognized request argument supplied: {param}",
                                 param=param) from exc
        if err["type"] == "missing":
            raise InvalidRequest(f"missing required parameter: '{param}'", param=param) from exc
        raise InvalidRequest(f"invalid value for '{param}': {err['msg']}", param=param) from exc


def read_controls(request: Request, *, lookup: bool = True) -> Controls:
    """Scheduling controls common to both dialects: `X-Priority: interactive|batch`, a
    deadline from `X-Timeout-Ms` (an OpenAI body's `timeout_ms` joins it in `serving`,
    `Controls.with_timeout`: the smaller wins),
    `X-Edge-Prompt-Lookup` (draft tokens a step; OpenAI's body has no field for it), the
    risk tier `X-Edge-Risk: low|normal|high`, `X-Edge-Defer: batch` (a low-tier request
    that may be answered later, as a one-line batch, when the box is saturated) and
    `X-Edge-Route: local|upstream` (the side it asks to run on, `gateway.routing`). A bad
    value is a 400 naming the header, on every route that takes a model's work, whether
    or not the control changes anything there. `lookup=False`: the request's body set its
    draft tokens, which win, so the header is not read at all."""
    dialect = "openai" if request.url.path.startswith("/v1/") else "ollama"
    priority = request.headers.get("x-priority")
    if priority is not None:
        priority = priority.strip().lower()
        if priority not in ("interactive", "batch"):
            raise InvalidRequest("X-Priority must be 'interactive' or 'batch'",
                                 param="X-Priority")
    risk = request.headers.get("x-edge-risk")
    if risk is not None:
        risk = risk.strip().lower()
        if risk not in ("low", "normal", "high"):
            raise InvalidRequest("X-Edge-Risk must be 'low', 'normal' or 'high'",
                                 param="X-Edge-Risk")
    defer = request.headers.get("x-edge-defer")
    if defer is not None:
        if defer.strip().lower() != "batch":
            raise InvalidRequest("X-Edge-Defer must be 'batch' (answer a low-tier request "
                                 "later, as a batch, when the box is saturated)",
                                 param="X-Edge-Defer")
        if request.url.path != DEFERRABLE:
            raise InvalidRequest(f"X-Edge-Defer is for {DEFERRABLE}: a deferred request "
                                 "becomes a one-line batch of the OpenAI Batch API",
                                 param="X-Edge-Defer")
    draft = None
    header = request.headers.get("x-edge-prompt-lookup")
    if header is not None and lookup:
        if not _DRAFT.fullmatch(header.strip()) or int(header) > MAX_DRAFT:
            raise InvalidRequest(f"X-Edge-Prompt-Lookup must be a whole number of draft "
                                 f"tokens from 0 (off) to {MAX_DRAFT}",
                                 param="X-Edge-Prompt-Lookup")
        draft = int(header)
    header = request.headers.get("x-timeout-ms")
    timeout_s = None
    if header is not None:
        if not _TIMEOUT_MS.fullmatch(header.strip()) or int(header) <= 0:
            raise InvalidRequest("X-Timeout-Ms must be a positive whole number of "
                                 "milliseconds (ASCII digits, at most 15)",
                                 param="X-Timeout-Ms")
        timeout_s = int(header) / 1000
    route = request.headers.get("x-edge-route")
    if route is not None:
        route = route.strip().lower()
        if route not in ("local", "upstream"):
            raise InvalidRequest("X-Edge-Route must be 'local' or 'upstream'",
                                 param="X-Edge-Route")
    return Controls(dialect=dialect, priority=cast(Priority | None, priority),
                    risk=cast(Tier | None, risk), defer=defer is not None, draft=draft,
                    timeout_s=timeout_s,
                    route=cast(Literal["local", "upstream"] | None, route))
