"""The OpenAI dialect's model routes over HTTP (/v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/models): read and validate the body, read the scheduling controls
from the headers, call `serving`, write its answer or its stream. Unknown arguments are
refused as OpenAI refuses them (`protocol`); everything past the body's shape is
`serving`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from edge_agent.api.auth import authenticate, authenticated, tenant_of
from edge_agent.api.body import read_controls, read_json, validate
from edge_agent.api.openai.protocol import ChatBody, CompletionBody, EmbeddingBody
from edge_agent.api.openai.serving import Answer, Streamed
from edge_agent.api.openapi import request_body
from edge_agent.api.state import Parts
from edge_agent.engine.models.catalog import InstalledModel
from edge_agent.names import ModelName

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])


def _response(result: Answer | Streamed) -> Response:
    if isinstance(result, Answer):
        return JSONResponse(result.body, status_code=result.status, headers=result.headers)
    return StreamingResponse(result.events, media_type="text/event-stream",
                             headers=result.headers, background=BackgroundTask(result.release))


@router.post("/chat/completions", openapi_extra=request_body(ChatBody))
async def chat_completions(request: Request, parts: Parts) -> Response:
    body = validate(ChatBody, await read_json(request, parts.settings.server.max_body_bytes))
    return _response(await parts.openai.chat(body, read_controls(request),
                                             tenant_of(request)))


@router.post("/completions", openapi_extra=request_body(CompletionBody))
async def completions(request: Request, parts: Parts) -> Response:
    body = validate(CompletionBody,
                    await read_json(request, parts.settings.server.max_body_bytes))
    return _response(await parts.openai.completions(body, read_controls(request),
                                                    tenant_of(request)))


@router.post("/embeddings", openapi_extra=request_body(EmbeddingBody))
async def embeddings(request: Request, parts: Parts) -> Response:
    body = validate(EmbeddingBody, await read_json(request, parts.settings.server.max_body_bytes))
    return _response(await parts.openai.embeddings(body, read_controls(request),
                                                   tenant_of(request),
                                                   disconnected=request.is_disconnected))


def _model_obj(m: InstalledModel) -> dict[str, Any]:
    """OpenAI's model object; `digest` (the active version's sha256) is an extra field,
    which OpenAI's clients keep as it is."""
    return {"id": m.name, "object": "model", "created": int(m.installed_at),
            "owned_by": "edge-agent", "digest": m.digest}


@router.get("/models")
async def list_models(request: Request, parts: Parts) -> dict[str, Any]:
    """The models the key may use (OpenAI lists what a key can access)."""
    tenant = authenticated(request)
    return {"object": "list", "data": [_model_obj(m) for m in parts.ops.installed()
                                       if tenant.reaches(m.name)]}


@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str, parts: Parts) -> dict[str, Any]:
    # Outside the scope: 403 on the name alone, as /api/show and generation answer.
    name = ModelName.parse(model_id)
    authenticated(request).check_reach(name)
    return _model_obj(parts.ops.show(name))
