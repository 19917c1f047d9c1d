"""OpenAI's Batch API: /v1/files (purpose `batch`) and /v1/batches, per tenant.

Thin over `gateway.batches.BatchService`: parse and validate, shape the objects as
OpenAI's. An upload is `multipart/form-data` (`file`, `purpose`), read here up to
`batches.max_file_bytes` (413 past it) and parsed by Starlette's multipart parser.
`line_runner` is how a batch line is served: the OpenAI dialect's own handler, given the
line's body as a request of the batch's tenant at the `batch` priority, so that a line is
parsed, refused and answered exactly as the same request sent interactively.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.types import Message

from edge_agent.api import openai
from edge_agent.api.auth import authenticate, authenticated
from edge_agent.api.body import read_body, read_json, validate
from edge_agent.api.errors import openai_body
from edge_agent.api.openapi import request_body
from edge_agent.api.state import Parts
from edge_agent.errors import (
    EdgeAgentError,
    InvalidRequest,
    ServiceUnavailable,
    UnsupportedParameter,
)
from edge_agent.gateway.batches import BatchService, RunLine
from edge_agent.governance.tenants import TenantContext
from edge_agent.logs import note

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])
log = logging.getLogger(__name__)
_MULTIPART_SLACK = 64 * 1024  # the parts' heads and the purpose field, beside the file


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None


def _service(parts: Any) -> BatchService:
    service: BatchService | None = getattr(parts, "batches", None)
    if service is None or service.store is None:
        raise ServiceUnavailable("the batch queue is not running", retry_after=2.0)
    return service


# -- files ---------------------------------------------------------------------------------
_FILE_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}}


@router.post("/files", openapi_extra=_FILE_FORM)
async def create_file(request: Request, parts: Parts) -> JSONResponse:
    service = _service(parts)
    limit = parts.settings.batches.max_file_bytes
    body = await read_body(request, limit + _MULTIPART_SLACK, "upload")
    fields = await _multipart(request.headers, body)
    purpose = fields.get("purpose")
    upload = fields.get("file")
    if upload is None or upload[0] is None:
        raise InvalidRequest("missing required parameter: 'file' (a file part)", param="file")
    if purpose is None:
        raise InvalidRequest("missing required parameter: 'purpose'", param="purpose")
    try:
        purpose_text = purpose[1].decode()
    except UnicodeDecodeError:
        raise InvalidRequest("purpose must be text", param="purpose") from None
    obj = await service.create_file(authenticated(request), upload[0] or "file.jsonl",
                                    purpose_text.strip(), upload[1])
    return JSONResponse(obj)


@router.get("/files")
async def list_files(request: Request, parts: Parts, purpose: str | None = None,
                     after: str | None = None, limit: int = 10000,
                     order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    return _service(parts).list_files(authenticated(request), purpose=purpose, after=after,
                                      limit=limit, order=order)


@router.get("/files/{file_id}")
async def get_file(request: Request, file_id: str, parts: Parts) -> dict[str, Any]:
    return _service(parts).get_file(authenticated(request), file_id)


@router.delete("/files/{file_id}")
async def delete_file(request: Request, file_id: str, parts: Parts) -> dict[str, Any]:
    return await _service(parts).delete_file(authenticated(request), file_id)


@router.get("/files/{file_id}/content")
async def file_content(request: Request, file_id: str, parts: Parts) -> Response:
    data = await _service(parts).file_content(authenticated(request), file_id)
    return Response(data, media_type="application/octet-stream")


# -- batches -------------------------------------------------------------------------------
@router.post("/batches", openapi_extra=request_body(BatchBody))
async def create_batch(request: Request, parts: Parts) -> JSONResponse:
    body = validate(BatchBody, await read_json(request, parts.settings.server.max_body_bytes))
    if body.output_expires_after is not None:
        raise UnsupportedParameter("output_expires_after is not supported (output files "
                                   "follow retention.batch_days)",
                                   param="output_expires_after")
    obj = await _service(parts).create_batch(authenticated(request), body.input_file_id,
                                             body.endpoint, body.completion_window,
                                             body.metadata)
    return JSONResponse(obj)


@router.get("/batches")
async def list_batches(request: Request, parts: Parts, after: str | None = None,
                       limit: int = 20) -> dict[str, Any]:
    return _service(parts).list_batches(authenticated(request), after=after, limit=limit)


@router.get("/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str, parts: Parts) -> dict[str, Any]:
    return _service(parts).get_batch(authenticated(request), batch_id)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str, parts: Parts) -> dict[str, Any]:
    return await _service(parts).cancel_batch(authenticated(request), batch_id)


# -- the upload --------------------------------------------------------------------------
async def _multipart(headers: Headers, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The form's fields by name, read by Starlette's multipart parser (python-multipart):
    (the part's filename or None, its bytes). Anything it cannot read is a 400."""
    if not headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise InvalidRequest("upload a file as multipart/form-data (fields 'file' and "
                             "'purpose')", param="file")

    async def chunks() -> AsyncGenerator[bytes, None]:
        yield body

    try:
        form = await MultiPartParser(headers, chunks(), max_files=1, max_fields=8).parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"the multipart/form-data upload: {exc.message}",
                             param="file") from None
    fields: dict[str, tuple[str | None, bytes]] = {}
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                fields[name] = (value.filename, await value.read())
            else:
                fields[name] = (None, value.encode())
    finally:
        await form.close()
    return fields


# -- a line, through the dialect's handler ---------------------------------------------------
_HANDLERS = {"/v1/chat/completions": openai.chat_completions,
             "/v1/completions": openai.completions, "/v1/embeddings": openai.embeddings}


def line_runner(app: FastAPI) -> RunLine:
    """`RunLine` for `BatchService`: the line's body as the body of a request to the
    endpoint's handler, with the tenant set as `authenticate` sets it, `X-Priority: batch`,
    and never a stream (a batch's answer is a whole response)."""

    async def run(tenant: TenantContext, endpoint: str, body: dict[str, Any]
                  ) -> tuple[int, dict[str, Any], float | None]:
        try:
            if body.get("stream"):
                raise InvalidRequest("stream is not supported in a batch: each answer is "
                                     "stored whole", param="stream")
            data = json.dumps(body, ensure_ascii=False).encode()
            request = _request(app, endpoint, data)
            request.state.tenant = tenant
            request.state.batch_line = True  # never degraded: a 503 waits and runs again
            response = await _HANDLERS[endpoint](request, app.state.parts)
            answer = json.loads(bytes(response.body))
            return response.status_code, answer, None
        except EdgeAgentError as exc:  # as the error handlers do for a request
            note(error_type=exc.error_type)
            metrics = app.state.parts.metrics
            if metrics is not None:
                metrics.observe_error("", "openai", exc)
            return exc.status_code, openai_body(exc), exc.retry_after
        except Exception:  # a failure of this line only: the batch goes on
            log.exception("a batch line failed")
            return 500, openai_body(EdgeAgentError("internal server error")), None

    return run


def _request(app: FastAPI, path: str, data: bytes) -> Request:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        # Nobody disconnects: wait until cancelled (a cancel, a stop, a preemption).
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "root_path": "", "scheme": "http", "query_string": b"", "app": app,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode()),
                         (b"x-priority", b"batch")],
             "client": ("batch", 0), "server": ("batch", 0), "state": {}}
    return Request(scope, receive)
