"""From a dialect-free request to tokens, limits and a scheduled job, and back as events.

This is the one place where a request becomes a prompt: template, tool instructions,
grammar, sampling defaults (llama.cpp's < the catalog entry's < the client's) and the
context check. Nothing here is silent: a prompt that does not fit is refused, never cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
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
from edge_agent.engine.runtime import LlamaModel
from edge_agent.engine.scheduler import EmbeddingJob, GenerationJob, ThreadEmitter
from edge_agent.engine.structured import (
    ToolAnswerReader,
    tool_call_schema,
    tool_instructions,
    with_tool_messages,
)
from edge_agent.engine.templates import Piece
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
    context: int = 0  # the context window this request is served with, in tokens

    def headers(self) -> dict[str, str]:
        """The context served, and where governance made the request smaller than asked,
        that too (both dialects)."""
        out = {"X-Edge-Context": str(self.context)} if self.context else {}
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
        if req.end_user:
            note(end_user=self._end_user_digest(req.end_user))
        self._govern(req.tenant, req.model)
        req = self._redact_prompt(req)
        model, load_ns = await self.registry.acquire(req.model, keep_alive)
        try:
            # A new schema's grammar is checked in a child process (0.1-0.3 s): off the loop.
            grammar = await asyncio.to_thread(self._grammar, req)
            prepared = self._prepare(req, model, load_ns, deadline, grammar)
            if deadline is not None and loop.time() >= deadline:
                raise RequestTimeout("the request timed out before it was queued")
            prepared.job.emit = ThreadEmitter(loop, prepared.events)
            model.worker.submit(prepared.job)
            return prepared
        except BaseException:
            await self.registry.release(model)
            raise

    @staticmethod
    def _grammar(req: GenerationRequest) -> str | None:
        if req.tools and req.tool_choice != "none":
            return schema_to_grammar(tool_call_schema(req.tools, req.tool_choice), param="tools")
        if req.json_schema is None:
            return None
        return schema_to_grammar(req.json_schema, param=req.schema_param)

    def _prepare(self, req: GenerationRequest, model: LoadedModel, load_ns: int,
                 deadline: float | None, grammar: str | None) -> PreparedGeneration:
        defaults = {k: v for k, v in model.info.parameters.items()
                    if k in SamplingParams.field_names()}
        sampling = SamplingParams(**{**defaults, **req.sampling})
        stops = [*model.info.parameters.get("stop", []), *req.stop]

        tool_mode = bool(req.tools) and req.tool_choice != "none"

        # Ollama's num_ctx sizes a model at load time; clients send back whatever /api/show
        # reported. The box serves the context it is configured for (X-Edge-Context says
        # which) and refuses only a prompt that does not fit in it.
        window = model.worker.n_ctx
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
        sampling = _bounded(sampling, model.worker.model.n_vocab, window)
        tokens = self._tokens(req, model, tool_mode)
        truncated = 0
        if len(tokens) + reserve > window and policy is not None and \
                policy.truncate == "oldest_turns" and req.messages:
            tokens, truncated = self._drop_oldest_turns(req, model, tool_mode, tokens,
                                                        window - reserve)
        if len(tokens) >= window:
            raise _too_long(req, window, len(tokens), None)
        if requested is None:
            max_tokens = window - len(tokens)
            if ceiling is not None:
                max_tokens = min(max_tokens, ceiling)
        elif len(tokens) + requested > window:
            raise _too_long(req, window, len(tokens), requested)
        else:
            max_tokens = requested
        priority = req.priority or (policy.priority if policy else "interactive")
        note(truncated_tokens=truncated, clamped=int(clamped))
        job = GenerationJob(prompt=tokens, params=sampling, grammar=grammar,
                            max_tokens=max_tokens, stops=stops, emit=_unset_emit,
                            priority=priority, load_ns=load_ns, cache_key=req.cache_key)
        return PreparedGeneration(model=model, request=req, job=job, tool_mode=tool_mode,
                                  events=asyncio.Queue(), deadline=deadline,
                                  truncated_tokens=truncated,
                                  clamped_to=max_tokens if clamped else None, context=window)

    def _tokens(self, req: GenerationRequest, model: LoadedModel, tool_mode: bool
                ) -> list[int]:
        """The prompt's tokens: the caller's own token ids (OpenAI's token prompt, Ollama's
        `context`), checked against the vocabulary before anything is queued, then the
        text, tokenized piece by piece (see `_prompt_pieces`)."""
        llama = model.worker.model
        tokens = list(req.context_tokens)
        if len(tokens) >= model.worker.n_ctx:
            raise ContextLengthExceeded(
                f"{req.context_param} holds {len(tokens)} tokens; the context window is "
                f"{model.worker.n_ctx} tokens", param=req.context_param)
        check_token_ids(tokens, llama.n_vocab, req.context_param)
        tokens += tokenize_pieces(llama, self._prompt_pieces(req, model, tool_mode),
                                  add_special=not tokens)
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

    def _prompt_pieces(self, req: GenerationRequest, model: LoadedModel, tool_mode: bool
                       ) -> list[Piece]:
        """The prompt as (text, parse_special) pieces. A raw prompt (`raw`, OpenAI's
        completions, a model without a template) is the caller's own text: its special-token
        text is parsed, as llama.cpp's and Ollama's servers do. Through the template, only
        the template's markers are: what the client wrote is never parsed as control tokens
        (see `ChatTemplate.render_pieces`)."""
        if req.messages is None:
            prompt = req.prompt or ""
            if req.raw or model.template is None:
                return [(prompt, True)]
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
        return model.template.render_pieces(messages,
                                            find_special=model.worker.model.special_texts)

    async def stream(self, prepared: PreparedGeneration, *, tool_deltas: bool = False
                     ) -> AsyncIterator[Event]:
        """Runs the job; the events end with exactly one DoneEvent or ErrorEvent.

        In tool mode the answer's JSON is read as it comes: its answer text arrives as
        TokenEvents, and with `tool_deltas` a call arrives as ToolCallEvents as soon as its
        name is known (OpenAI's streamed shape); the DoneEvent carries the parsed calls.
        Leaving the iteration early (client gone) cancels the job at its next step; passing
        the deadline does too, and ends the events with a RequestTimeout error.
        """
        loop = asyncio.get_running_loop()
        job = prepared.job
        first_token_ns = 0
        reader = ToolAnswerReader() if prepared.tool_mode else None
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
                    if reader is None:
                        yield event
                        continue
                    for part in reader.feed(event.text):  # tool answers are JSON: read them
                        if isinstance(part, str):
                            yield TokenEvent(part)
                        elif tool_deltas:
                            yield part
                    continue
                failed = None
                if isinstance(event, DoneEvent) and reader is not None:
                    event, failed = _as_tool_answer(event, reader)
                self._observe(prepared, event, first_token_ns, failed)
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
        # Model output gets the lenient pass too: over-redaction is cheap there.
        redacted, spans = self.redactor.redact(text, lenient=direction == "response")
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

    def _end_user_digest(self, value: str) -> str:
        """A client's end-user id (`user`, `safety_identifier`) as the ledger keeps it: a
        digest keyed per device, so one user's requests correlate and the id never shows."""
        key = self.redactor.key if self.redactor is not None else b""
        return hmac.new(key, value.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:24]

    def _govern(self, tenant: TenantContext | None, model: str) -> None:
        """Scope (403) and rate/quota (429), before a model is loaded or a slot taken."""
        if tenant is None:
            return
        tenant.check_model(normalize_name(model))
        if self.governor is not None:
            self.governor.admit(tenant)

    def _observe(self, prepared: PreparedGeneration, event: Event, first_token_ns: int,
                 failed: bool | None = None) -> None:
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
                 structured_failure=int(_structured_failure(prepared, event)
                                        if failed is None else failed))
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


