"""The health gate's way into the request path: one request, run as a client's would be
(template, limits, scheduler, the version the name's pointer names now), answered with
what the gate measures.

The fleet link may not import `gateway.service` (it imports the registry, which imports
the scheduler and llama.cpp); the app builds a `ServiceProbe` over its GenerationService
and hands it to the rollout manager, which sees only `fleet.device.rollout.health_gate.Probe`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from edge_agent.engine.request import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent
from edge_agent.errors import EdgeAgentError
from edge_agent.gateway.controls import Controls
from edge_agent.gateway.observe import as_edge_error
from edge_agent.gateway.service import GenerationService


@dataclass(frozen=True)
class ProbeResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # queued -> first token (the load, if any, not counted)
    eval_ms: float  # first token -> last
    digest: str  # the version that answered
    reason: str


class ServiceProbe:
    """`dialect`: how the gate's own requests are labelled in metrics and logs."""

    def __init__(self, service: GenerationService, *, dialect: str) -> None:
        self.service = service
        self.controls = Controls(dialect=dialect, risk="high")

    async def __call__(self, request: GenerationRequest) -> ProbeResult:
        """Runs `request` to its end; an error event is raised as the EdgeAgentError a
        client would have got. At the high risk tier: a gate judges the version it asked
        for, so a saturated box refuses its request rather than answer with a fallback."""
        prepared = await self.service.prepare(request, self.controls)
        first_ns = 0
        async for event in self.service.stream(prepared):
            if isinstance(event, TokenEvent):
                first_ns = first_ns or time.perf_counter_ns()
            elif isinstance(event, ErrorEvent):
                raise as_edge_error(event.error)
            elif isinstance(event, DoneEvent):
                end = first_ns or time.perf_counter_ns()
                return ProbeResult(
                    text=event.text, prompt_tokens=event.usage.prompt_tokens,
                    completion_tokens=event.usage.completion_tokens,
                    ttft_ms=(end - prepared.generation.submitted_ns) / 1e6,
                    eval_ms=event.timings.eval_ns / 1e6, digest=prepared.served.digest,
                    reason=event.reason)
        raise EdgeAgentError("generation ended without a result")
