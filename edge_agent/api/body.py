"""Request bodies: size-limited reading and validation into pydantic models.

Bodies are parsed here rather than by FastAPI so that every failure is a 400 (or 413) in
the dialect's own shape, naming the offending parameter — never FastAPI's 422 body.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from edge_agent.engine.request import GenerationRequest
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


def apply_controls(request: Request, req: GenerationRequest, timeout_ms: int | None = None
                   ) -> None:
    """Scheduling controls common to both dialects: `X-Priority: interactive|batch` and a
    deadline from `X-Timeout-Ms` (or the OpenAI body's `timeout_ms`; the smaller wins)."""
    req.dialect = "openai" if request.url.path.startswith("/v1/") else "ollama"
    req.tenant = getattr(request.state, "tenant", None)
    priority = request.headers.get("x-priority")
    if priority is not None:
        priority = priority.strip().lower()
        if priority not in ("interactive", "batch"):
            raise InvalidRequest("X-Priority must be 'interactive' or 'batch'",
                                 param="X-Priority")
        req.priority = priority  # type: ignore[assignment]
    header = request.headers.get("x-timeout-ms")
    values = [timeout_ms] if timeout_ms else []
    if header is not None:
        if not header.strip().isdigit() or int(header) <= 0:
            raise InvalidRequest("X-Timeout-Ms must be a positive whole number",
                                 param="X-Timeout-Ms")
        values.append(int(header))
    if values:
        req.timeout_s = min(values) / 1000
