"""From a dialect-free request to tokens, limits and a scheduled job, and back as events.

This is the one place where a request becomes a prompt: template, tool instructions,
grammar, sampling defaults (llama.cpp's < the catalog entry's < the client's) and the
context check. Nothing here is silent: a prompt that does not fit is refused, never cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from edge_agent.engine.catalog import normalize_name
from edge_agent.engine.json_grammar import schema_to_grammar
from edge_agent.engine.registry import LoadedModel, ModelRegistry
from edge_agent.engine.request import (
    DoneEvent,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorEvent,
    Event,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from edge_agent.engine.scheduler import EmbeddingJob, GenerationJob, ThreadEmitter
from edge_agent.engine.structured import (
    parse_tool_output,
    tool_call_schema,
    tool_instructions,
    with_tool_messages,
)
from edge_agent.errors import (
    ContextLengthExceeded,
    EdgeAgentError,
    InvalidRequest,
    RequestTimeout,
)
from edge_agent.governance.redaction import Redactor
from edge_agent.governance.tenants import Governor, TenantContext
from edge_agent.ledger.store import CONTENTS, REDACTIONS
from edge_agent.logs import current_request_id, note
from edge_agent.telemetry.metrics import Metrics


@dataclass
class PreparedGeneration:
    model: LoadedModel
    request: GenerationRequest
    job: GenerationJob
    tool_mode: bool
    events: asyncio.Queue[Event]
    deadline: float | None  # loop time
    truncated_tokens: int = 0
    clamped_to: int | None = None
    released: bool = False

    def headers(self) -> dict[str, str]:
        """Governance made the request smaller than asked: say so (both dialects)."""
        out = {}
        if self.truncated_tokens:
            out["X-Edge-Truncated"] = str(self.truncated_tokens)
        if self.clamped_to is not None:
            out["X-Edge-Clamped"] = str(self.clamped_to)
        return out


class GenerationService:
    def __init__(self, registry: ModelRegistry, *, default_timeout_s: float | None = None,
                 metrics: Metrics | None = None, governor: Governor | None = None,
                 redactor: Redactor | None = None, keep_content: bool = False,
                 record: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.registry = registry
        self.governor = governor
        self.redactor = redactor
        self.keep_content = keep_content  # store redacted text (retention.content_hours > 0)
        self.record = record
        self.default_timeout_s = default_timeout_s
        self.metrics = metrics

    async def prepare(
        self, req: GenerationRequest, *, keep_alive: float | None = None
    ) -> PreparedGeneration:
        """Everything that can refuse the request (400, 404, 503 queue full …), done before
        any response starts; on success the job is queued."""
        loop = asyncio.get_running_loop()
        timeout = req.timeout_s or self.default_timeout_s
        if req.timeout_s and self.default_timeout_s:
            timeout = min(req.timeout_s, self.default_timeout_s)  # clients may only ask less
        deadline = loop.time() + timeout if timeout else None
        note(model=req.model, dialect=req.dialect)
        self._govern(req.tenant, req.model)
        req = self._redact_prompt(req)
        model, load_ns = await self.registry.acquire(req.model, keep_alive)
        try:
            prepared = self._prepare(req, model, load_ns, deadline)
            if deadline is not None and loop.time() >= deadline:
                raise RequestTimeout("the request timed out before it was queued")
            prepared.job.emit = ThreadEmitter(loop, prepared.events)
            model.worker.submit(prepared.job)
            return prepared
        except BaseException:
            await self.registry.release(model)
            raise

    def _prepare(self, req: GenerationRequest, model: LoadedModel, load_ns: int,
                 deadline: float | None) -> PreparedGeneration:
        defaults = {k: v for k, v in model.info.parameters.items()
                    if k in SamplingParams.field_names()}
        sampling = SamplingParams(**{**defaults, **req.sampling})
        stops = [*model.info.parameters.get("stop", []), *req.stop]

        tool_mode = bool(req.tools) and req.tool_choice != "none"
        schema = tool_call_schema(req.tools, req.tool_choice) if tool_mode else req.json_schema
        grammar = None
        if schema is not None:
            grammar = schema_to_grammar(
                schema, param="tools" if tool_mode else req.schema_param)

        window = model.worker.n_ctx
        if req.num_ctx is not None:
            if req.num_ctx > window:
                raise InvalidRequest(
                    f"num_ctx {req.num_ctx} exceeds this model's context of {window} tokens",
                    param="options.num_ctx")
            window = req.num_ctx
        policy = req.tenant.policy if req.tenant is not None else None
        ceiling = policy.max_output_tokens if policy else None
        if policy and policy.max_context_tokens and policy.max_context_tokens < window:
            window = policy.max_context_tokens
        requested = req.max_tokens if req.max_tokens is not None and req.max_tokens >= 0 \
            else None
        clamped = False
        if requested is not None and ceiling is not None and requested > ceiling:
            if policy is None or policy.output_limit != "clamp":
                raise InvalidRequest(
                    f"{req.max_tokens_param} {requested} exceeds the ceiling of {ceiling} "
                    "output tokens", param=req.max_tokens_param)
            requested, clamped = ceiling, True
        reserve = requested if requested is not None else 1
        tokens = self._tokens(req, model, tool_mode)
        truncated = 0
        if len(tokens) + reserve > window and policy is not None and \
                policy.truncate == "oldest_turns" and req.messages:
            tokens, truncated = self._drop_oldest_turns(req, model, tool_mode, tokens,
                                                        window - reserve)
        if len(tokens) >= window:
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens; the context window is {window} tokens",
                param="messages" if req.messages is not None else "prompt")
        if requested is None:
            max_tokens = window - len(tokens)
            if ceiling is not None:
                max_tokens = min(max_tokens, ceiling)
        elif len(tokens) + requested > window:
            raise ContextLengthExceeded(
                f"the context window is {window} tokens, but {len(tokens)} prompt "
                f"tokens plus {requested} requested output tokens need "
                f"{len(tokens) + requested}", param=req.max_tokens_param)
        else:
            max_tokens = requested
        priority = req.priority or (policy.priority if policy else "interactive")
        note(truncated_tokens=truncated, clamped=int(clamped))
        job = GenerationJob(prompt=tokens, params=sampling, grammar=grammar,
                            max_tokens=max_tokens, stops=stops, emit=_unset_emit,
                            priority=priority, load_ns=load_ns)
        return PreparedGeneration(model=model, request=req, job=job, tool_mode=tool_mode,
                                  events=asyncio.Queue(), deadline=deadline,
                                  truncated_tokens=truncated,
                                  clamped_to=max_tokens if clamped else None)

    def _tokens(self, req: GenerationRequest, model: LoadedModel, tool_mode: bool
                ) -> list[int]:
        text = self._prompt_text(req, model, tool_mode)
        tokens = list(req.context_tokens) + model.worker.model.tokenize(
            text, add_special=not req.context_tokens, parse_special=True)
        if not tokens:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return tokens

    def _drop_oldest_turns(self, req: GenerationRequest, model: LoadedModel, tool_mode: bool,
                           tokens: list[int], budget: int) -> tuple[list[int], int]:
        """The tenant's `truncate = "oldest_turns"`: keep the system prompt and the latest
        turn, drop the oldest turns until the prompt fits. Returns (tokens, dropped)."""
        assert req.messages is not None
        messages = list(req.messages)
        first = next((i for i, m in enumerate(messages) if m["role"] != "system"),
                     len(messages))
        original = len(tokens)
        while len(tokens) > budget and len(messages) - first > 1:
            del messages[first]
            while len(messages) - first > 1 and messages[first]["role"] == "tool":
                del messages[first]  # a tool result without its call makes no sense
            tokens = self._tokens(dataclasses.replace(req, messages=messages), model,
                                  tool_mode)
        return tokens, original - len(tokens)

    def _prompt_text(self, req: GenerationRequest, model: LoadedModel, tool_mode: bool) -> str:
        if req.messages is None:
            prompt = req.prompt or ""
            if req.raw or model.template is None:
                return prompt
            messages: list[dict[str, Any]] = []
            if req.system:
                messages.append({"role": "system", "content": req.system})
            messages.append({"role": "user", "content": prompt})
        else:
            messages = req.messages
        if model.template is None:
            raise InvalidRequest(
                f"model '{model.info.name}' has no chat template; use a completion endpoint",
                param="messages")
        if tool_mode:
            messages = with_tool_messages(
                messages, tool_instructions(req.tools, req.tool_choice),
                keep_tool_role=model.template.knows_tool_role)
        else:
            messages = [m for m in messages]
        return model.template.render(messages)

    async def stream(self, prepared: PreparedGeneration) -> AsyncIterator[Event]:
        """Runs the job; the events end with exactly one DoneEvent or ErrorEvent.

        Leaving the iteration early (client gone) cancels the job at its next step; passing
        the deadline does too, and ends the events with a RequestTimeout error.
        """
        loop = asyncio.get_running_loop()
        job = prepared.job
        first_token_ns = 0
        try:
            while True:
                if prepared.deadline is None:
                    event = await prepared.events.get()
                else:
                    try:
                        event = await asyncio.wait_for(prepared.events.get(),
                                                       prepared.deadline - loop.time())
                    except asyncio.TimeoutError:
                        job.cancelled.set()
                        event = ErrorEvent(RequestTimeout("the request passed its deadline"))
                if isinstance(event, TokenEvent):
                    first_token_ns = first_token_ns or time.perf_counter_ns()
                    if not prepared.tool_mode:  # tool answers are JSON until parsed
                        yield event
                    continue
                if isinstance(event, DoneEvent) and prepared.tool_mode:
                    event = _as_tool_answer(event)
                    if event.text:
                        yield TokenEvent(event.text)
                self._observe(prepared, event, first_token_ns)
                yield event
                return
        finally:
            job.cancelled.set()
            await self.release(prepared)

    def _redact_prompt(self, req: GenerationRequest) -> GenerationRequest:
        """Redaction of the prompt, when the tenant wants the model to see it redacted or
        when content is kept: spans go to the redaction log, redacted text (only) to the
        content table. Returns the request the model will see."""
        policy = req.tenant.policy if req.tenant is not None else None
        hide = bool(policy and policy.redact_prompt)
        if self.redactor is None or not (hide or self.keep_content):
            return req
        texts = [(m["role"], str(m.get("content") or "")) for m in req.messages] \
            if req.messages is not None else [("user", req.prompt or "")]
        redacted = [self._redact_and_log(text, "prompt", i, role)
                    for i, (role, text) in enumerate(texts)]
        if not hide:
            return req
        if req.messages is not None:
            messages = [{**m, "content": r} for m, r in zip(req.messages, redacted, strict=True)]
            return dataclasses.replace(req, messages=messages)
        return dataclasses.replace(req, prompt=redacted[0])

    def _redact_and_log(self, text: str, direction: str, index: int, role: str) -> str:
        assert self.redactor is not None
        redacted, spans = self.redactor.redact(text)
        if self.record is None:
            return redacted
        request_id = current_request_id()
        for span in spans:
            self.record(REDACTIONS, {
                "request_id": request_id, "direction": direction, "message_index": index,
                "entity_type": span.entity, "detector": span.detector,
                "detector_version": span.detector_version, "operator": span.operator,
                "start": span.start, "end": span.end,
                "policy_version": self.redactor.policy_version})
        if self.keep_content:
            self.record(CONTENTS, {"request_id": request_id, "direction": direction,
                                   "message_index": index, "role": role, "text": redacted,
                                   "ts": time.time()})
        return redacted

    def _govern(self, tenant: TenantContext | None, model: str) -> None:
        """Scope (403) and rate/quota (429), before a model is loaded or a slot taken."""
        if tenant is None:
            return
        tenant.check_model(normalize_name(model))
        if self.governor is not None:
            self.governor.admit(tenant)

    def _observe(self, prepared: PreparedGeneration, event: Event, first_token_ns: int
                 ) -> None:
        """The end of a generation, into metrics and the request's access line / ledger row."""
        name, dialect = prepared.model.info.name, prepared.request.dialect
        if isinstance(event, DoneEvent):
            u, t = event.usage, event.timings
            end = first_token_ns or time.perf_counter_ns()
            ttft = (end - prepared.job.submitted_ns + prepared.job.load_ns) / 1e9
            tpot = t.eval_ns / 1e6 / (u.completion_tokens - 1) if u.completion_tokens > 1 else 0
            note(model=name, model_digest=prepared.model.info.digest, dialect=dialect,
                 ttft_ms=round(ttft * 1000, 1), tpot_ms=round(tpot, 2),
                 queue_ms=round(t.queue_ns / 1e6, 1), prompt_tokens=u.prompt_tokens,
                 cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens,
                 done_reason=event.reason,
                 structured_failure=int(_structured_failure(prepared, event)))
            if self.metrics is not None:
                self.metrics.observe_done(name, dialect, event, ttft)
            if self.redactor is not None and self.keep_content:
                self._redact_and_log(event.text, "response", 0, "assistant")
            tenant = prepared.request.tenant
            if self.governor is not None and tenant is not None:
                self.governor.charge(tenant, u.prompt_tokens - u.cached_tokens
                                     + u.completion_tokens)
        elif isinstance(event, ErrorEvent):
            error = _as_edge_error(event.error)
            note(model=name, dialect=dialect, error_type=error.error_type)
            if self.metrics is not None:
                error.observed = True
                self.metrics.observe_error(name, dialect, error)

    async def release(self, prepared: PreparedGeneration) -> None:
        """Hand the model back; safe to call twice (a response that never started streaming
        is released by its background task)."""
        if not prepared.released:
            prepared.released = True
            prepared.job.cancelled.set()
            await self.registry.release(prepared.model)

    async def complete(self, prepared: PreparedGeneration) -> DoneEvent:
        async for event in self.stream(prepared):
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise _as_edge_error(event.error)
        raise EdgeAgentError("generation ended without a result")

    async def embed(self, req: EmbeddingRequest, *, keep_alive: float | None = None,
                    disconnected: Callable[[], Awaitable[bool]] | None = None
                    ) -> EmbeddingResult:
        """Embeds every input, in chunks between the model's generation steps. Bounded per
        request (`max_embedding_inputs`, `max_embedding_tokens`: 400 naming `input`); the
        work stops at its next chunk when the caller is cancelled or `disconnected()`
        (polled while waiting) says the client has gone."""
        note(model=req.model, dialect=req.dialect)
        runtime = self.registry.settings.runtime
        if len(req.inputs) > runtime.max_embedding_inputs:
            raise InvalidRequest(
                f"{len(req.inputs)} inputs; at most {runtime.max_embedding_inputs} per "
                "request", param="input")
        self._govern(req.tenant, req.model)
        model, load_ns = await self.registry.acquire(req.model, keep_alive)
        try:
            inputs, truncated = self._embedding_inputs(req, model, runtime.max_embedding_tokens)
            loop = asyncio.get_running_loop()
            future: asyncio.Future[EmbeddingResult | Exception] = loop.create_future()

            def done(result: EmbeddingResult | Exception) -> None:
                try:
                    loop.call_soon_threadsafe(_settle, future, result)
                except RuntimeError:  # the loop is gone (shutdown): nobody is waiting
                    pass

            job = EmbeddingJob(inputs=inputs, truncated_tokens=truncated, done=done)
            model.worker.submit(job)
            try:
                result = await _wait_unless_gone(future, disconnected)
            finally:
                job.cancelled.set()  # a no-op once done; else the worker stops at once
        finally:
            await self.registry.release(model)
        if isinstance(result, Exception):
            raise _as_edge_error(result)
        note(model=model.info.name, model_digest=model.info.digest,
             prompt_tokens=result.prompt_tokens, truncated_tokens=result.truncated_tokens)
        return dataclasses.replace(
            result, timings=dataclasses.replace(result.timings, load_ns=load_ns,
                                                total_ns=result.timings.total_ns + load_ns))

    @staticmethod
    def _embedding_inputs(req: EmbeddingRequest, model: LoadedModel, max_tokens: int
                          ) -> tuple[list[list[int]], int]:
        """The inputs as tokens, each within the embedding context (cut when the request
        allows it), all together within `max_tokens`; and how many tokens were cut."""
        llama = model.worker.model
        limit = model.worker.embed_ctx
        inputs: list[list[int]] = []
        truncated = total = 0
        for i, item in enumerate(req.inputs):
            tokens = (llama.tokenize(item, add_special=True, parse_special=False)
                      if isinstance(item, str) else list(item))
            if not tokens:
                raise InvalidRequest(f"input {i} is empty", param="input")
            if any(t < 0 or t >= llama.n_vocab for t in tokens):
                raise InvalidRequest(f"input {i} has a token id outside the vocabulary",
                                     param="input")
            if len(tokens) > limit:
                if not req.truncate:
                    raise ContextLengthExceeded(
                        f"input {i} is {len(tokens)} tokens; the embedding context is "
                        f"{limit} tokens", param="input")
                truncated += len(tokens) - limit
                tokens = tokens[:limit]
            total += len(tokens)
            if total > max_tokens:
                raise InvalidRequest(
                    f"the inputs come to more than {max_tokens} tokens, the most one "
                    "embedding request may carry; split them over several requests",
                    param="input")
            inputs.append(tokens)
        return inputs, truncated


