"""What the HTTP adapters share: the parts built by the app factory, reached per request."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from edge_agent.api.openai.batches import BatchService
from edge_agent.api.openai.serving import OpenAIServing
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.registry import ModelRegistry
from edge_agent.gateway.service import GenerationService
from edge_agent.governance.tenants import Governor
from edge_agent.ledger.writer import LedgerWriter
from edge_agent.telemetry.metrics import Metrics


@dataclass
class AppParts:
    settings: Settings
    store: ModelStore
    registry: ModelRegistry
    service: GenerationService
    ops: ModelOps  # every model-lifecycle handler goes through it
    openai: OpenAIServing  # the OpenAI dialect's serving, for its routes and batch lines
    metrics: Metrics | None = None
    governor: Governor | None = None
    ledger: LedgerWriter | None = None  # set while the app runs
    batches: BatchService | None = None  # the Batch API's files, batches and runner
    # hold_name(name, change): a change of a model by hand, under the box's claim on the
    # name and refused (409) while a fleet rollout of it is live
    # (`fleet.device.rollout.name_claim`).
    hold_name: Callable[[str, str], AbstractContextManager[None]] | None = None
    # stop(): the server asked to stop as at SIGTERM, without a signal (set by
    # `server.build_server`): an agent switch stops it so, and exits for systemd's restart.
    stop: Callable[[], None] | None = None

    def held(self, name: str, change: str) -> AbstractContextManager[None]:
        return nullcontext() if self.hold_name is None else self.hold_name(name, change)


def _parts(request: Request) -> AppParts:
    parts: AppParts = request.app.state.parts
    return parts


Parts = Annotated[AppParts, Depends(_parts)]
