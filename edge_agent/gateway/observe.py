"""The end of a generation, into the request's access line / ledger row, the metrics and
the tenant's token quota. Called once per request, with its last event.

A structured answer that did not complete (`structured_failure` on the row) is counted
as cut (`edge_agent_structured_cut_total`) by the same test, so the row and the counter
never disagree; a closed one is whole, and counted as closed instead.

A request that reached a model is counted by its task kinds (`telemetry.task_kinds`) beside
its outcome, whether it was answered or failed on the way: the review that reads them asks
what a model was given, not how it went."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from edge_agent.engine.request import DoneEvent, ErrorEvent, Event
from edge_agent.errors import EdgeAgentError, ShuttingDown
from edge_agent.gateway.privacy import RequestPrivacy
from edge_agent.governance.tenants import Governor, TenantContext
from edge_agent.logs import note
from edge_agent.telemetry.metrics import Metrics
from edge_agent.telemetry.task_kinds import kinds_of


@dataclass(frozen=True)
class Served:
    """What the observation needs to know of the request it ends."""

    model: str
    digest: str
    dialect: str
    tenant: TenantContext | None
    submitted_ns: int
    load_ns: int
    constrained: bool  # answered under a grammar (schema or tool call)
    upstream: bool = False  # answered by an upstream: its tokens are not the engine's
    # What the request's task kinds are read from (`telemetry.task_kinds`): whether it asked
    # for structured output and carried tools, the prompt as the model took it (after any
    # truncation; 0 for an upstream, whose answer says), the context of one sequence of the
    # model that took it (None: an upstream that declares none).
    schema: bool = False
    tools: bool = False
    prompt_tokens: int = 0
    n_ctx: int | None = None

    def kinds(self, prompt_tokens: int) -> tuple[str, ...]:
        """Its task kinds, with the prompt's tokens as the end of the request knows them."""
        return kinds_of(self.dialect, schema=self.schema, tools=self.tools,
                        prompt_tokens=prompt_tokens, n_ctx=self.n_ctx)


class Observer:
    def __init__(self, metrics: Metrics | None, governor: Governor | None,
                 privacy: RequestPrivacy) -> None:
        self.metrics = metrics
        self.governor = governor
        self.privacy = privacy

    def end(self, served: Served, event: Event, first_token_ns: int,
            failed: bool | None = None) -> None:
        """`failed`: whether a structured answer did not complete, when the caller knows
        (tool mode); else a constrained answer that is not JSON counts as failed."""
        if isinstance(event, DoneEvent):
            self._done(served, event, first_token_ns, failed)
        elif isinstance(event, ErrorEvent):
            error = as_edge_error(event.error)
            note(model=served.model, dialect=served.dialect, error_type=error.error_type)
            if isinstance(error, ShuttingDown):  # the row says the answer was cut, and why
                note(status=error.status_code, done_reason="shutdown")
            if self.metrics is not None:
                self.metrics.observe_error(served.model, served.dialect, error)
                self.metrics.observe_kinds(served.model, served.kinds(served.prompt_tokens))

    def structured_refused(self, model: str) -> None:
        """A request refused for the schema or tools it asked for (`GenerationService`'s
        grammar step): `model` is the installed model it named."""
        if self.metrics is not None:
            self.metrics.observe_structured_refused(model)

    def _done(self, served: Served, event: DoneEvent, first_token_ns: int,
              failed: bool | None) -> None:
        u, t = event.usage, event.timings
        end = first_token_ns or time.perf_counter_ns()
        ttft = (end - served.submitted_ns + served.load_ns) / 1e9
        tpot = t.eval_ns / 1e6 / (u.completion_tokens - 1) if u.completion_tokens > 1 else 0
        if failed is None:
            failed = served.constrained and not event.tool_calls and not _is_json(event.text)
        note(model=served.model, model_digest=served.digest, dialect=served.dialect,
             ttft_ms=round(ttft * 1000, 1), tpot_ms=round(tpot, 2),
             queue_ms=round(t.queue_ns / 1e6, 1), prompt_tokens=u.prompt_tokens,
             cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens,
             done_reason="closed" if event.closed else event.reason,
             structured_failure=int(failed))
        if self.metrics is not None:
            # Cut is what the row calls a structured failure: one condition for both.
            self.metrics.observe_done(served.model, served.dialect, event, ttft,
                                      engine=not served.upstream, cut=failed)
            # The answer's count of the prompt: the same as the fitted one for the box's
            # own models, and the only one there is for an upstream's.
            self.metrics.observe_kinds(served.model, served.kinds(u.prompt_tokens))
        self.privacy.keep_answer(event.text)
        if self.governor is not None and served.tenant is not None:
            self.governor.charge(served.tenant, u.prompt_tokens - u.cached_tokens
                                 + u.completion_tokens)


def _is_json(text: str) -> bool:
    """A grammar-constrained answer that is not JSON did not complete (cut by max_tokens,
    cancelled)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def as_edge_error(exc: BaseException) -> EdgeAgentError:
    if isinstance(exc, EdgeAgentError):
        return exc
    wrapped = EdgeAgentError("internal server error")
    wrapped.__cause__ = exc
    return wrapped
