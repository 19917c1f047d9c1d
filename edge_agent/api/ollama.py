"""The Ollama dialect (/api/*): request and response shapes as in Ollama's docs/api.md.

Thin: parse and validate, build a `GenerationRequest`, encode events as NDJSON. Options
that would change behaviour and are not supported are refused by name, never ignored.
The model-management routes (tags, show, ps, pull, copy, delete) are `ollama_models`.

A body's top level is read as Ollama's server reads it: a field it does not define is
ignored, not refused (clients written against Ollama send fields of other APIs beside its
own, and Ollama answers them). Ignored is never silent: every such field is named in
`X-Edge-Ignored` and in the request's ledger row. Where a top-level field means one of the
options (`temperature`, `max_tokens` …, see `TOP_LEVEL_OPTIONS`) it is applied as that
option unless `options` sets it; and `tool_choice`, which Ollama lacks, is honoured where
it has a meaning. Inside `options` and `messages` unknown fields are still refused by name.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from edge_agent import __version__
from edge_agent.api.auth import authenticate, authenticated, tenant_of
from edge_agent.api.body import read_controls, read_json, validate
from edge_agent.api.openapi import request_body
from edge_agent.api.state import AppParts, Parts
from edge_agent.config import MAX_DRAFT
from edge_agent.engine.constrained.tool_calls import ANY_JSON_OBJECT
from edge_agent.engine.registry import parse_keep_alive
from edge_agent.engine.request import (
    DoneEvent,
    EmbeddingRequest,
    ErrorEvent,
    GenerationRequest,
    TokenEvent,
    ToolChoice,
)
from edge_agent.errors import (
    InvalidRequest,
    UnsupportedParameter,
)
from edge_agent.gateway.controls import Controls
from edge_agent.logs import note
from edge_agent.names import ModelName

log = logging.getLogger(__name__)

# The Ollama API level these endpoints follow; clients gate features on it.
OLLAMA_API_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
# Set when a keep_alive was not applied because the model is the default one, which stays
# loaded (/ready depends on it).
PINNED_HEADER = "X-Edge-Pinned"
# The top-level fields a request sent that changed nothing (see the module docstring).
IGNORED_HEADER = "X-Edge-Ignored"
# Top-level fields that mean an option, and the option they mean.
TOP_LEVEL_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "seed": "seed", "stop": "stop", "max_tokens": "num_predict",
                     "max_output_tokens": "num_predict"}
# An ignored field is named only when its name is a plain identifier: the name is the
# client's text, and it goes into a header and the ledger. Others are counted ("+2").
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_NAMED = 16

router = APIRouter(dependencies=[Depends(authenticate)])


# Unknown fields are refused by name (never silently ignored): options, messages.
class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LenientBody(BaseModel):
    """A request's top level: unknown fields are kept aside (`model_extra`), to be named as
    ignored, as Ollama's server ignores them."""

    model_config = ConfigDict(extra="allow")


class Options(StrictBody):
    num_predict: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    typical_p: float | None = Field(None, gt=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    num_ctx: int | None = Field(None, gt=0)  # any size: the box serves its configured one
    # The box's own: prompt-lookup draft tokens a step (0: off; unset: the model's setting).
    prompt_lookup: int | None = Field(None, ge=0, le=MAX_DRAFT)
    # Accepted only at values that change nothing here.
    num_keep: int | None = None  # no context shifting happens, so nothing to keep
    penalize_newline: bool | None = None  # Ollama itself ignores it
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    # The operator sets these in config; a request cannot.
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None


_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
             "repeat_last_n", "presence_penalty", "frequency_penalty", "seed")
_NO_OP = {"mirostat": 0, "tfs_z": 1.0, "numa": False, "low_vram": False, "f16_kv": True,
          "logits_all": False, "vocab_only": False, "use_mlock": False,
          "embedding_only": False}
_OPERATOR = ("num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap")


