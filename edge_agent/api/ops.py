"""Operational endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import hmac
import tempfile

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from edge_agent import __version__
from edge_agent.api.state import AppParts, Parts
from edge_agent.errors import ModelNotFound, Unauthorized
from edge_agent.names import ModelName
from edge_agent.netaddr import is_loopback

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process answers. No auth, no dependencies: for systemd and load balancers, and
    for `doctor`, which tells edge-agent from another program on the port by it (with
    tenants configured, every other route asks for a key)."""
    return {"status": "ok", "edge_agent": __version__}


def readiness_problems(parts: AppParts) -> list[str]:
    reasons = []
    default = ModelName.parse(parts.settings.default_model)
    if not parts.registry.is_loaded(default):
        registry = parts.registry
        state = "being installed" if registry.is_installing(default) else \
            "loading" if registry.is_loading(default) else "not loaded"
        failed = registry.install_failure(default)
        if failed is not None and not parts.store.is_installed(default):
            state = f"not installed: its install at start failed ({failed})"
        reasons.append(f"default model {default} is {state}")
    ledger = parts.ledger
    if ledger is None:
        reasons.append("the ledger is not open")
    elif not ledger.healthy:
        reasons.append(f"the ledger is not writable ({ledger.last_error})")
    try:
        with tempfile.NamedTemporaryFile(dir=parts.settings.state_dir, prefix=".ready-"):
            pass
    except OSError as exc:
        reasons.append(f"state directory {parts.settings.state_dir} is not writable "
                       f"({exc.strerror})")
    return reasons


@router.get("/ready")
async def ready(parts: Parts) -> Response:
    reasons = readiness_problems(parts)
    if reasons:
        return JSONResponse({"status": "not ready", "reasons": reasons}, status_code=503)
    return JSONResponse({"status": "ready", "reasons": []})


@router.get("/metrics")
async def metrics(request: Request, parts: Parts) -> Response:
    if not is_loopback(request.client.host if request.client else ""):
        key = parts.settings.server.metrics_key
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not key or not hmac.compare_digest(given.encode(), key.encode()):
            raise Unauthorized("metrics are served to loopback, or with the metrics key")
    if parts.metrics is None:
        raise ModelNotFound("metrics are disabled (telemetry.metrics = false)")
    return Response(parts.metrics.render(), media_type=CONTENT_TYPE_LATEST)


