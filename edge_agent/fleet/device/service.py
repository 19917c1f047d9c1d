"""The box's side of the fleet as the server holds it: one object, built from Settings, that
starts the link, what it reports and the rollouts together, and stops them in order.

The server never waits on it: each part is built inside its own `try`, and a part that
cannot be built is logged and left out (the box serves without a link; the link runs
without reporting or rollouts, refusing their commands as unknown). Nothing here reaches
the request path but through what the app hands in: the health gate's `probe`, the
readiness check `ready`, the metrics registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.fleet.device.link.link import Link
from edge_agent.fleet.device.reporting.sync import Sync
from edge_agent.fleet.device.rollout.health_gate import Probe
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.governance.tenants import Governor
from edge_agent.ledger.retention import purge_before, purge_expired
from edge_agent.telemetry.hardware import HardwareSampler

log = logging.getLogger(__name__)


class FleetDevice:
    def __init__(self, settings: Settings, *, modelops: ModelOps, governor: Governor,
                 sampler: HardwareSampler, probe: Probe, ready: Callable[[], bool],
                 metrics: CollectorRegistry | None = None,
                 gpus: Callable[[], list[dict[str, Any]]] = list,
                 restart: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.modelops = modelops
        self.governor = governor
        self.sampler = sampler
        self.probe = probe
        self.ready = ready
        self.metrics = metrics
        self.gpus = gpus
        self.restart = restart  # an agent switch's new start (`fleet.device.agent.boot`)
        self.link: Link | None = None
        self.rollouts: RolloutManager | None = None
        self.sync: Sync | None = None
        self._stop_sync = asyncio.Event()
        self._sync_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Rollouts first (their commands are the link's handlers), then the link, then
        the rollouts' resume (it reports through the link), then reporting."""
        self.rollouts = self._build_rollouts()
        self.link = self._start_link(
            self.rollouts.handlers() if self.rollouts is not None else None)
        if self.rollouts is not None:
            await self.rollouts.start()  # resumes what a restart interrupted
        if self.link is not None:
            self.sync = self._build_sync(self.link)
            if self.sync is not None:
                self._sync_task = asyncio.create_task(self.sync.run(self._stop_sync))

    async def stop(self) -> None:
        """Rollouts before the registry goes (one may hold a version); reporting's last
        ticks before the outbox closes; the link last, with its goodbye."""
        if self.rollouts is not None:
            await self.rollouts.stop()
        if self._sync_task is not None:
            self._stop_sync.set()
            await asyncio.gather(self._sync_task, return_exceptions=True)
        if self.link is not None:
            await asyncio.to_thread(self.link.stop)
            self.link = None

    def _emit(self, kind: str, cls: str, body: Any) -> bool:
        link = self.link
        return link is not None and bool(link.emit(kind, cls, body))

    def _build_rollouts(self) -> RolloutManager | None:
        """The rollout runner over signed releases, its gate's requests through the real
        request path (`probe`)."""
        try:
            from edge_agent.fleet.device.release.signed_releases import SignedReleases

            settings = self.settings
            return RolloutManager(settings, self.modelops,
                                  SignedReleases(settings.fleet, settings.state_dir),
                                  self.probe, emit=self._emit, ready=self.ready,
                                  restart=self.restart)
        except Exception:
            log.exception("fleet rollouts not available; the link runs without them")
            return None

    def _build_sync(self, link: Link) -> Sync | None:
        """What the link syncs on its intervals (metrics, ledger summaries, events)."""
        try:
            def emit(kind: str, cls: str, body: Any, *, commit: bool = False) -> int:
                if not link.emit(kind, cls, body, commit=commit):
                    raise RuntimeError(f"the outbox refused a {kind} message")
                return 0

            settings, sampler = self.settings, self.sampler
            return Sync(emit=emit, ledger_path=settings.state_dir / "ledger.db",
                        state_path=settings.state_dir / "fleet-sync.json",
                        metrics=self.metrics, hardware=lambda: sampler.snapshot,
                        outbox_stats=link.outbox_stats, models=self.modelops,
                        ready=self.ready,
                        metrics_interval_s=settings.fleet.metrics_interval_s,
                        ledger_interval_s=settings.fleet.ledger_interval_s)
        except Exception:
            log.exception("fleet sync not started; the link runs without it")
            return None

    def _start_link(self, extra_handlers: Mapping[str, Any] | None) -> Link | None:
        """The link with this box's command handlers, held to the registry of command
        types (`link.dispatch`), started."""
        try:
            from edge_agent.fleet.device.link.birth import facts_source
            from edge_agent.fleet.device.link.dispatch import box_dispatch, unhandled
            from edge_agent.fleet.device.link.handlers import box_handlers
            from edge_agent.fleet.device.link.overlay import copy_keys
            from edge_agent.fleet.device.rollout.model_verify import model_verify_handler

            settings = self.settings
            ledger = settings.state_dir / "ledger.db"

            def purge(before: float | None) -> int:
                if before is None:
                    return purge_expired(ledger, settings.retention)
                return purge_before(ledger, before, settings.retention)

            def revoke(prefix: str) -> bool:
                revoked = self.governor.keys.revoke(prefix)
                self.governor.reload_keys()  # at once, not at the next periodic reload
                return revoked

            def apply_live(new: Settings, changes: dict[str, Any]) -> list[str]:
                # Every patchable key is read from the one Settings object when it is
                # used, except the sampler's interval (copied here) and whether content is
                # stored at all (decided at start: content_hours crossing 0 waits for a
                # restart).
                was_kept = settings.retention.content_hours > 0
                keys = [k for k in changes if k != "retention.content_hours"
                        or (new.retention.content_hours > 0) == was_kept]
                done = copy_keys(settings, new, keys)
                self.sampler.interval_s = settings.telemetry.interval_s
                if self.sync is not None:
                    self.sync.set_intervals(metrics_s=settings.fleet.metrics_interval_s,
                                            ledger_s=settings.fleet.ledger_interval_s)
                return done

            def ungated(command: Any, before: Settings, after: Settings,
                        changes: dict[str, Any]) -> None:
                from edge_agent.fleet.device.rollout.activation import hardware_summary
                from edge_agent.fleet.device.rollout.capacity import ungated_evidence

                ungated_evidence(settings, command.id, before, after, changes,
                                 hardware_summary())

            rollouts = self.rollouts
            verify = model_verify_handler(
                self.modelops, recorded=rollouts.release_digest if rollouts else None,
                nice=lambda: settings.fleet.rollout_nice)
            handlers = box_dispatch(box_handlers(settings, settings.state_dir, purge=purge,
                                                 revoke=revoke, apply_live=apply_live,
                                                 ungated=ungated),
                                    extra_handlers or {}, {"model.verify": verify})
            missing = unhandled(handlers)
            if missing:
                log.warning("fleet: no handler for %s on this box: refused as unknown_type",
                            ", ".join(missing))
            link = Link(settings.fleet, settings.state_dir,
                        facts=facts_source(lambda: settings, self.modelops, gpus=self.gpus),
                        handlers=handlers)
            link.start()
            return link
        except Exception:
            log.exception("fleet link not started; the box serves without it")
            return None
