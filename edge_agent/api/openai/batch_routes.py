"""OpenAI's Batch API over HTTP: /v1/files (purpose `batch`) and /v1/batches, per tenant.

Thin over `batches.BatchService`: parse and validate, hand on. An upload is
`multipart/form-data` (`file`, `purpose`), read here up to `batches.max_file_bytes` (413
past it) and parsed by Starlette's multipart parser.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from edge_agent.api.auth import authenticate, authenticated
from edge_agent.api.body import read_body, read_json, validate
from edge_agent.api.openai.batches import BatchService
from edge_agent.api.openai.protocol import BatchBody
from edge_agent.api.openapi import request_body
from edge_agent.api.state import Parts
from edge_agent.errors import InvalidRequest, ServiceUnavailable, UnsupportedParameter

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])
_MULTIPART_SLACK = 64 * 1024  # the parts' heads and the purpose field, beside the file


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