class ClientDisconnected(EdgeAgentError):
    """The client left before its answer was ready (nginx's 499; nobody reads the body)."""

    status_code = 499
    error_type = "client_closed_request"
    code = "client_closed_request"


# How often a waiting embedding request asks whether its client is still there.
DISCONNECT_POLL_S = 0.25


async def _wait_unless_gone(future: asyncio.Future[EmbeddingResult | Exception],
                            disconnected: Callable[[], Awaitable[bool]] | None
                            ) -> EmbeddingResult | Exception:
    if disconnected is None:
        return await future
    while True:
        finished, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
        if finished:
            return future.result()
        if await disconnected():
            raise ClientDisconnected("the client disconnected")


def _settle(future: asyncio.Future[EmbeddingResult | Exception],
            result: EmbeddingResult | Exception) -> None:
    if not future.done():  # the waiter may have been cancelled meanwhile
        future.set_result(result)


def _structured_failure(prepared: PreparedGeneration, event: DoneEvent) -> bool:
    """A grammar-constrained answer that did not complete (cut by max_tokens, cancelled)."""
    if prepared.job.grammar is None or event.tool_calls:
        return False
    try:
        json.loads(event.text)
    except json.JSONDecodeError:
        return True
    return False


def _as_tool_answer(event: DoneEvent) -> DoneEvent:
    content, calls = parse_tool_output(event.text)
    return dataclasses.replace(event, text=content or "", tool_calls=calls,
                               reason="tool_calls" if calls else event.reason)


def _as_edge_error(exc: Exception) -> EdgeAgentError:
    if isinstance(exc, EdgeAgentError):
        return exc
    wrapped = EdgeAgentError("internal server error")
    wrapped.__cause__ = exc
    return wrapped


def _unset_emit(event: Event) -> None:
    raise RuntimeError("job emitted before it was scheduled")
