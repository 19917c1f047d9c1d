"""The OpenAI dialect's serving: chat completions, completions and embeddings, each from a
validated body (`protocol`), the request's scheduling controls and its tenant, to an
answer object or a stream of server-sent events. No Request and no bytes in: `routes`
calls it for an HTTP request, and the batch runner for each line of a batch, so a line is
refused and answered exactly as the same request sent interactively.

Known parameters that would change behaviour and are not supported (n > 1, logprobs,
audio …) get 400 naming the parameter. Every stream ends with `data: [DONE]`; after an
error, an error event comes just before it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import secrets
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from edge_agent.api.errors import openai_body
from edge_agent.api.openai.protocol import (
    ChatBody,
    ChatMessage,
    CompletionBody,
    EmbeddingBody,
    Sampling,
)
from edge_agent.engine.constrained.tool_calls import ANY_JSON_OBJECT
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.request import (
    DoneEvent,
    EmbeddingRequest,
    ErrorEvent,
    GenerationRequest,
    TokenEvent,
    ToolCallEvent,
)
from edge_agent.errors import (
    Deferrable,
    EdgeAgentError,
    InvalidRequest,
    NotDegraded,
    UnsupportedParameter,
)
from edge_agent.gateway.controls import Controls
from edge_agent.gateway.service import GenerationService, PreparedGeneration
from edge_agent.governance.tenants import TenantContext
from edge_agent.logs import current_request_id, note
from edge_agent.names import ModelName

log = logging.getLogger(__name__)


@dataclass
class Answer:
    """A whole response: its JSON body, its status and headers."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200


@dataclass
class Streamed:
    """A streamed response: its server-sent events (ending in `[DONE]`, an error event
    first where it failed), its headers, and what to call once it has ended or was never
    sent (the model handed back)."""

    events: AsyncIterator[bytes]
    headers: dict[str, str]
    release: Callable[[], Awaitable[None]]


class Deferrals(Protocol):
    """Where a deferred request is queued as a one-line batch (`batches.BatchService`)."""

    async def submit_one(self, tenant: TenantContext, endpoint: str, body: dict[str, Any],
                         *, custom_id: str = ..., metadata: dict[str, str] | None = None
                         ) -> dict[str, Any]: ...


class OpenAIServing:
    """The dialect's three model endpoints over the generation service and the model
    store; `deferrals` gives the batch queue while it runs (None before and after)."""

    def __init__(self, service: GenerationService, store: ModelStore,
                 deferrals: Callable[[], Deferrals | None]) -> None:
        self.service = service
        self.store = store
        self.deferrals = deferrals

    async def chat(self, body: ChatBody, controls: Controls, tenant: TenantContext | None
                   ) -> Answer | Streamed:
        return await _chat(self, body, _with_body(controls, body), tenant)

    async def completions(self, body: CompletionBody, controls: Controls,
                          tenant: TenantContext | None) -> Answer | Streamed:
        return await _completions(self, body, _with_body(controls, body), tenant)

    async def embeddings(self, body: EmbeddingBody, controls: Controls,
                         tenant: TenantContext | None,
                         disconnected: Callable[[], Awaitable[bool]] | None = None) -> Answer:
        return await _embeddings(self, body, controls, tenant, disconnected)


def _unsupported(condition: object, param: str, what: str) -> None:
    if condition:
        raise UnsupportedParameter(f"{what} is not supported", param=param)


def _with_body(controls: Controls, body: Sampling) -> Controls:
    """The controls with what a generation's body adds to them: its deadline
    (`timeout_ms`, the smaller of it and the header's wins) and its end user."""
    end_user = getattr(body, "safety_identifier", None) or body.user
    return replace(controls.with_timeout(body.timeout_ms), end_user=end_user)


def _common(body: Sampling, req: GenerationRequest) -> None:
    _unsupported(body.n not in (None, 1), "n", "n > 1")
    req.stream = bool(body.stream)
    for key in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                "top_k", "min_p", "repeat_penalty"):
        value = getattr(body, key)
        if value is not None:
            req.sampling[key] = value
    if body.logit_bias:
        try:
            bias = tuple((int(k), float(v)) for k, v in body.logit_bias.items())
        except ValueError as exc:
            raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from exc
        if any(not -100 <= v <= 100 for _, v in bias):
            raise InvalidRequest("logit_bias values must be within [-100, 100]",
                                 param="logit_bias")
        req.sampling["logit_bias"] = bias
    if body.stop is not None:
        req.stop = [body.stop] if isinstance(body.stop, str) else list(body.stop)