def _bounded(sampling: SamplingParams, n_vocab: int, window: int) -> SamplingParams:
    """Sampler settings as llama.cpp can take them: logit_bias ids in the vocabulary;
    top_k at most the vocabulary (beyond, it would wrap around in int32); repeat_last_n at
    most the window, and -1 the window (Ollama's "num_ctx"): llama.cpp allocates that many
    tokens per request (2^28 took 1 GB) and reads -1 as "off"."""
    check_token_ids([t for t, _ in sampling.logit_bias], n_vocab, "logit_bias")
    last_n = sampling.repeat_last_n
    return dataclasses.replace(
        sampling, top_k=min(sampling.top_k, n_vocab),
        repeat_last_n=window if last_n < 0 or last_n > window else last_n)


def tokenize_pieces(llama: LlamaModel, pieces: list[Piece], *, add_special: bool
                    ) -> list[int]:
    """The tokens of a prompt's pieces in order, each with its own `parse_special`; BOS (if
    the model wants one) only before the first. One piece: exactly the one-string path."""
    tokens: list[int] = []
    for i, (text, special) in enumerate(pieces):
        if text or i == 0:  # an empty prompt alone still gets its BOS, as always
            tokens += llama.tokenize(text, add_special=add_special, parse_special=special)
            add_special = False
    return tokens


