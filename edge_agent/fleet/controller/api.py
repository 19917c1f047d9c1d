"""The controller's HTTP side: `/metrics` for Prometheus and a small read-only JSON API.

    GET /metrics                  Prometheus text (the controller's own registry)
    GET /healthz                  {"broker_connected": bool, "store": "ok"|"error"}
    GET /devices                  {"devices": [device, ...]}
    GET /devices/{id}             one device (404 if unknown), with its loss accounting
    GET /devices/{id}/metrics     {"device": id, "metrics": [newest first]} (?limit=1..1000)
    GET /rollouts                 {"rollouts": [rollout, ...]} newest first (no devices)
    GET /rollouts/{id}            one rollout as `fleet rollout status ID --json` shows it

An app factory only (no module-level app): `fleet serve` builds it with the store and the
ingest it runs. It never writes: commands go through `fleet send`, which signs them, and
rollouts through `fleet rollout`. It listens on 127.0.0.1 unless told otherwise
(`http.host`); it has no authentication of its own, so put it behind one before exposing
it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from edge_agent import __version__
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases.artifacts import artifacts_router
from edge_agent.fleet.controller.rollout_ops import report
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.protocol.ids import check_id


def _problem(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(store: ControllerStore, metrics: ControllerMetrics, *,
               broker_connected: Callable[[], bool] = lambda: False,
               releases: Path | None = None) -> FastAPI:
    """`releases`: the signed release repository to serve under /releases/ (metadata and
    model files, with Range), for the boxes' `fleet.artifacts_url`."""
    app = FastAPI(title="edge-agent fleet controller", version=__version__,
                  docs_url=None, redoc_url=None)
    if releases is not None:
        app.include_router(artifacts_router(releases), prefix="/releases")

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> Any:
        try:
            store.counts()
            state = "ok"
        except Exception:  # the answer is the health check's point, not an error page
            state = "error"
        body = {"broker_connected": broker_connected(), "store": state}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/devices")
    def devices() -> dict[str, Any]:
        return {"devices": store.devices()}

    @app.get("/devices/{device_id}", response_model=None)
    def device(device_id: str) -> dict[str, Any] | JSONResponse:
        try:
            check_id("device", device_id)
        except ValueError as exc:
            return _problem(400, str(exc))
        found = store.device(device_id)
        if found is None:
            return _problem(404, f"no device {device_id!r}")
        return {**found, "loss": store.loss(device_id)}

    @app.get("/devices/{device_id}/metrics", response_model=None)
    def device_metrics(device_id: str, limit: int = Query(1, ge=1, le=1000)
                       ) -> dict[str, Any] | JSONResponse:
        try:
            check_id("device", device_id)
        except ValueError as exc:
            return _problem(400, str(exc))
        if store.device(device_id) is None:
            return _problem(404, f"no device {device_id!r}")
        return {"device": device_id,
                "metrics": store.messages(device_id, kind="metrics", limit=limit,
                                          newest_first=True)}

    @app.get("/rollouts")
    def rollouts(limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        now = time.time()
        out = []
        for r in store.rollouts(limit=limit):
            full = report(r, store.rollout_devices(r.id), now)
            full.pop("devices")
            out.append(full)
        return {"rollouts": out}

    @app.get("/rollouts/{rollout_id}", response_model=None)
    def rollout(rollout_id: str) -> dict[str, Any] | JSONResponse:
        found = store.rollout(rollout_id)
        if found is None:
            return _problem(404, f"no rollout {rollout_id!r}")
        return report(found, store.rollout_devices(rollout_id), time.time())

    return app