def _text_content(msg: ChatMessage, i: int) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts = []
    for j, part in enumerate(msg.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(f"content part of type '{part.get('type')}' is not "
                                       "supported", param=f"messages.{i}.content.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _chat_request(body: ChatBody) -> GenerationRequest:
    _unsupported(body.logprobs, "logprobs", "logprobs")
    _unsupported(body.top_logprobs, "top_logprobs", "top_logprobs")
    _unsupported(body.store, "store", "store")
    _unsupported(body.reasoning_effort not in (None, "none"), "reasoning_effort",
                 "reasoning_effort (this model does not reason)")
    _unsupported(body.verbosity not in (None, "medium"), "verbosity", "verbosity")
    _unsupported(body.moderation is not None, "moderation", "moderation")
    _unsupported(body.modalities not in (None, ["text"]), "modalities", "output other than text")
    _unsupported(body.audio is not None, "audio", "audio output")
    _unsupported(body.prediction is not None, "prediction", "predicted outputs")
    _unsupported(body.web_search_options is not None, "web_search_options", "web search")
    _unsupported(body.functions or body.function_call, "functions",
                 "the deprecated functions API (use tools)")
    _unsupported(body.service_tier not in (None, "auto", "default"), "service_tier",
                 f"service_tier '{body.service_tier}'")
    messages = []
    for i, m in enumerate(body.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text_content(m, i)}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        messages.append(msg)
    req = GenerationRequest(model=body.model, messages=messages,
                            cache_key=body.prompt_cache_key)
    _common(body, req)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise InvalidRequest("max_tokens and max_completion_tokens disagree",
                             param="max_completion_tokens")
    req.max_tokens = body.max_completion_tokens or body.max_tokens
    if body.max_completion_tokens is not None:
        req.max_tokens_param = "max_completion_tokens"
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        req.json_schema = ANY_JSON_OBJECT
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest("response_format.json_schema.schema is required",
                                 param="response_format.json_schema")
        req.json_schema = fmt.json_schema.schema_
        req.schema_param = "response_format.json_schema.schema"
    if body.tools:
        for i, tool in enumerate(body.tools):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
                raise InvalidRequest("each tool needs type 'function' and function.name",
                                     param=f"tools.{i}")
        req.tools = body.tools
        req.tool_choice = _tool_choice(body.tool_choice)
    elif body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    return req


async def _deferred(serving: OpenAIServing, tenant: TenantContext | None, exc: Deferrable,
                    body: ChatBody) -> Answer:
    """A low-tier request on a saturated box that accepts a later answer (`X-Edge-Defer:
    batch`): queued as a one-line batch of its tenant, answered 202 with the batch, whose
    output file will hold the answer. Its stream and deadline are the moment's, not the
    line's: a batch's answer is stored whole, whenever the box has room."""
    batches = serving.deferrals()
    if tenant is None or batches is None:
        raise NotDegraded(exc.message, retry_after=exc.retry_after) from exc
    line = body.model_dump(by_alias=True, exclude_unset=True,
                           exclude={"stream", "stream_options", "timeout_ms"})
    batch = await batches.submit_one(tenant, "/v1/chat/completions", line,
                                     metadata={"deferred": "risk tier low"})
    degradation = serving.service.risk.deferred(exc)
    note(batch_id=batch["id"])
    return Answer(batch, status=202, headers={
        "Location": f"/v1/batches/{batch['id']}", "X-Edge-Degraded": degradation.header()})


def _tool_choice(choice: str | dict[str, Any] | None) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest(f"invalid tool_choice '{choice}'", param="tool_choice")
        return choice
    name = (choice.get("function") or {}).get("name")
    if choice.get("type") != "function" or not name:
        raise InvalidRequest("tool_choice must name a function", param="tool_choice")
    return str(name)


def _usage(done: DoneEvent) -> dict[str, Any]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _tool_calls(done: DoneEvent) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                  ensure_ascii=False)}}
            for c in done.tool_calls]


