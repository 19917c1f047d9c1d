"""The service levels' routes: the series the console draws, a rollout's before/after per
wave, and the Prometheus text of every box's figures (`slo_export`).

    GET /slo?window=6h&model=M&device=D&fleet=F&step=300
                                  {"since", "until", "step", "scope", "buckets": [...],
                                   "markers": [rollouts started in the window],
                                   "errors": [error types]} (`slo.SLOQueries.series`)
    GET /slo/rollouts/{id}?window=30m
                                  each wave's figures the same window before each box's
                                  update and after it (404 if no such rollout)
    GET /fleet-metrics            Prometheus text (`slo_export`), scraped like /metrics
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from edge_agent.config.controller import SLOSettings
from edge_agent.errors import InvalidRequest, NotFound
from edge_agent.fleet.controller.slo import SLOQueries
from edge_agent.fleet.controller.slo_export import SLOExport
from edge_agent.fleet.controller.waves import WaveSpecError, parse_duration

# The longest window a chart or a comparison reads (the store keeps 30 days by default).
MAX_WINDOW_S = 90 * 86400.0


def window_s(text: str) -> float:
    """A window as `fleet rollout start` spells durations (30m, 6h, 7d)."""
    try:
        value = parse_duration(text, param="window")
    except WaveSpecError as exc:
        raise InvalidRequest(f"window: {exc.message}") from exc
    if not 60 <= value <= MAX_WINDOW_S:
        raise InvalidRequest("window must be between 1m and 90d")
    return value


def slo_router(slo: SLOQueries, settings: SLOSettings, *,
               clock: Callable[[], float] = time.time) -> APIRouter:
    router = APIRouter()
    export = SLOExport(slo, settings, clock=clock)

    @router.get("/slo")
    def series(window: str = Query("6h", max_length=20),
               model: str | None = Query(None, max_length=200),
               device: str | None = Query(None, max_length=200),
               fleet: str | None = Query(None, max_length=200),
               step: int | None = Query(None, ge=60, le=86400)) -> dict[str, Any]:
        until = clock()
        return slo.series(since=until - window_s(window), until=until, step=step,
                          model=model, device=device, fleet=fleet).to_json()

    @router.get("/slo/rollouts/{rollout_id}")
    def impact(rollout_id: str, window: str | None = Query(None, max_length=20)
               ) -> dict[str, Any]:
        span = settings.compare_s if window is None else window_s(window)
        found = slo.release_impact(rollout_id, window_s=span)
        if found is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return found

    @router.get("/fleet-metrics")
    def prometheus() -> Response:
        return Response(export.render(), media_type=CONTENT_TYPE_LATEST)

    return router
