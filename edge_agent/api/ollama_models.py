"""The Ollama dialect's model management (/api/tags, show, ps, pull, copy, delete).

Thin over `ModelOps`: every change goes through it, with the same errors as the CLI, and is
recorded as `operator:<tenant>`. Changing what every tenant gets needs an operator key
(`check_manage`); reading is scoped like generation (`check_reach`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from edge_agent.api.auth import authenticate, authenticated
from edge_agent.api.body import read_json, validate
from edge_agent.api.ollama import NDJSON, StrictBody
from edge_agent.api.openapi import request_body
from edge_agent.api.pull import catalog_installs, pull_progress
from edge_agent.api.state import AppParts, Parts
from edge_agent.engine.models.catalog import InstalledModel
from edge_agent.engine.registry import FOREVER, LoadedModel
from edge_agent.errors import EdgeAgentError, InvalidRequest
from edge_agent.names import ModelName

log = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(authenticate)])


class ModelRef(StrictBody):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None

    @property
    def ref(self) -> str:
        if not (self.model or self.name):
            raise InvalidRequest("missing required parameter: 'model'", param="model")
        return self.model or self.name or ""


class CopyBody(StrictBody):
    source: str
    destination: str


class PullBody(ModelRef):
    insecure: bool | None = None  # no registry is contacted: nothing to trust or not
    stream: bool = True


def _iso(ts: float) -> str:
    if ts == FOREVER:
        ts = 253402300799.0  # 9999-12-31: Ollama's "never"
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _details(m: InstalledModel) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": m.family, "families": [m.family],
            "parameter_size": m.parameter_size, "quantization_level": m.quantization}


@router.get("/api/tags")
async def tags(request: Request, parts: Parts) -> dict[str, Any]:
    """Each name's active version, of the names the caller may reach (its tenant's
    `models`, or all for an operator): a listing says no more than /api/show would."""
    tenant = authenticated(request)
    return {"models": [
        {"name": m.name, "model": m.name, "modified_at": _iso(m.installed_at), "size": m.size,
         "digest": m.digest, "details": _details(m)}
        for m in parts.ops.installed() if tenant.reaches(m.name)
    ]}


@router.post("/api/show", openapi_extra=request_body(ModelRef))
async def show(request: Request, parts: Parts) -> dict[str, Any]:
    body = validate(ModelRef, await read_json(request, parts.settings.server.max_body_bytes))
    # Outside the scope: 403 on the name alone, as for generation, so nothing says whether
    # such a model is installed.
    name = ModelName.parse(body.ref)
    authenticated(request).check_reach(name)
    m = parts.ops.show(name)  # the active version
    params = "\n".join(
        f"{k} {json.dumps(x)}" for k, v in m.parameters.items()
        for x in (v if isinstance(v, list) else [v]))
    info: dict[str, Any] = {"general.architecture": m.architecture,
                            "general.parameter_count": m.parameter_size}
    if m.context_length:
        info[f"{m.architecture}.context_length"] = m.context_length  # trained
    if m.embedding_length:
        info[f"{m.architecture}.embedding_length"] = m.embedding_length
    served = _served_context(request, parts, m)
    info["edge.served_context_length"] = served
    info["edge.digest"] = m.digest  # the active version's (clients' typed model_info)
    params = "\n".join(filter(None, [params, f"num_ctx {served}"]))
    capabilities = ["completion", "embedding"] + (["tools"] if m.chat_template else [])
    return {"license": m.license, "modelfile": f"# source: {m.origin}\nFROM {m.name}\n",
            "parameters": params, "template": m.chat_template or "", "details": _details(m),
            "model_info": info, "capabilities": capabilities,
            "modified_at": _iso(m.installed_at), "digest": m.digest}


def _served_context(request: Request, parts: AppParts, m: InstalledModel) -> int:
    """The context this caller's requests get: the model's window on this box, capped by
    the tenant's `max_context_tokens`."""
    served = parts.registry.served_context(m)
    tenant = getattr(request.state, "tenant", None)
    cap = tenant.policy.max_context_tokens if tenant is not None else None
    return min(served, cap) if cap else served


def _ps_row(m: LoadedModel) -> dict[str, Any]:
    return {"name": m.info.name, "model": m.info.name, "size": m.size, "digest": m.info.digest,
            "details": _details(m.info), "expires_at": _iso(m.expires_at),
            "size_vram": m.size_vram, "context_length": m.n_ctx, "parallel": m.parallel,
            "speculation": m.speculation}


@router.get("/api/ps")
async def ps(request: Request, parts: Parts) -> dict[str, Any]:
    tenant = authenticated(request)
    return {"models": [_ps_row(m) for m in parts.registry.loaded()
                       if tenant.reaches(m.info.name)]}


@router.delete("/api/delete", openapi_extra=request_body(ModelRef))
async def delete(request: Request, parts: Parts) -> Response:
    body = validate(ModelRef, await read_json(request, parts.settings.server.max_body_bytes))
    name = ModelName.parse(body.ref)
    authenticated(request).check_manage(f"deleting '{name}'")
    # 404, then the default model (400), then serving requests (503): as ModelOps decides.
    with parts.held(name, "DELETE /api/delete"):
        await parts.ops.delete(name, by=_operator(request))
    return Response(status_code=200)


@router.post("/api/copy", openapi_extra=request_body(CopyBody))
async def copy(request: Request, parts: Parts) -> Response:
    """Ollama's copy: `destination` becomes a second name for the digest `source` serves
    (the blob is shared; an existing destination switches to it). 200 with no body."""
    body = validate(CopyBody, await read_json(request, parts.settings.server.max_body_bytes))
    source = _name(body.source, "source")
    destination = _name(body.destination, "destination")
    authenticated(request).check_manage(f"copying '{source}' to '{destination}'")
    with parts.held(destination, "POST /api/copy"):
        await asyncio.to_thread(parts.ops.copy, source, destination, by=_operator(request))
    return Response(status_code=200)


def _name(name: str, param: str) -> ModelName:
    try:
        return ModelName.parse(name)
    except InvalidRequest as exc:
        exc.param = param
        raise


def _operator(request: Request) -> str:
    """Who changed a model, as its history records it."""
    return f"operator:{authenticated(request).name}"


@router.post("/api/pull", openapi_extra=request_body(PullBody))
async def pull(request: Request, parts: Parts) -> Response:
    body = validate(PullBody, await read_json(request, parts.settings.server.max_body_bytes))
    name = ModelName.parse(body.ref)
    authenticated(request).check_manage(f"pulling '{name}'")
    install = catalog_installs(request.app, parts.ops).start(  # 404 first
        name, by=_operator(request))
    progress = pull_progress(parts.ops, install, name)
    if not body.stream:
        async for _ in progress:
            pass
        return JSONResponse({"status": "success"})

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for obj in progress:
                yield (json.dumps(obj) + "\n").encode()
        except EdgeAgentError as exc:
            yield (json.dumps({"error": exc.message}) + "\n").encode()
        except Exception:  # the stream still ends with an error object, not a cut
            log.exception("pull of %s failed", body.ref)
            yield b'{"error": "internal server error"}\n'

    return StreamingResponse(lines(), media_type=NDJSON)
