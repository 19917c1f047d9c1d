"""Where a request runs: here, or on an upstream ([upstreams], [routing]), and how an
upstream's answer becomes the box's.

The route ([routing] route, over it a model's, over that a tenant's) says where a request
may run: `local` (only here), `local, then upstream` (here; an upstream when the box cannot
serve it as asked) or `upstream, then local`. A client may ask for one side with
`X-Edge-Route: local|upstream`; asking for the upstream where the request may not go there
is refused with the reason, never answered silently here. The triggers of `local, then
upstream`, each the ledger's `route_reason`:

- `not_installed`: the model asked is not on the box and an upstream serves it;
- `context`: the prompt is over the box's own context (not a tenant's ceiling, which is
  policy) and fits the upstream's declared `context_length`;
- `saturated`: the model's queue is full, no memory is free to load it, or the request's
  deadline ends before its turn; for a normal-tier request beside the model's fallback
  ([routing] saturated says which comes first: by default the upstream, since it answers
  with the model asked where the fallback is a smaller one); never for a high-tier request,
  which the risk tiers refuse rather than answer elsewhere;
- `asked` (the header) and `route` (`upstream, then local`);
- `batch`: a batch's line whose model has every sequence taken, while an upstream is at
  most half busy (the rest is left to interactive work): a batch drains faster when the
  pool has room, and never takes it from a store's customers.

Nothing of a tenant whose `egress` is `never` leaves the box, whatever the route or the
header. `redacted` sends the text with personal data as placeholders (`gateway.egress`)
and restores the originals in the answer. An upstream is picked only if it serves the model
(`models`), its breaker is closed, a place is free, and it honours what the request needs
(a schema, tools); Ollama's `context` token ids mean nothing elsewhere, so a request with
them stays here.

An upstream's answer arrives as the engine's events (`engine.request`), so each dialect
writes it exactly as a local one: streamed text restored as it comes, tool calls and usage
carried (a tool call as it comes, in OpenAI's streamed shape, unless its arguments must be
restored whole), the finish reason mapped. An answer to a schema request is held until it is whole
and checked against the schema: one that does not match is never passed on (502).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from edge_agent.config import Egress, Route, Settings
from edge_agent.engine.request import (
    DoneEvent,
    DoneReason,
    ErrorEvent,
    Event,
    Generation,
    GenerationRequest,
    Timings,
    TokenEvent,
    ToolCall,
    ToolCallEvent,
    Usage,
)
from edge_agent.errors import EdgeAgentError, Forbidden, UpstreamFailed, UpstreamUnavailable
from edge_agent.gateway.egress import Pseudonyms
from edge_agent.gateway.upstream import Upstream
from edge_agent.governance.redaction import Detectors
from edge_agent.governance.tenants import TenantContext
from edge_agent.logs import note
from edge_agent.names import ModelName
from edge_agent.telemetry.metrics import Metrics

Side = Literal["local", "upstream"]
_REASONS: dict[str, DoneReason] = {"stop": "stop", "length": "length",
                                   "tool_calls": "tool_calls", "function_call": "tool_calls",
                                   "content_filter": "stop"}
# Sampling fields every OpenAI-compatible server takes, by their OpenAI names; the others
# (top_k, min_p, repeat_penalty …) are llama.cpp's and not sent.
_SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class Plan:
    """Where one request may run."""

    route: Route
    egress: Egress
    asked: Side | None  # X-Edge-Route

    @property
    def may_leave(self) -> bool:
        return self.egress != "never" and self.route != "local" and self.asked != "local"

    @property
    def upstream_first(self) -> bool:
        return self.may_leave and self.route == "upstream, then local"


@dataclass
class UpstreamCall:
    """An upstream's answer on its way in: the events, as a local generation gives them."""

    upstream: Upstream
    generation: Generation
    reason: str  # why it went there (the ledger's `route_reason`)
    task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.generation.cancelled.set()
        if self.task is not None:
            self.task.cancel()


