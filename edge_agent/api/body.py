"""Request bodies: size-limited reading and validation into pydantic models.

Bodies are parsed here rather than by FastAPI so that every failure is a 400 (or 413) in
the dialect's own shape, naming the offending parameter — never FastAPI's 422 body.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from edge_agent.errors import InvalidRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


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