def _answer_id() -> str:
    """The part of an answer's `id` after its prefix: the request's ledger row id, so an
    app can send its verdict on the answer by the id it already holds (`POST
    /edge/v1/feedback`); a random one outside a request's context."""
    return current_request_id() or secrets.token_hex(16)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _chat(serving: OpenAIServing, body: ChatBody, controls: Controls,
                tenant: TenantContext | None) -> Answer | Streamed:
    req = _chat_request(body)
    try:
        prepared = await serving.service.prepare(req, controls, tenant=tenant)
    except Deferrable as exc:
        return await _deferred(serving, tenant, exc, body)
    ident, created = f"chatcmpl-{_answer_id()}", int(time.time())
    head = {"id": ident, "created": created, "model": prepared.model_name,
            "system_fingerprint": "fp_" + prepared.model_digest[:12]}

    if not body.stream:
        done = await serving.service.complete(prepared)
        message: dict[str, Any] = {"role": "assistant", "content": done.text or None,
                                   "refusal": None}
        if done.tool_calls:
            message["tool_calls"] = _tool_calls(done)
        else:
            message["content"] = done.text
        return Answer({**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": done.reason}],
            "usage": _usage(done)}, headers=prepared.headers(done))

    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj: dict[str, Any] = {**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if with_usage:
            obj["usage"] = None
        return _sse(obj)

    # Token chunks differ only in their text: encode the rest once per response.
    pre, post = chunk({"content": "\x00"}).decode().split('"\\u0000"')

    async def events() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        streamed: set[int] = set()  # calls already sent piece by piece
        async for event in serving.service.stream(prepared, tool_deltas=True):
            if isinstance(event, TokenEvent):
                yield (pre + json.dumps(event.text, ensure_ascii=False) + post).encode()
            elif isinstance(event, ToolCallEvent):
                streamed.add(event.index)
                yield chunk({"tool_calls": [_call_delta(event)]})
            elif isinstance(event, DoneEvent):
                calls = [{"index": i, **c} for i, c in enumerate(_tool_calls(event))
                         if i not in streamed]
                if calls:
                    yield chunk({"tool_calls": calls})
                yield chunk({}, event.reason)
                if with_usage:
                    yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                                "usage": _usage(event)})
                yield _sse("[DONE]")
            elif isinstance(event, ErrorEvent):
                yield _sse(openai_body(_edge(event.error)))
                yield _sse("[DONE]")

    return Streamed(_ending_in_error_event(events()), prepared.headers(),
                    functools.partial(serving.service.release, prepared))