class Message(StrictBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _GenerateCommon(LenientBody):
    model: str
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Not Ollama's, but sent by clients beside `options` (TOP_LEVEL_OPTIONS): validated as
    # the option they mean, so a bad value is a 400 naming the field as sent.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: list[str] | str | None = None
    max_tokens: int | None = None
    max_output_tokens: int | None = None


class ChatBody(_GenerateCommon):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    # Not Ollama's either: OpenAI's forms ("auto", "none", "required",
    # {"type": "function", "function": {"name": …}}) and the flat {"type": "function",
    # "name": …} of the Responses API. Any other value is ignored and named.
    tool_choice: Any = None


class GenerateBody(_GenerateCommon):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class EmbedBody(LenientBody):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: Options | None = None
    keep_alive: str | float | None = None
    dimensions: int | None = Field(None, gt=0)


class EmbeddingsBody(LenientBody):
    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | float | None = None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _merged_options(body: _GenerateCommon, ignored: list[str]) -> tuple[Options | None, str]:
    """`options` with the top-level fields that mean an option filled in where it is unset
    (both `max_tokens` and `max_output_tokens`: the smaller, as for any two limits), and how
    errors name the output limit (as the request gave it). A top-level field whose option
    `options` already sets is added to `ignored`."""
    limit_param = "options.num_predict"
    top = {k: getattr(body, k) for k in TOP_LEVEL_OPTIONS
           if k in body.model_fields_set and getattr(body, k) is not None}
    if not top:
        return body.options, limit_param
    options = body.options.model_copy() if body.options is not None else \
        Options.model_validate({})
    own = {k for k in options.model_fields_set if getattr(options, k) is not None}
    for key, value in top.items():
        option = TOP_LEVEL_OPTIONS[key]
        current = getattr(options, option)
        if option in own:
            ignored.append(key)
        elif current is None or (option == "num_predict" and _tighter(value, current)):
            setattr(options, option, value)
            if option == "num_predict":
                limit_param = key
    return options, limit_param


def _tighter(limit: int, than: int) -> bool:
    """Whether output limit `limit` is tighter than `than` (a negative one is no limit)."""
    return limit >= 0 and (than < 0 or limit < than)


def _tool_choice(body: ChatBody, ignored: list[str]) -> ToolChoice:
    """The tool choice a chat request asks for, where it means one: `auto` (also when none
    is sent, as Ollama behaves), `none`, `required`, or a function named in either of
    OpenAI's shapes. With no tools there is nothing to choose: the field is ignored, as
    any value this does not read (named in `ignored`)."""
    value = body.tool_choice
    if value is None:
        return "auto"
    if body.tools:
        if value in ("auto", "none", "required"):
            return str(value)
        if isinstance(value, dict) and value.get("type") == "function":
            fn = value.get("function")
            name = fn.get("name") if isinstance(fn, dict) else value.get("name")
            if isinstance(name, str) and name:
                return name
    ignored.append("tool_choice")
    return "auto"


def _ignored_fields(body: LenientBody, data: dict[str, Any], also: list[str]) -> list[str]:
    """The top-level fields of `data` that change nothing: those the body does not define,
    and `also` (defined, but not applied); in the order sent."""
    unused = set(body.model_extra or ()) | set(also)
    return [k for k in data if k in unused]


def _name_ignored(fields: list[str]) -> dict[str, str]:
    """Says which fields were ignored: in the ledger row, and in the header it returns."""
    if not fields:
        return {}
    plain = [f for f in fields if _PLAIN_NAME.fullmatch(f)][:_MAX_NAMED]
    rest = len(fields) - len(plain)
    value = ",".join(plain + ([f"+{rest}"] if rest else []))
    note(ignored_fields=value)
    return {IGNORED_HEADER: value}


def _apply_options(req: GenerationRequest, options: Options | None,
                   limit_param: str = "options.num_predict") -> None:
    if options is None:
        return
    given = options.model_dump(exclude_none=True)
    for key, value in given.items():
        if key in _OPERATOR:
            raise UnsupportedParameter(
                f"option '{key}' is set by the operator in the configuration, not per request",
                param=f"options.{key}")
        if key in _NO_OP and value != _NO_OP[key]:
            raise UnsupportedParameter(f"option '{key}'={value} is not supported",
                                       param=f"options.{key}")
    req.sampling = {k: given[k] for k in _SAMPLING if k in given}
    req.max_tokens_param = limit_param
    if options.num_predict is not None and options.num_predict >= 0:
        req.max_tokens = options.num_predict
    if options.stop is not None:
        req.stop = [options.stop] if isinstance(options.stop, str) else list(options.stop)
    req.num_ctx = options.num_ctx
    req.draft = options.prompt_lookup


def _check_common(body: _GenerateCommon, model: str) -> None:
    ModelName.parse(model)  # a malformed name is refused before a message quotes it
    if body.think not in (None, False, "", "none"):
        raise UnsupportedParameter(f'"{model}" does not support thinking', param="think")
    if body.logprobs:
        raise UnsupportedParameter("logprobs are not supported", param="logprobs")
    if body.top_logprobs:
        raise UnsupportedParameter("top_logprobs are not supported", param="top_logprobs")


def _schema(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return ANY_JSON_OBJECT
    if isinstance(fmt, dict):
        return fmt
    raise InvalidRequest(f"invalid format '{fmt}': use \"json\" or a JSON schema",
                         param="format")


def _stats(done: DoneEvent) -> dict[str, Any]:
    t, u = done.timings, done.usage
    return {
        "done_reason": "stop" if done.reason == "tool_calls" else done.reason,
        "total_duration": t.total_ns,
        "load_duration": t.load_ns,
        # The whole prompt, as Ollama's runner counts it, reused cache or not: clients
        # take it as the request's input tokens.
        "prompt_eval_count": u.prompt_tokens,
        "prompt_eval_duration": t.prompt_ns,
        "eval_count": u.completion_tokens,
        "eval_duration": t.eval_ns,
    }


def _tool_calls(done: DoneEvent) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in done.tool_calls]


def _is_default(parts: AppParts, name: str) -> bool:
    return ModelName.parse(name) == ModelName.parse(parts.settings.default_model)


def _keep_alive(request: Request, parts: AppParts, model: str, value: object
                ) -> tuple[float | None, dict[str, str]]:
    """The keep_alive a request may apply, with the headers that say what was not applied.
    Any keep_alive keeps a model warm; 0 unloads it for every tenant, so it is management.
    The default model stays loaded whatever is asked (ignored, as Ollama ignores an unload
    it cannot do), or /ready would turn 503."""
    seconds = parse_keep_alive(value)
    if seconds is None:
        return None, {}
    if _is_default(parts, model):
        return None, {PINNED_HEADER: "true"}
    if seconds == 0:
        authenticated(request).check_manage(f"unloading '{ModelName.parse(model)}' (keep_alive 0)",
                                      param="keep_alive")
    return seconds, {}


async def _run(request: Request, parts: AppParts, req: GenerationRequest,
               controls: Controls, keep_alive: tuple[float | None, dict[str, str]],
               stream: bool, chat: bool) -> Response:
    seconds, extra_headers = keep_alive
    req.stream = stream
    prepared = await parts.service.prepare(req, controls, tenant=tenant_of(request),
                                           keep_alive=seconds)
    name = prepared.model_name

    def message(text: str, done: DoneEvent | None = None) -> dict[str, Any]:
        if not chat:
            return {"response": text}
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if done is not None and done.tool_calls:
            msg["tool_calls"] = _tool_calls(done)
        return {"message": msg}

    def final(done: DoneEvent, text: str) -> dict[str, Any]:
        extra = {} if chat else {"context": list(done.context)}
        return {"model": name, "created_at": _now(), **message(text, done), "done": True,
                **_stats(done), **extra}

    if not stream:
        done = await parts.service.complete(prepared)
        return JSONResponse(final(done, done.text),
                            headers={**prepared.headers(done), **extra_headers})

    async def lines() -> AsyncIterator[bytes]:
        async for event in parts.service.stream(prepared):
            if isinstance(event, TokenEvent):
                chunk = {"model": name, "created_at": _now(), **message(event.text),
                         "done": False}
            elif isinstance(event, DoneEvent):
                if event.tool_calls:
                    calls = {"model": name, "created_at": _now(), **message("", event),
                             "done": False}
                    yield (json.dumps(calls, ensure_ascii=False) + "\n").encode()
                chunk = final(event, "")
                if chat:
                    chunk["message"].pop("tool_calls", None)
            else:
                assert isinstance(event, ErrorEvent)
                chunk = {"error": str(event.error)}
            yield (json.dumps(chunk, ensure_ascii=False) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON,
                             headers={**prepared.headers(), **extra_headers},
                             background=BackgroundTask(parts.service.release, prepared))


async def _load_only(request: Request, parts: AppParts, model: str, keep_alive: object,
                     chat: bool, headers: dict[str, str]) -> Response:
    """An empty prompt loads (or, with keep_alive 0, unloads) the model, as Ollama does.
    Loading a model outside the tenant's scope and unloading are management (403 without
    an operator key, decided before the store is looked at); the default model's unload
    is ignored."""
    name = ModelName.parse(model)
    authenticated(request).check_reach(name)
    unload = parse_keep_alive(keep_alive) == 0
    seconds, pinned = _keep_alive(request, parts, name, keep_alive)
    parts.ops.show(name)
    if unload and not pinned:
        await parts.ops.unload(name)
    elif not unload:
        await parts.ops.load(name, seconds)
    body: dict[str, Any] = {"model": model, "created_at": _now(), "done": True,
                            "done_reason": "unload" if unload else "load"}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(body, headers={**pinned, **headers})


@router.get("/", response_class=PlainTextResponse)
@router.head("/", response_class=PlainTextResponse)
async def root() -> str:
    return "edge-agent is running"


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION, "edge_agent": __version__}