def check_token_ids(tokens: list[int], n_vocab: int, param: str) -> None:
    """Token ids from a client must index the vocabulary: one outside it reaches llama.cpp
    as an out-of-bounds read, one past int32 cannot even be put in a batch."""
    if tokens and (min(tokens) < 0 or max(tokens) >= n_vocab):
        bad = next(t for t in tokens if not 0 <= t < n_vocab)
        raise InvalidRequest(f"{param} holds token id {bad}, outside this model's vocabulary "
                             f"(0 to {n_vocab - 1})", param=param)


def _structured_failure(prepared: PreparedGeneration, event: DoneEvent) -> bool:
    """A grammar-constrained answer that did not complete (cut by max_tokens, cancelled)."""
    if prepared.job.grammar is None or event.tool_calls:
        return False
    try:
        json.loads(event.text)
    except json.JSONDecodeError:
        return True
    return False


def _as_tool_answer(event: DoneEvent, reader: ToolAnswerReader) -> tuple[DoneEvent, bool]:
    """The end of a tool-mode answer: its text and calls, never the internal JSON; and
    whether it failed to complete (the structured-failure flag)."""
    answer = reader.finish()
    done = dataclasses.replace(event, text=answer.content, tool_calls=answer.calls,
                               reason="tool_calls" if answer.calls else event.reason)
    return done, not answer.complete


def _too_long(req: GenerationRequest, window: int, prompt: int, output: int | None
              ) -> ContextLengthExceeded:
    """Worded with the phrases Ollama's clients (and litellm's generic check) look for; the
    numbers ride along so the OpenAI dialect can say it in OpenAI's words."""
    kind = "messages" if req.messages is not None else "prompt"
    if output is None:
        what, param = f"a prompt of {prompt} tokens", kind
    else:
        what = (f"a request of {prompt + output} tokens ({prompt} in the prompt, {output} "
                f"for {req.max_tokens_param})")
        param = req.max_tokens_param
    return ContextLengthExceeded(
        f"the input length exceeds the context length: {what} exceeds the available context "
        f"size (the context window is {window} tokens)", param=param, window=window,
        prompt_tokens=prompt, output_tokens=output, input_kind=kind)


def _as_edge_error(exc: Exception) -> EdgeAgentError:
    if isinstance(exc, EdgeAgentError):
        return exc
    wrapped = EdgeAgentError("internal server error")
    wrapped.__cause__ = exc
    return wrapped


def _unset_emit(event: Event) -> None:
    raise RuntimeError("job emitted before it was scheduled")
