"""A generation request's way through the box: refuse early, then run and observe.

`prepare` does everything that can refuse a request (scope 403, quota 429, bad parameter
400, context 400, unknown model 404, queue full 503) before any response starts, and on a
saturated box degrades it as its risk tier allows (`gateway.degrade`); `check`
does the part of it that depends on the request alone, for a response made of several
generations that must all be acceptable before its first byte; `stream`
yields the events, enforces the deadline, reads tool calls out of a tool-mode answer, and
ends with exactly one observation (access line / ledger row, metrics, quota charge).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from edge_agent.engine.constrained.tool_calls import ToolAnswerReader
from edge_agent.engine.prompt import grammar_for, sampling_for, stops_for, tool_mode
from edge_agent.engine.registry import LoadedModel, ModelRegistry
from edge_agent.engine.request import (
    DoneEvent,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorEvent,
    Event,
    Generation,
    GenerationRequest,
    GenerationSpec,
    RestartEvent,
    TokenEvent,
    ToolCallEvent,
)
from edge_agent.errors import (
    ContextLengthExceeded,
    DeadlineUnmet,
    EdgeAgentError,
    ModelNotFound,
    NotDegraded,
    RequestTimeout,
    ServiceUnavailable,
    ShuttingDown,
    UpstreamFailed,
)
from edge_agent.gateway import embeddings
from edge_agent.gateway.controls import Controls
from edge_agent.gateway.degrade import Degradation, RiskPolicy, saturation
from edge_agent.gateway.limits import Fit, fit, requested_output, window_for
from edge_agent.gateway.observe import Observer, Served, as_edge_error
from edge_agent.gateway.privacy import Later, Record, RequestPrivacy
from edge_agent.gateway.routing import Plan, Router, UpstreamCall
from edge_agent.governance.redaction import Redactor
from edge_agent.governance.tenants import Governor, TenantContext
from edge_agent.logs import note
from edge_agent.names import ModelName
from edge_agent.telemetry.metrics import Metrics

NO_CONTROLS = Controls()  # a request the request path treats by its tenant's defaults


@dataclass
class PreparedGeneration:
    model: LoadedModel | None  # None: an upstream answers (`call`)
    request: GenerationRequest
    generation: Generation
    served: Served
    tool_mode: bool
    deadline: float | None  # loop time
    fit: Fit
    released: bool = False
    degradation: Degradation | None = None  # answered by a fallback model (risk tiers)
    call: UpstreamCall | None = None  # answered by an upstream (`gateway.routing`)
    first: Event | None = None  # an upstream's first event, read before the answer starts

    @property
    def model_name(self) -> str:
        """The model that answers, by the name clients use."""
        return self.served.model

    @property
    def model_digest(self) -> str:
        """Its digest; for an upstream's answer, `upstream:NAME`."""
        return self.served.digest

    def headers(self, done: DoneEvent | None = None) -> dict[str, str]:
        """The context served, and where governance made the request smaller than asked,
        that too (both dialects); with the answer (`done`, a non-streamed response), whether
        the last tokens of its budget closed it (`X-Edge-Closed`) and where its time went
        (`Server-Timing`: queued, prompt, decoding, in ms); and where a saturated box
        answered with a fallback model, that (`X-Edge-Degraded`)."""
        out = {"X-Edge-Context": str(self.fit.window)} if self.fit.window else {}
        if self.fit.truncated_tokens:
            out["X-Edge-Truncated"] = str(self.fit.truncated_tokens)
        if self.fit.clamped:
            out["X-Edge-Clamped"] = str(self.fit.max_tokens)
        if done is not None and done.closed:
            out["X-Edge-Closed"] = "max_tokens"
        if done is not None:  # where the server's time went, as a client can read it
            t = done.timings
            out["Server-Timing"] = (f"queue;dur={t.queue_ns / 1e6:.1f}, "
                                    f"prompt;dur={t.prompt_ns / 1e6:.1f}, "
                                    f"decode;dur={t.eval_ns / 1e6:.1f}")
        if self.degradation is not None:
            out["X-Edge-Degraded"] = self.degradation.header()
        if self.call is not None:
            out["X-Edge-Route"] = (f"upstream; upstream={self.call.upstream.name}; "
                                   f"reason={self.call.reason}")
        return out