@router.post("/api/chat", openapi_extra=request_body(ChatBody))
async def chat(request: Request, parts: Parts) -> Response:
    data = await read_json(request, parts.settings.server.max_body_bytes)
    body = validate(ChatBody, data)
    unused: list[str] = []
    options, limit_param = _merged_options(body, unused)
    choice = _tool_choice(body, unused)
    named = _name_ignored(_ignored_fields(body, data, unused))
    _check_common(body, body.model)
    if not body.messages:
        return await _load_only(request, parts, body.model, body.keep_alive, chat=True,
                                headers=named)
    messages = []
    for i, m in enumerate(body.messages):
        if m.images:
            raise UnsupportedParameter("images are not supported by this model",
                                       param=f"messages.{i}.images")
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_name:
            msg["name"] = m.tool_name
        messages.append(msg)
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool.get("function"), dict) or not tool["function"].get("name"):
            raise InvalidRequest("each tool needs function.name", param=f"tools.{i}")
    req = GenerationRequest(model=body.model, messages=messages, tools=body.tools or [],
                            tool_choice=choice, json_schema=_schema(body.format))
    _apply_options(req, options, limit_param)
    controls = read_controls(request, lookup=req.draft is None)  # the body's option wins
    seconds, headers = _keep_alive(request, parts, body.model, body.keep_alive)
    return await _run(request, parts, req, controls, (seconds, {**headers, **named}),
                      body.stream, chat=True)


