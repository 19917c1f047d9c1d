"""Renders the exception tree of `edge_agent.errors` in each dialect's error shape.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; Ollama: `{"error": "message"}`.
The dialect is chosen by path (`/v1/...` is OpenAI; so is the box's own namespace,
`/edge/v1/...`, whose clients are the same apps). Unknown exceptions become a 500 with
a generic message: the raw text of an internal error never reaches a client.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edge_agent.errors import ContextLengthExceeded, EdgeAgentError, InvalidRequest
from edge_agent.logs import note
from edge_agent.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


EDGE_PREFIX = "/edge/v1"  # the box's own routes (`api.feedback`), in OpenAI's error shape


def is_openai_path(path: str) -> bool:
    return path in ("/v1", EDGE_PREFIX) or path.startswith(("/v1/", f"{EDGE_PREFIX}/"))


def openai_body(exc: EdgeAgentError) -> dict[str, Any]:
    message = exc.message
    if isinstance(exc, ContextLengthExceeded) and exc.window is not None:
        message = _openai_context_message(exc)
    return {"error": {"message": message, "type": exc.error_type, "param": exc.param,
                      "code": exc.code}}


def _openai_context_message(exc: ContextLengthExceeded) -> str:
    """OpenAI's own wording, which client libraries (litellm's context-window fallbacks …)
    recognise by its text."""
    limit = f"This model's maximum context length is {exc.window} tokens"
    prompt, output = exc.prompt_tokens or 0, exc.output_tokens
    if exc.input_kind == "prompt":  # the completions endpoint
        return (f"{limit}, however you requested {prompt + (output or 0)} tokens ({prompt} in "
                f"your prompt; {output or 0} for the completion). Please reduce your prompt; "
                "or completion length.")
    if output is None:
        return (f"{limit}. However, your messages resulted in {prompt} tokens. Please reduce "
                "the length of the messages.")
    return (f"{limit}. However, you requested {prompt + output} tokens ({prompt} in the "
            f"messages, {output} in the completion). Please reduce the length of the messages "
            "or completion.")


def ollama_body(exc: EdgeAgentError) -> dict[str, Any]:
    return {"error": exc.message}


def error_response(exc: EdgeAgentError, path: str) -> JSONResponse:
    body = openai_body(exc) if is_openai_path(path) else ollama_body(exc)
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def observe_refusal(metrics: Metrics | None, dialect: str, exc: EdgeAgentError) -> None:
    """A request's refusal on its access line and in the metrics (counted once, if the
    request path has not already): for an HTTP request's error and a batch line's alike."""
    note(error_type=exc.error_type)
    if metrics is not None:
        metrics.observe_error("", dialect, exc)


def install_error_handlers(app: FastAPI) -> None:
    async def on_edge_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EdgeAgentError)
        dialect = "openai" if is_openai_path(request.url.path) else "ollama"
        observe_refusal(getattr(request.app.state.parts, "metrics", None), dialect, exc)
        return error_response(exc, request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = EdgeAgentError(str(exc.detail))
        err.status_code = exc.status_code
        err.error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err.code = None
        return error_response(err, request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return error_response(InvalidRequest(str(first["msg"]), param=param), request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(EdgeAgentError("internal server error"), request.url.path)

    app.add_exception_handler(EdgeAgentError, on_edge_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