class GenerationService:
    def __init__(self, registry: ModelRegistry, *, default_timeout_s: float | None = None,
                 metrics: Metrics | None = None, governor: Governor | None = None,
                 redactor: Redactor | None = None, keep_content: bool = False,
                 record: Record | None = None, later: Later | None = None) -> None:
        self.registry = registry
        self.risk = RiskPolicy(registry.settings, metrics,
                               lambda name: registry.store.get(name) is not None)
        self.governor = governor
        self.default_timeout_s = default_timeout_s
        self.privacy = RequestPrivacy(redactor, keep_content=keep_content, record=record,
                                      later=later)
        self.observer = Observer(metrics, governor, self.privacy)
        self.router = Router.from_settings(
            registry.settings, redactor.detectors if redactor is not None else None, metrics)
        # The generations being streamed now, for `cut_all` at a stop (keyed by id: one
        # entry per running `stream`).
        self._live: dict[int, Generation] = {}

    async def prepare(self, req: GenerationRequest, controls: Controls = NO_CONTROLS, *,
                      tenant: TenantContext | None = None, keep_alive: float | None = None
                      ) -> PreparedGeneration:
        """Everything that can refuse the request, done before any response starts; on
        success the job is queued here, or sent to an upstream (`gateway.routing`)."""
        loop = asyncio.get_running_loop()
        deadline = self._deadline(loop, controls.timeout_s)
        note(model=req.model, dialect=controls.dialect)
        if controls.end_user:
            note(end_user=self.privacy.end_user_digest(controls.end_user))
        name = ModelName.parse(req.model)  # the request path's one parse of the name
        self._govern(tenant, name)
        tier = self.risk.tier(tenant, controls.risk)
        plan = self.router.plan(name, tenant, controls.route)
        req = self.privacy.redact_prompt(req, tenant)

        async def upstream(reason: str, tokens: int | None = None, spare: bool = False
                           ) -> PreparedGeneration | None:
            """An upstream's answer, or None. Where the box has a way of its own (a route
            that tries an upstream first, a batch's line, a saturated box's fallback or
            refusal), an upstream that fails before its first token is passed over and the
            box goes its own way; where it has none, the failure is the answer (502)."""
            try:
                return await self._upstream(req, controls, name, tenant, plan, deadline,
                                            reason, tokens, spare)
            except UpstreamFailed:
                if reason in ("asked", "not_installed", "context"):
                    raise
                return None

        if controls.route == "upstream":
            prepared = await upstream("asked")
            if prepared is None:
                raise self.router.refuse_asked(plan, name, tenant)
            return prepared
        if controls.batch_line and self._busy(name) and \
                (prepared := await upstream("batch", spare=True)) is not None:
            return prepared
        if plan.upstream_first and (prepared := await upstream("route")) is not None:
            return prepared
        try:
            return await self._start(req, controls, name, tenant, keep_alive, deadline)
        except ModelNotFound:
            if (prepared := await upstream("not_installed")) is None:
                if self.router.serves(name, plan):  # only the upstream has it: not now
                    raise self.router.unavailable(name) from None
                raise
            return prepared
        except ContextLengthExceeded as exc:
            needed = (exc.prompt_tokens or 0) + (exc.output_tokens or 0)
            if not _the_box_limit(exc, tenant) or \
                    (prepared := await upstream("context", needed)) is None:
                raise
            return prepared
        except ServiceUnavailable as exc:
            reason = saturation(exc)
            if reason is None:
                raise
            saturated: ServiceUnavailable = exc
        # Saturated. An upstream serving the model asked comes before its smaller local
        # fallback unless [routing] saturated says otherwise; a high-tier request goes to
        # neither (the risk tiers refuse it). The upstream is tried once, first or last.
        tried = tier == "high"

        async def spill() -> PreparedGeneration | None:
            nonlocal tried
            if tried:
                return None
            tried = True
            return await upstream("saturated")

        if (controls.batch_line or self.registry.settings.routing.saturated == "upstream") \
                and (prepared := await spill()) is not None:
            return prepared
        if controls.batch_line:
            raise saturated
        try:
            fallback = self.risk.degrade(tier, reason, name, tenant, saturated,
                                         defer=controls.defer)
        except NotDegraded:
            if (prepared := await spill()) is not None:
                return prepared
            raise
        try:
            prepared = await self._start(req, controls, fallback, tenant, keep_alive,
                                         deadline)
        except ServiceUnavailable as exc:
            if (spilled := await spill()) is not None:
                return spilled
            raise self.risk.fallback_failed(tier, reason, name, fallback, exc) from exc
        prepared.degradation = self.risk.fell_back(tier, reason, name)
        return prepared

    def _busy(self, name: ModelName) -> bool:
        """Whether `name` is loaded with every sequence taken (a line queued would wait)."""
        return any(m.info.name == name and m.saturated for m in self.registry.loaded())

    async def _upstream(self, req: GenerationRequest, controls: Controls, name: ModelName,
                        tenant: TenantContext | None, plan: Plan, deadline: float | None,
                        reason: str, tokens: int | None = None, spare: bool = False
                        ) -> PreparedGeneration | None:
        """The request sent to the first upstream that may take it, or None. Its first
        event is read here, before any response starts: an upstream that fails at once
        (unreachable, a 5xx, no answer in its bound) is the response's status, as a local
        refusal is, not an error inside a stream that began with 200."""
        upstream = self.router.pick(req, name, plan, tokens=tokens, spare=spare)
        if upstream is None:
            return None
        call = self.router.start(upstream, req, name, plan, reason)
        served = Served(model=str(name), digest=f"upstream:{upstream.name}",
                        dialect=controls.dialect, tenant=tenant,
                        submitted_ns=call.generation.submitted_ns, load_ns=0,
                        constrained=req.json_schema is not None, upstream=True,
                        schema=req.json_schema is not None, tools=bool(req.tools),
                        n_ctx=upstream.settings.context_length)
        prepared = PreparedGeneration(model=None, request=req, generation=call.generation,
                                      served=served, tool_mode=False, deadline=deadline,
                                      fit=Fit([], req.max_tokens or 0, 0), call=call)
        try:
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            prepared.first = await asyncio.wait_for(call.generation.events.get(), left)
        except (TimeoutError, asyncio.TimeoutError):
            await self.release(prepared)
            raise RequestTimeout("the request passed its deadline") from None
        except BaseException:
            await self.release(prepared)
            raise
        if isinstance(prepared.first, ErrorEvent):
            await self.release(prepared)
            raise as_edge_error(prepared.first.error)
        return prepared

    async def _start(self, req: GenerationRequest, controls: Controls, name: ModelName,
                     tenant: TenantContext | None, keep_alive: float | None,
                     deadline: float | None) -> PreparedGeneration:
        """The request queued on the model `name`."""
        loop = asyncio.get_running_loop()
        model, load_ns = await self.registry.acquire(name, keep_alive)
        try:
            grammar = await self._grammar(req, model)
            spec, fitted = self._plan(req, controls, tenant, model, load_ns, grammar)
            if deadline is not None:
                _check_deadline(model, deadline - loop.time())
            generation = model.generate(spec, loop)
        except BaseException:
            await self.registry.release(model)
            raise
        served = Served(model=model.info.name, digest=model.info.digest,
                        dialect=controls.dialect,
                        tenant=tenant, submitted_ns=generation.submitted_ns, load_ns=load_ns,
                        constrained=grammar is not None,
                        schema=req.json_schema is not None, tools=bool(req.tools),
                        prompt_tokens=len(fitted.tokens), n_ctx=model.n_ctx)
        return PreparedGeneration(model=model, request=req, generation=generation,
                                  served=served, tool_mode=tool_mode(req), deadline=deadline,
                                  fit=fitted)

    async def check(self, req: GenerationRequest, *, tenant: TenantContext | None = None
                    ) -> None:
        """What `prepare` refuses of the request itself — scope, an unknown model, a bad
        parameter, its prompt (empty, a token id outside the vocabulary, too long for the
        window) — found without queuing it. For a response made of generations run one
        after another (a completion's list of prompts): every part is checked before the
        response starts, so a later part cannot be refused after an earlier one streamed.
        Nothing is observed, logged or charged here but a refused schema's count, as
        `prepare` counts it (`_grammar`); rate and quota (what running spends),
        the deadline and the queue are `prepare`'s, at each part's turn."""
        name = ModelName.parse(req.model)
        if tenant is not None:
            tenant.check_model(name)
        req = self.privacy.redact_prompt(req, tenant, keep=False)
        try:
            model, load_ns = await self.registry.acquire(name)
        except ModelNotFound:
            # A model only an upstream serves: each part is routed at its turn.
            if self.router.pick(req, name, self.router.plan(name, tenant, None)) is None:
                raise
            return
        try:
            grammar = await self._grammar(req, model)
            self._plan(req, NO_CONTROLS, tenant, model, load_ns, grammar)
        finally:
            await self.registry.release(model)

    async def _grammar(self, req: GenerationRequest, model: LoadedModel) -> str | None:
        """The grammar the answer must follow, or None. A new schema's grammar is checked
        in a child process (0.1-0.3 s): off the loop. A schema, tools or tool_choice the
        box cannot follow is refused (400) and counted as a structured refusal against
        the model asked, installed and loaded by now: this is where a request's schema or
        tools become a grammar, for `prepare` and `check` alike, so the one place such a
        refusal happens (a request an upstream answers takes no grammar here). A failure
        that is the box's (503: no child process now) is not the schema's, and is not
        counted as one."""
        try:
            return await asyncio.to_thread(grammar_for, req)
        except EdgeAgentError as exc:
            if exc.status_code < 500:
                self.observer.structured_refused(model.info.name)
            raise

    def _deadline(self, loop: asyncio.AbstractEventLoop, asked: float | None) -> float | None:
        timeout = asked or self.default_timeout_s
        if asked and self.default_timeout_s:
            timeout = min(asked, self.default_timeout_s)  # clients may only ask less
        return loop.time() + timeout if timeout else None

    @staticmethod
    def _plan(req: GenerationRequest, controls: Controls, tenant: TenantContext | None,
              model: LoadedModel, load_ns: int, grammar: str | None
              ) -> tuple[GenerationSpec, Fit]:
        policy = tenant.policy if tenant is not None else None
        window = window_for(model.n_ctx, policy)
        requested, clamped = requested_output(req, policy)
        sampling = sampling_for(req, model, window)
        fitted = fit(req, model, policy, window=window, requested=requested, clamped=clamped)
        priority = controls.priority or (policy.priority if policy else "interactive")
        note(truncated_tokens=fitted.truncated_tokens, clamped=int(fitted.clamped))
        spec = GenerationSpec(prompt=fitted.tokens, params=sampling, grammar=grammar,
                              max_tokens=fitted.max_tokens, stops=stops_for(req, model),
                              priority=priority, load_ns=load_ns, cache_key=req.cache_key,
                              draft=req.draft if req.draft is not None else controls.draft,
                              stream=req.stream, yields=controls.batch_line,
                              system_tokens=fitted.system_tokens)
        return spec, fitted

    def _govern(self, tenant: TenantContext | None, model: ModelName) -> None:
        """Scope (403) and rate/quota (429), before a model is loaded or a slot taken."""
        if tenant is None:
            return
        tenant.check_model(model)
        if self.governor is not None:
            self.governor.admit(tenant)

    async def stream(self, prepared: PreparedGeneration, *, tool_deltas: bool = False
                     ) -> AsyncIterator[Event]:
        """Runs the job; the events end with exactly one DoneEvent or ErrorEvent.

        In tool mode the answer's JSON is read as it comes: its answer text arrives as
        TokenEvents, and with `tool_deltas` a call arrives as ToolCallEvents as soon as its
        name is known (OpenAI's streamed shape); the DoneEvent carries the parsed calls.
        Leaving the iteration early (client gone) cancels the job at its next step; passing
        the deadline does too, and ends the events with a RequestTimeout error. A request
        that is not streamed (`GenerationRequest.stream` False) yields one TokenEvent, its
        first text, for the time to the first token; the whole text is the DoneEvent's.
        """
        loop = asyncio.get_running_loop()
        generation = prepared.generation
        first_token_ns = 0
        given = 0  # characters of text the TokenEvents carried (not streamed: the first)
        reader = ToolAnswerReader() if prepared.tool_mode else None
        self._live[id(generation)] = generation
        try:
            while True:
                if prepared.first is not None:  # an upstream's, read by `prepare`
                    event, prepared.first = prepared.first, None
                elif prepared.deadline is None:
                    event = await generation.events.get()
                else:
                    try:
                        event = await asyncio.wait_for(generation.events.get(),
                                                       prepared.deadline - loop.time())
                    except asyncio.TimeoutError:
                        generation.cancelled.set()
                        event = ErrorEvent(RequestTimeout("the request passed its deadline"))
                if isinstance(event, ToolCallEvent):  # an upstream's call, as it comes
                    if tool_deltas:
                        yield event
                    continue
                if isinstance(event, RestartEvent):  # a batch line's job put back
                    given = 0
                    reader = ToolAnswerReader() if prepared.tool_mode else None
                    continue
                if isinstance(event, TokenEvent):
                    first_token_ns = first_token_ns or time.perf_counter_ns()
                    given += len(event.text)
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
                    if given < len(event.text):  # not streamed: the rest came whole
                        list(reader.feed(event.text[given:]))
                    event, failed = _as_tool_answer(event, reader)
                self.observer.end(prepared.served, event, first_token_ns, failed)
                yield event
                return
        finally:
            self._live.pop(id(generation), None)
            generation.cancelled.set()
            await self.release(prepared)

    def cut_all(self) -> int:
        """Ends every running generation with a ShuttingDown error (the stop's drain grace
        ran out): each stream then writes its dialect's final error and ends its body as
        usual, and its ledger row says so. An event already queued (the answer's end)
        still comes first: an answer that finished is not called cut. On the event loop."""
        for generation in self._live.values():
            generation.cancelled.set()
            generation.events.put_nowait(ErrorEvent(ShuttingDown(
                "the server is shutting down: this answer was cut before its end; retry it "
                "in a moment", retry_after=5.0)))
        return len(self._live)

    async def release(self, prepared: PreparedGeneration) -> None:
        """Hand the model back; safe to call twice (a response that never started streaming
        is released by its background task)."""
        if not prepared.released:
            prepared.released = True
            prepared.generation.cancelled.set()
            if prepared.call is not None:
                prepared.call.cancel()
            if prepared.model is not None:
                await self.registry.release(prepared.model)

    async def complete(self, prepared: PreparedGeneration) -> DoneEvent:
        async for event in self.stream(prepared):
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise as_edge_error(event.error)
        raise EdgeAgentError("generation ended without a result")

    async def embed(self, req: EmbeddingRequest, controls: Controls = NO_CONTROLS, *,
                    tenant: TenantContext | None = None, keep_alive: float | None = None,
                    disconnected: Callable[[], Awaitable[bool]] | None = None
                    ) -> EmbeddingResult:
        """See `gateway.embeddings.embed`; scope and quota are checked first, and the tier
        decided (noted on the row) as for a generation, under the same deadline rule. A
        saturated model refuses every tier (`RiskPolicy.refuse_embedding`): vectors are
        only comparable with the same model's, so no fallback ever answers; a batch's line
        gets the plain 503, which its runner waits out."""
        deadline = self._deadline(asyncio.get_running_loop(), controls.timeout_s)
        note(model=req.model, dialect=controls.dialect)
        embeddings.check_count(req, self.registry.settings.runtime.max_embedding_inputs)
        name = ModelName.parse(req.model)
        self._govern(tenant, name)
        tier = self.risk.tier(tenant, controls.risk)
        try:
            return await embeddings.embed(self.registry, req, name, keep_alive=keep_alive,
                                          disconnected=disconnected, deadline=deadline)
        except ServiceUnavailable as exc:
            reason = saturation(exc)
            if reason is None or controls.batch_line:
                raise
            raise self.risk.refuse_embedding(tier, reason, name, exc) from exc


def _the_box_limit(exc: ContextLengthExceeded, tenant: TenantContext | None) -> bool:
    """Whether a prompt was too long for the box's context, not for the tenant's own
    ceiling (`max_context_tokens`: policy, which no upstream may lift)."""
    ceiling = tenant.policy.max_context_tokens if tenant is not None else None
    return not (ceiling and exc.window is not None and exc.window <= ceiling)


def _check_deadline(model: LoadedModel, left: float) -> None:
    if left <= 0:
        raise RequestTimeout("the request timed out before it was queued")
    wait = model.expected_wait_s()
    if wait > left:
        raise DeadlineUnmet(
            f"the request's deadline ({left:.1f} s left) ends before model "
            f"'{model.info.name}' could start it (about {wait:.1f} s: requests wait ahead)",
            retry_after=wait)


def _as_tool_answer(event: DoneEvent, reader: ToolAnswerReader) -> tuple[DoneEvent, bool]:
    """The end of a tool-mode answer: its text and calls, never the internal JSON; and
    whether it failed to complete (the structured-failure flag)."""
    answer = reader.finish()
    done = dataclasses.replace(event, text=answer.content, tool_calls=answer.calls,
                               reason="tool_calls" if answer.calls else event.reason)
    return done, not answer.complete