@router.post("/api/generate", openapi_extra=request_body(GenerateBody))
async def generate(request: Request, parts: Parts) -> Response:
    data = await read_json(request, parts.settings.server.max_body_bytes)
    body = validate(GenerateBody, data)
    unused: list[str] = []
    options, limit_param = _merged_options(body, unused)
    named = _name_ignored(_ignored_fields(body, data, unused))
    _check_common(body, body.model)
    if body.suffix:
        raise UnsupportedParameter(f"{body.model} does not support insert", param="suffix")
    if body.template:
        raise UnsupportedParameter("per-request templates are not supported; the model's "
                                   "chat template applies (or use raw)", param="template")
    if body.images:
        raise UnsupportedParameter("images are not supported by this model", param="images")
    if body.width or body.height or body.steps:
        raise UnsupportedParameter("image generation is not supported", param="width")
    if not body.prompt and not body.context:
        return await _load_only(request, parts, body.model, body.keep_alive, chat=False,
                                headers=named)
    req = GenerationRequest(model=body.model, prompt=body.prompt or "", raw=body.raw,
                            system=body.system, context_tokens=list(body.context or []),
                            json_schema=_schema(body.format))
    _apply_options(req, options, limit_param)
    controls = read_controls(request, lookup=req.draft is None)  # the body's option wins
    seconds, headers = _keep_alive(request, parts, body.model, body.keep_alive)
    return await _run(request, parts, req, controls, (seconds, {**headers, **named}),
                      body.stream, chat=False)


