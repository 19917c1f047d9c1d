"""What the HTTP adapters share: the parts built by the app factory, reached per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from edge_agent.config import Settings
from edge_agent.engine.catalog import ModelStore
from edge_agent.engine.modelops import ModelOps
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
    metrics: Metrics | None = None
    governor: Governor | None = None
    ledger: LedgerWriter | None = None  # set while the app runs


def _parts(request: Request) -> AppParts:
    parts: AppParts = request.app.state.parts
    return parts


Parts = Annotated[AppParts, Depends(_parts)]