@dataclass
class Router:
    settings: Settings
    upstreams: list[Upstream]
    detectors: Detectors | None = None
    metrics: Metrics | None = None

    @classmethod
    def from_settings(cls, settings: Settings, detectors: Detectors | None,
                      metrics: Metrics | None) -> Router:
        return cls(settings, [Upstream(name, up, metrics)
                              for name, up in settings.upstreams.items()], detectors, metrics)

    def plan(self, name: ModelName, tenant: TenantContext | None, asked: Side | None) -> Plan:
        route = (tenant.policy.route if tenant is not None else None) \
            or self.settings.model_override(str(name)).route or self.settings.routing.route
        # No tenant: a request the box makes itself (the health gate's probe), never sent.
        egress = tenant.policy.egress if tenant is not None else "never"
        if egress == "redacted" and self.detectors is None:
            egress = "never"  # nothing can redact here: nothing leaves
        return Plan(route, egress, asked)

    def refuse_asked(self, plan: Plan, name: ModelName, tenant: TenantContext | None
                     ) -> EdgeAgentError:
        """Why a request that asked for the upstream (X-Edge-Route) is not sent there."""
        if plan.egress == "never":
            who = f"tenant '{tenant.name}'" if tenant is not None else "this box's requests"
            return Forbidden(f"X-Edge-Route: upstream refused: the data of {who} may not "
                             "leave the box (egress = \"never\")")
        if plan.route == "local":
            return Forbidden(f"X-Edge-Route: upstream refused: model '{name}' is served here "
                             "only (route = \"local\")")
        return self.unavailable(name)

    def serves(self, name: ModelName, plan: Plan) -> bool:
        """Whether an upstream serves `name` to this request at all (healthy or not)."""
        return plan.may_leave and any(u.model_for(name) for u in self.upstreams)

    def unavailable(self, name: ModelName) -> UpstreamUnavailable:
        retry = min((u.settings.open_s for u in self.upstreams if u.model_for(name)),
                    default=5.0)
        return UpstreamUnavailable(f"no upstream can take a request for model '{name}' now "
                                   "(none serves it, none is healthy, or all are busy); "
                                   "retry later", retry_after=retry)

    def pick(self, req: GenerationRequest, name: ModelName, plan: Plan, *,
             tokens: int | None = None, spare: bool = False) -> Upstream | None:
        """The first upstream that may take the request now; `tokens`: the request needs
        that much context there; `spare`: only one at most half busy (a batch's line
        takes what interactive work leaves over)."""
        if not plan.may_leave or req.context_tokens:
            return None
        for upstream in self.upstreams:
            s = upstream.settings
            if upstream.model_for(name) is None:
                continue
            if req.json_schema is not None and not s.json_schema:
                continue
            if req.tools and not s.tools:
                continue
            if tokens is not None and (s.context_length is None or tokens > s.context_length):
                continue
            if spare and upstream.in_flight * 2 >= s.max_concurrency:
                continue
            if upstream.available():
                return upstream
        return None

    def start(self, upstream: Upstream, req: GenerationRequest, name: ModelName, plan: Plan,
              reason: str) -> UpstreamCall:
        """The request sent: its body built (redacted where the tenant says), its answer
        read into events by a task of the event loop."""
        # `plan` says "redacted" only where there are detectors to redact with.
        pseudonyms = Pseudonyms(self.detectors) if plan.egress == "redacted" and \
            self.detectors is not None else None
        model = upstream.model_for(name)
        assert model is not None
        stream = upstream.settings.streaming
        path, body = _body(req, model, pseudonyms, stream=stream)
        data = json.dumps(body, ensure_ascii=False).encode()  # what leaves, encoded once
        entities = dict(pseudonyms.entities) if pseudonyms is not None else {}
        note(route="upstream", upstream=upstream.name, route_reason=reason,
             egress=plan.egress, egress_entities=sum(entities.values()),
             egress_bytes=len(data))
        if self.metrics is not None and entities:
            self.metrics.observe_egress(upstream.name, entities)
        loop = asyncio.get_running_loop()
        generation = Generation(asyncio.Queue(), threading.Event(), time.perf_counter_ns())
        call = UpstreamCall(upstream, generation, reason)
        call.task = loop.create_task(_pump(upstream, path, data, stream, req, call,
                                           pseudonyms))
        return call

    async def aclose(self) -> None:
        for upstream in self.upstreams:
            await upstream.aclose()


def _body(req: GenerationRequest, model: str, pseudonyms: Pseudonyms | None, *,
          stream: bool) -> tuple[str, dict[str, Any]]:
    """The OpenAI request for `req`: a chat completion (Ollama's templated prompt as a
    user message under its system prompt), or a completion for a raw prompt."""
    hide = pseudonyms.hide if pseudonyms is not None else (lambda text: text)
    body: dict[str, Any] = {"model": model, "stream": stream}
    if req.messages is not None or not req.raw:
        messages = req.messages if req.messages is not None else (
            ([{"role": "system", "content": req.system}] if req.system else [])
            + [{"role": "user", "content": req.prompt or ""}])
        body["messages"] = [_hidden_message(m, hide) for m in messages]
        path = "/chat/completions"
        if req.tools:
            body["tools"] = req.tools
            body["tool_choice"] = req.tool_choice if req.tool_choice in (
                "auto", "none", "required") else {"type": "function",
                                                  "function": {"name": req.tool_choice}}
    else:
        body["prompt"] = hide(req.prompt or "")
        path = "/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    if req.stop:
        body["stop"] = req.stop
    for key in _SAMPLING:
        if key in req.sampling:
            body[key] = req.sampling[key]
    if req.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": req.json_schema, "strict": True}}
    return path, body


def _hidden_message(message: dict[str, Any], hide: Callable[[str], str]) -> dict[str, Any]:
    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = hide(content)
    elif isinstance(content, list):
        out["content"] = [{**part, "text": hide(str(part.get("text", "")))}
                          if isinstance(part, dict) and part.get("type") == "text" else part
                          for part in content]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call.get("function", {}), "arguments": hide(
                str(call.get("function", {}).get("arguments", "")))}}
            for call in message["tool_calls"]]
    return out