def _call_delta(event: ToolCallEvent) -> dict[str, Any]:
    """OpenAI's streamed tool call: id, type and name first (arguments ""), then arguments."""
    if event.name:
        return {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": event.arguments}}
    return {"index": event.index, "function": {"arguments": event.arguments}}


def _edge(exc: Exception) -> EdgeAgentError:
    return exc if isinstance(exc, EdgeAgentError) else EdgeAgentError("internal server error")


async def _ending_in_error_event(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Once a stream has started, an exception can no longer become an HTTP status: it
    becomes an error event, then `[DONE]`, which ends the stream — never a dropped
    connection with neither an error nor `[DONE]`."""
    try:
        async for data in events:
            yield data
    except Exception as exc:
        if not isinstance(exc, EdgeAgentError):
            log.exception("stream failed")
        yield _sse(openai_body(_edge(exc)))
        yield _sse("[DONE]")


async def _completions(serving: OpenAIServing, body: CompletionBody, controls: Controls,
                       tenant: TenantContext | None) -> Answer | Streamed:
    _unsupported(body.suffix, "suffix", "suffix (insertion)")
    _unsupported(body.logprobs, "logprobs", "logprobs")
    _unsupported(body.best_of not in (None, 1), "best_of", "best_of > 1")
    prompts: list[str | list[int]]
    if body.prompt is None:
        raise InvalidRequest("prompt is empty", param="prompt")
    if isinstance(body.prompt, str):
        prompts = [body.prompt]
    elif body.prompt and all(isinstance(p, int) for p in body.prompt):
        prompts = [list(body.prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(body.prompt)  # type: ignore[arg-type]
    if not prompts:
        raise InvalidRequest("prompt is empty", param="prompt")
    requests = []
    for p in prompts:
        req = GenerationRequest(model=body.model, raw=True,
                                max_tokens=16 if body.max_tokens is None else body.max_tokens,
                                prompt=p if isinstance(p, str) else "",
                                context_tokens=[] if isinstance(p, str) else p,
                                context_param="prompt")
        _common(body, req)
        requests.append(req)

    def echo(req: GenerationRequest) -> str:
        return (req.prompt or "") if body.echo else ""

    @contextlib.contextmanager
    def naming_prompt(i: int) -> Iterator[None]:
        try:
            yield
        except InvalidRequest as exc:
            if exc.param == "prompt" and len(requests) > 1:
                exc.param = f"prompt.{i}"  # which of the prompts
            raise

    async def prepare(i: int) -> PreparedGeneration:
        with naming_prompt(i):
            return await serving.service.prepare(requests[i], controls, tenant=tenant)

    if len(requests) > 1:
        # Every prompt is found acceptable (or refused, 400 naming it) before the first
        # byte: the prompts run one after another, and a refusal found at a later one's
        # turn could only end a response already under way.
        for i, req in enumerate(requests):
            with naming_prompt(i):
                await serving.service.check(req, tenant=tenant)
    first = await prepare(0)  # refuse (scope, a model that is not there) before any head
    ident, created = f"cmpl-{_answer_id()}", int(time.time())
    head = {"id": ident, "created": created, "object": "text_completion",
            "model": first.model_name,
            "system_fingerprint": "fp_" + first.model_digest[:12]}

    if not body.stream:
        choices, totals = [], [0, 0, 0]
        for i, req in enumerate(requests):
            done = await serving.service.complete(await prepare(i) if i else first)
            choices.append({"index": i, "text": echo(req) + done.text, "logprobs": None,
                            "finish_reason": done.reason})
            totals = [totals[0] + done.usage.prompt_tokens,
                      totals[1] + done.usage.completion_tokens,
                      totals[2] + done.usage.cached_tokens]
        return Answer({**head, "choices": choices, "usage": {
            "prompt_tokens": totals[0], "completion_tokens": totals[1],
            "total_tokens": totals[0] + totals[1],
            "prompt_tokens_details": {"cached_tokens": totals[2]}}})

    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(i: int, text: str, finish: str | None = None) -> bytes:
        obj: dict[str, Any] = {**head, "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}
        if with_usage:
            obj["usage"] = None
        return _sse(obj)

    async def events() -> AsyncIterator[bytes]:
        """The prompts one after the other (each checked before the stream started); a
        later prompt that cannot run at its turn (rate, queue, deadline) or fails ends the
        stream with an error event, like an error while generating."""
        usage = [0, 0, 0]
        for i, req in enumerate(requests):
            prepared = await prepare(i) if i else first
            try:
                if body.echo and req.prompt:
                    yield chunk(i, req.prompt)
                async for event in serving.service.stream(prepared):
                    if isinstance(event, TokenEvent):
                        yield chunk(i, event.text)
                    elif isinstance(event, DoneEvent):
                        yield chunk(i, "", event.reason)
                        u = event.usage
                        usage = [usage[0] + u.prompt_tokens, usage[1] + u.completion_tokens,
                                 usage[2] + u.cached_tokens]
                    elif isinstance(event, ErrorEvent):
                        yield _sse(openai_body(_edge(event.error)))
                        yield _sse("[DONE]")
                        return
            finally:
                await serving.service.release(prepared)
        if with_usage:
            yield _sse({**head, "choices": [], "usage": {
                "prompt_tokens": usage[0], "completion_tokens": usage[1],
                "total_tokens": usage[0] + usage[1],
                "prompt_tokens_details": {"cached_tokens": usage[2]}}})
        yield _sse("[DONE]")

    return Streamed(_ending_in_error_event(events()), {},
                    functools.partial(serving.service.release, first))


async def _embeddings(serving: OpenAIServing, body: EmbeddingBody, controls: Controls,
                      tenant: TenantContext | None,
                      disconnected: Callable[[], Awaitable[bool]] | None) -> Answer:
    inputs: list[str | list[int]]
    if isinstance(body.input, str):
        inputs = [body.input]
    elif body.input and all(isinstance(x, int) for x in body.input):
        inputs = [list(body.input)]  # type: ignore[arg-type]
    else:
        inputs = list(body.input)  # type: ignore[arg-type]
    if not inputs or any(x == "" or x == [] for x in inputs):
        raise InvalidRequest("input must not be empty", param="input")
    req = EmbeddingRequest(model=body.model, inputs=inputs)
    result = await serving.service.embed(req, controls, tenant=tenant,
                                         disconnected=disconnected)
    dims = len(result.vectors[0])
    if body.dimensions is not None and body.dimensions != dims:
        raise UnsupportedParameter(f"this model gives {dims} dimensions; "
                                   f"dimensions={body.dimensions} is not supported",
                                   param="dimensions")
    data = []
    for i, vec in enumerate(result.vectors):
        emb: list[float] | str = vec
        if body.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    served = serving.store.get(ModelName.parse(body.model)).name
    return Answer({"object": "list", "data": data, "model": served,
                         "usage": {"prompt_tokens": result.prompt_tokens,
                                   "total_tokens": result.prompt_tokens}})