@router.post("/api/embed", openapi_extra=request_body(EmbedBody))
async def embed(request: Request, parts: Parts) -> Response:
    data = await read_json(request, parts.settings.server.max_body_bytes)
    body = validate(EmbedBody, data)
    named = _name_ignored(_ignored_fields(body, data, []))
    inputs: list[str | list[int]] = [body.input] if isinstance(body.input, str) else \
        list(body.input)
    req = EmbeddingRequest(model=body.model, inputs=inputs, truncate=body.truncate)
    controls = read_controls(request)
    seconds, headers = _keep_alive(request, parts, body.model, body.keep_alive)
    headers.update(named)
    if not inputs:  # as Ollama: nothing to embed is an empty answer, not an error
        name = ModelName.parse(body.model)
        tenant = authenticated(request)
        tenant.check_model(name)
        parts.service.risk.tier(tenant, controls.risk)  # a tier it may not ask: 403 the same
        return JSONResponse({"model": parts.store.get(name).name, "embeddings": [],
                             "total_duration": 0, "load_duration": 0,
                             "prompt_eval_count": 0}, headers=headers)
    result = await parts.service.embed(req, controls, tenant=tenant_of(request),
                                       keep_alive=seconds,
                                       disconnected=request.is_disconnected)
    vectors = result.vectors
    if body.dimensions is not None:
        vectors = _shorten(vectors, body.dimensions)
    if result.truncated_tokens:
        headers["X-Edge-Truncated"] = str(result.truncated_tokens)
    return JSONResponse({"model": body.model, "embeddings": vectors,
                         "total_duration": result.timings.total_ns,
                         "load_duration": result.timings.load_ns,
                         "prompt_eval_count": result.prompt_tokens}, headers=headers)


def _shorten(vectors: list[list[float]], dims: int) -> list[list[float]]:
    if vectors and dims > len(vectors[0]):
        raise InvalidRequest(f"dimensions {dims} exceeds the model's {len(vectors[0])}",
                             param="dimensions")
    out = []
    for v in vectors:
        head = v[:dims]
        norm = sum(x * x for x in head) ** 0.5 or 1.0
        out.append([x / norm for x in head])
    return out


@router.post("/api/embeddings", openapi_extra=request_body(EmbeddingsBody))
async def embeddings(request: Request, parts: Parts) -> Response:
    data = await read_json(request, parts.settings.server.max_body_bytes)
    body = validate(EmbeddingsBody, data)
    named = _name_ignored(_ignored_fields(body, data, []))
    req = EmbeddingRequest(model=body.model, inputs=[body.prompt])
    controls = read_controls(request)
    if not body.prompt:
        name = ModelName.parse(body.model)
        tenant = authenticated(request)
        tenant.check_reach(name)
        parts.service.risk.tier(tenant, controls.risk)  # a tier it may not ask: 403 the same
        parts.store.get(name)
        return JSONResponse({"embedding": []}, headers=named)
    seconds, headers = _keep_alive(request, parts, body.model, body.keep_alive)
    headers.update(named)
    result = await parts.service.embed(req, controls, tenant=tenant_of(request),
                                       keep_alive=seconds,
                                       disconnected=request.is_disconnected)
    return JSONResponse({"embedding": result.vectors[0]}, headers=headers)