async def _pump(upstream: Upstream, path: str, data: bytes, stream: bool,
                req: GenerationRequest, call: UpstreamCall,
                pseudonyms: Pseudonyms | None) -> None:
    """Reads the upstream's answer into events; exactly one DoneEvent or ErrorEvent last."""
    put: Callable[[Event], None] = call.generation.events.put_nowait
    chat = path == "/chat/completions"
    started = time.perf_counter_ns()
    first = 0
    parts: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    usage: dict[str, Any] = {}
    finish = None
    restorer = pseudonyms.restorer() if pseudonyms is not None else None
    hold = req.json_schema is not None  # checked whole before any of it goes out
    try:
        # Closed here, on a cancel too: its place (`in_flight`) is given back at once, not
        # whenever the generator is collected.
        async with contextlib.aclosing(upstream.events(
                path, data, streamed=stream, reason=call.reason)) as events:
            async for obj in events:
                if call.generation.cancelled.is_set():
                    return
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    delta = choice.get("delta") or choice.get("message") or {}
                    text = delta.get("content") if chat else choice.get("text")
                    for part in delta.get("tool_calls") or []:
                        index = int(part.get("index", len(calls)))
                        slot = calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
                        function = part.get("function") or {}
                        named = not slot["name"] and function.get("name")
                        slot["id"] = part.get("id") or slot["id"]
                        slot["name"] = function.get("name") or slot["name"]
                        piece = function.get("arguments") or ""
                        slot["arguments"] += piece
                        if pseudonyms is None and not hold:  # as it comes, OpenAI's shape
                            if named:
                                put(ToolCallEvent(index, "", slot["id"] or f"call_{index}",
                                                  slot["name"]))
                            if piece and slot["name"]:
                                put(ToolCallEvent(index, piece))
                    if not text:
                        continue
                    first = first or time.perf_counter_ns()
                    parts.append(text)
                    out = restorer.feed(text) if restorer is not None else text
                    if out and not hold:
                        put(TokenEvent(out))
        whole = "".join(parts)
        text = pseudonyms.restore(whole) if pseudonyms is not None else whole
        tail = restorer.flush() if restorer is not None else ""
        if hold:
            _check_schema(upstream, text, req.json_schema)
            if text:
                put(TokenEvent(text))
        elif tail:
            put(TokenEvent(tail))
        tool_calls = tuple(_tool_call(i, c, pseudonyms) for i, c in sorted(calls.items()))
        end = time.perf_counter_ns()
        first = first or end
        details = usage.get("prompt_tokens_details") or {}
        note(upstream_ms=round((end - started) / 1e6, 1))
        put(DoneEvent(
            reason="tool_calls" if tool_calls else _REASONS.get(str(finish), "stop"),
            usage=Usage(int(usage.get("prompt_tokens") or 0),
                        int(details.get("cached_tokens") or 0),
                        int(usage.get("completion_tokens") or 0)),
            timings=Timings(prompt_ns=first - started, eval_ns=end - first,
                            total_ns=end - started),
            text=text, tool_calls=tool_calls))
    except asyncio.CancelledError:
        raise
    except EdgeAgentError as exc:
        put(ErrorEvent(exc))
    except Exception as exc:  # an answer shaped wrong: the upstream's fault, said as such
        put(ErrorEvent(UpstreamFailed(f"upstream '{upstream.name}' sent an answer the box "
                                      f"could not read ({type(exc).__name__})")))


def _check_schema(upstream: Upstream, text: str, schema: dict[str, Any] | None) -> None:
    try:
        jsonschema.validate(json.loads(text), schema or {})
    except (ValueError, jsonschema.ValidationError) as exc:
        raise UpstreamFailed(f"upstream '{upstream.name}' answered off the request's schema "
                             f"({str(exc).splitlines()[0][:200]}): not passed on") from None


def _tool_call(index: int, call: dict[str, str], pseudonyms: Pseudonyms | None) -> ToolCall:
    parsed = json.loads(call["arguments"] or "{}")
    if not isinstance(parsed, dict):
        raise ValueError("tool arguments are not an object")
    if pseudonyms is not None:
        parsed = _restored(parsed, pseudonyms)
    return ToolCall(id=call["id"] or f"call_{index}", name=call["name"], arguments=parsed)


def _restored(value: Any, pseudonyms: Pseudonyms) -> Any:
    """The originals back in every string of a parsed JSON value (inside the strings,
    so that a value with a quote keeps the JSON whole)."""
    if isinstance(value, str):
        return pseudonyms.restore(value)
    if isinstance(value, list):
        return [_restored(v, pseudonyms) for v in value]
    if isinstance(value, dict):
        return {k: _restored(v, pseudonyms) for k, v in value.items()}
    return value
