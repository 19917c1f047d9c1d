"""The controller's HTTP side: the operators' API (the CLI's one path to the fleet, from a
desk or on the controller host itself), `/metrics` for Prometheus and `/releases/` for the
boxes.

    GET /metrics                  Prometheus text (the controller's own registry)
    GET /healthz                  {"broker_connected": bool, "store": "ok"|"error",
                                   "controller": {"controller", "leader", "since", "store"}}
    GET /devices                  {"devices": [device, ...]} each with its loss accounting
    GET /controllers              {"controllers": [...]}: each `fleet serve` of the store, its
                                  state (leader, follower, gone) and since when
    GET /latest-metrics           {"devices": [{"device": id, "metrics": latest}, ...]}
    GET /feedback                 {"since", "until", "feedback": [{"device", "fleet", "model",
                                  "good", "bad", "messages"}, ...]}: the apps' verdicts per
                                  box and model (?since=&until= Unix s, default the last
                                  day; ?device=), `feedback`
    GET /devices/{id}             one device (404 if unknown), with its loss accounting
    GET /devices/{id}/metrics     {"device": id, "metrics": [newest first]} (?limit=1..1000)
    POST /devices/{id}/retire     (admin) out of service: kept, left out of rollouts; /restore
    POST /devices                 (admin) {"devices": [id, ...], "fleet": F}: expected before
                                  they report (listed as never seen); /devices/{id}/unregister
    …/rollouts                    read, start, pause, resume, abort, roll back: `rollouts.api`
    …/commands                    `fleet send`: `command_api`
    …/operators, GET /audit       tokens (admin) and who did what: `operator_api`
    GET /slo, /slo/rollouts/{id}  service levels over time, a release's before/after: `slo_api`
    GET /fleet-metrics            every box's service levels in Prometheus text: `slo_export`
    GET /review, POST /review/verify   the periodic review of production models: `review_api`
    PUT /release-files/, POST /releases   a release signed at a desk: `release_api`
    GET /, /console/…             the web console: `console`

An app factory only (no module-level app): `fleet serve` builds it with the store and the
ingest it runs, and the CLI builds it in its own process on the controller host
(`local`). Errors are `{"error": "..."}` with the status of the exception tree
(`edge_agent.errors`); a body that does not parse is a 400 of the same shape. Who may call
each route is `access.RULES`, checked before any handler runs: operators' bearer tokens
(`fleet operators create`); read-only access without one on a loopback controller that has
no operator yet. It listens on 127.0.0.1 unless told otherwise (`http.host`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from edge_agent import __version__
from edge_agent.config.controller import SLOSettings
from edge_agent.errors import EdgeAgentError, InvalidRequest, NotFound
from edge_agent.fleet.controller import registrations
from edge_agent.fleet.controller.access import AccessControl, actor
from edge_agent.fleet.controller.audit import audited
from edge_agent.fleet.controller.command_api import command_router
from edge_agent.fleet.controller.commands import CommandSender
from edge_agent.fleet.controller.console import console_router
from edge_agent.fleet.controller.leadership import presence_state
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.operator_api import operator_router
from edge_agent.fleet.controller.operators import Operator
from edge_agent.fleet.controller.release_api import release_router
from edge_agent.fleet.controller.releases.artifacts import artifacts_router
from edge_agent.fleet.controller.releases.repository import releases_dir
from edge_agent.fleet.controller.review_api import review_router
from edge_agent.fleet.controller.rings import Rings
from edge_agent.fleet.controller.rollouts.api import rollout_router
from edge_agent.fleet.controller.slo_api import slo_router
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.protocol.ids import check_id


class DeviceRegister(BaseModel):
    """`fleet devices register DEVICE… --fleet F`: boxes expected before they report."""

    model_config = ConfigDict(extra="forbid")

    devices: list[str] = Field(min_length=1, max_length=10_000)
    fleet: str = Field("default", max_length=64)


FEEDBACK_WINDOW_S = 86400.0  # GET /feedback without ?since: the last day


def _problem(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(store: ControllerStore, metrics: ControllerMetrics, *,
               broker_connected: Callable[[], bool] = lambda: False,
               state_dir: Path | None = None, loopback: bool = True,
               metrics_open: bool | None = None,
               commands: CommandSender | None = None,
               local: Operator | None = None,
               leadership: Callable[[], dict[str, Any]] | None = None,
               rings: Rings | None = None,
               slo: SLOSettings | None = None) -> FastAPI:
    """`state_dir`: the controller's; its signed release repository is served under
    /releases/ (metadata and model files, with Range, for the boxes' `fleet.artifacts_url`)
    and rollouts are started from it. `loopback`: whether
    the server is bound to a loopback address only (`access` opens reads to the host's
    users while no operator exists, and `/metrics` unless `metrics_open` says). `commands`:
    the controller's key and broker, for `POST /commands` (None: it answers 503). `local`:
    the CLI's own app on the controller host, every request made as that operator.
    `rings`: which fleets each release stage may go to (`[stages]`; None: all of them).
    `slo`: the service levels the fleet is held to (`[slo]`; None: the defaults)."""
    app = FastAPI(title="edge-agent fleet controller", version=__version__,
                  docs_url=None, redoc_url=None)
    app.add_middleware(AccessControl, store=store, loopback=loopback,
                       metrics_open=metrics_open, local=local)
    if state_dir is not None:
        app.include_router(artifacts_router(releases_dir(state_dir)), prefix="/releases")

    @app.exception_handler(EdgeAgentError)
    def edge_agent_error(request: Request, exc: EdgeAgentError) -> JSONResponse:
        return _problem(exc.status_code, exc.message)

    @app.exception_handler(StarletteHTTPException)
    def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    def unreadable(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _problem(400, f"{where}: {first.get('msg', 'invalid')}" if where
                        else str(first.get("msg", "the request body is not valid JSON")))

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
        body = {"broker_connected": broker_connected(), "store": state,
                **({} if leadership is None else {"controller": leadership()})}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/devices")
    def devices() -> dict[str, Any]:
        return {"devices": registrations.listed(store)}

    @app.post("/devices")
    def register(body: DeviceRegister, request: Request) -> dict[str, Any]:
        who = actor(request)
        with audited(store.audit, action="device.register", target=",".join(body.devices)[:200],
                     request=body.model_dump(), **who):
            for kind, values in (("device", body.devices), ("fleet", [body.fleet])):
                for value in values:
                    try:
                        check_id(kind, value)
                    except ValueError as exc:
                        raise InvalidRequest(str(exc), param=kind) from None
            new = store.register(sorted(set(body.devices)), fleet=body.fleet,
                                 by=who["operator"], now=time.time())
        return {"fleet": body.fleet, "registered": new,
                "known": sorted(set(body.devices) - set(new))}

    @app.post("/devices/{device_id}/unregister")
    def unregister(device_id: str, request: Request) -> dict[str, Any]:
        with audited(store.audit, action="device.unregister", target=device_id, request={},
                     **actor(request)):
            if not store.unregister(device_id):
                raise NotFound(f"device {device_id!r} is not registered")
        return {"device": device_id, "registered": None}

    @app.get("/controllers")
    def controllers() -> dict[str, Any]:
        now = time.time()
        return {"controllers": [{**row, "state": presence_state(row, now)}
                                for row in store.controllers()]}

    @app.get("/latest-metrics")
    def latest_metrics() -> dict[str, Any]:
        return {"devices": [{"device": d["device"], "metrics": store.latest_metrics(d["device"])}
                            for d in store.devices()]}

    @app.get("/feedback")
    def feedback(since: float | None = Query(None, allow_inf_nan=False),
                 until: float | None = Query(None, allow_inf_nan=False),
                 device: str | None = Query(None, max_length=64)) -> dict[str, Any]:
        if device is not None:
            try:
                check_id("device", device)
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="device") from None
        start = time.time() - FEEDBACK_WINDOW_S if since is None else since
        return {"since": start, "until": until,
                "feedback": store.slo.feedback_sums(since=start, until=until, device=device)}

    @app.get("/devices/{device_id}", response_model=None)
    def device(device_id: str) -> dict[str, Any] | JSONResponse:
        try:
            check_id("device", device_id)
        except ValueError as exc:
            return _problem(400, str(exc))
        found = registrations.one(store, device_id)
        if found is None:
            return _problem(404, f"no device {device_id!r}")
        return found

    def retirement(device_id: str, request: Request, retire: bool) -> dict[str, Any]:
        who = actor(request)
        with audited(store.audit, action="device.retire" if retire else "device.restore",
                     target=device_id, request={}, **who):
            if not store.retire(device_id, by=who["operator"] if retire else None,
                                now=time.time()):
                raise NotFound(f"no device {device_id!r}")
        found = store.device(device_id)
        assert found is not None
        return found

    @app.post("/devices/{device_id}/retire")
    def retire(device_id: str, request: Request) -> dict[str, Any]:
        return retirement(device_id, request, True)

    @app.post("/devices/{device_id}/restore")
    def restore(device_id: str, request: Request) -> dict[str, Any]:
        return retirement(device_id, request, False)

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

    app.include_router(rollout_router(store, state_dir, rings))
    app.include_router(command_router(store, commands))
    app.include_router(operator_router(store))
    app.include_router(release_router(store, state_dir))
    targets = slo or SLOSettings.model_validate({})
    app.include_router(slo_router(store.slo, targets))
    app.include_router(review_router(store, state_dir, targets, commands))
    app.include_router(console_router(store, state_dir, rings, slo=slo))

    return app
