"""The rollout engine: inside `fleet serve`, a thread that drives every unsettled rollout
of the store, one tick a second (`rollout_tick_s`).

Each tick, for each rollout the store says is not settled:

1. commands recorded but not taken by the broker (a crash, a broker outage) are published
   again, the same signed bytes (a box runs a command id once);
2. `waves.decide` reads the rollout's per-device states (which the ingest keeps current,
   in its own transaction: `rollout_queries`) and the clock: abort, next wave, completion,
   timed-out devices, what to cancel or roll back;
3. the decision is committed only if the rollout is still in the state it was read in
   (an operator's pause/abort/rollback in between wins, and is decided at the next tick);
4. the commands it calls for are signed with the controller's key, recorded (with their
   per-stream seqs) before they are published, then published; a rollout.start is
   recorded only while the rollout is RUNNING and only once per device.

Everything lives in the store, so a restarted `fleet serve` carries on where it stopped,
and so does another controller of the same store when it takes the lead (`leadership`:
only the leader ticks).
A rollout.start lives as long as the rollout's device timeout: a box offline at its wave
gets it from its broker session when it reconnects, and one arriving after the controller
counted the box as timed out is refused by the box as expired. Must never: publish
anything but the rollout.* commands, decide in SQL or in a callback, or hold a store
transaction across the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.config.controller import ControllerSettings
from edge_agent.errors import ServiceUnavailable
from edge_agent.fleet.controller import commands
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.rollout_records import RolloutRecord
from edge_agent.fleet.controller.store import ControllerStore, StoreConflict
from edge_agent.fleet.controller.waves import RUNNING, Plan, decide

log = logging.getLogger(__name__)

START, CANCEL, ROLLBACK = "rollout.start", "rollout.cancel", "rollout.rollback"
CHUNK = 200  # commands signed, recorded and published per transaction


class RolloutEngine:
    """`start()` the thread, `stop()` it; `tick()` runs one pass (tests call it directly)."""

    def __init__(self, settings: ControllerSettings, store: ControllerStore,
                 key: Ed25519PrivateKey | None, *, metrics: ControllerMetrics | None = None,
                 publisher: commands.Publisher | None = None,
                 clock: Callable[[], float] = time.time, tick_s: float | None = None,
                 leading: Callable[[], bool] = lambda: True) -> None:
        self.settings = settings
        self.leading = leading  # beside other controllers: only the leader drives rollouts
        self.store = store
        self.key = key
        self.metrics = metrics
        self.publisher = publisher or commands.Publisher(
            settings, client_id=f"{settings.broker.client_id}-rollouts")
        self.clock = clock
        self.tick_s = settings.rollout_tick_s if tick_s is None else tick_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: set[str] = set()  # warnings given once per cause, not every tick

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fleet-rollouts", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.publisher.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.tick()
            self._stop.wait(max(0.0, self.tick_s - (time.monotonic() - started)))

    def tick(self) -> dict[str, Plan]:
        """One pass over the unsettled rollouts; the plan carried out for each (a rollout
        another writer changed meanwhile, or whose pass failed, has none)."""
        done: dict[str, Plan] = {}
        if not self.leading():
            return done
        try:
            pending = self.store.rollouts.rollouts(unsettled=True, limit=1000)
        except Exception:
            self._once("store", "fleet rollouts: the store did not answer; retrying",
                       exc_info=True)
            return done
        self._said.discard("store")
        if pending and self.key is None:
            self._once("key", "fleet rollouts: %d rollout(s) wait: no command_signing_key_file to "
                       "sign their commands with", len(pending))
            return done
        for record in reversed(pending):  # oldest first
            try:
                plan = self.drive(record)
            except ServiceUnavailable as exc:
                self._once("broker", "fleet rollouts: %s; publishing again at the next tick",
                           exc)
                continue
            except StoreConflict as exc:  # another writer's transaction crossed this pass
                log.warning("fleet rollouts: rollout %s: %s; again at the next tick",
                            record.id, exc)
                continue
            except Exception:
                log.exception("fleet rollouts: rollout %s: this pass failed", record.id)
                continue
            if plan is not None:
                done[record.id] = plan
        return done

    # -- one rollout ----------------------------------------------------------------------------
    def drive(self, r: RolloutRecord) -> Plan | None:
        """One step of one rollout (the module docstring's 2-4, then 1: a broker away
        holds the commands back, never the decision)."""
        devices = self.store.rollouts.rollout_devices(r.id)
        now = self.clock()
        plan = decide(r.state, r.wave, r.policy(), [d.view() for d in devices], now,
                      busy_retry_s=self.settings.rollout_busy_retry_s)
        if not self.store.rollouts.apply_plan(r.id, expect=r.state, state=plan.state,
                                              wave=plan.wave, reason=plan.reason,
                                              settled=plan.settled, timed_out=plan.timed_out,
                                              skipped=plan.skipped, now=now):
            return None  # changed under us: decided again next tick
        if plan.state != r.state:
            log.info("fleet rollout %s (%s@%s): %s -> %s: %s", r.id, r.name, r.version,
                     r.state, plan.state, plan.reason)
        if plan.wave != r.wave:
            log.info("fleet rollout %s: wave %d of %d starts (%d devices)", r.id, plan.wave,
                     r.waves_total, sum(1 for d in devices if d.wave == plan.wave))
        self._republish(r.id)
        self._said.discard("broker")
        fleets = {d.device: d.fleet for d in devices}
        ttl = max(r.device_timeout_s, 1.0)
        start: dict[str, Any] = {"rollout_id": r.id, "name": r.name, "version": r.version}
        if r.config:  # a capacity release: the settings, gated on the version served
            start["config"] = dict(r.config)
        self._send(r, START, plan.start, fleets, start, ttl, require_state=RUNNING)
        first = {d.device: d.started_at for d in devices}
        for device in plan.retry:  # what is left of its device timeout, at least a second
            left = (first[device] or now) + r.device_timeout_s - now
            self._send(r, START, [device], fleets, start, max(left, 1.0),
                       require_state=RUNNING, retry=True)
        later = max(ttl, self.settings.command_ttl_s)
        self._send(r, CANCEL, plan.cancel, fleets, {"rollout_id": r.id}, later)
        self._send(r, ROLLBACK, plan.rollback, fleets, {"rollout_id": r.id}, later)
        return plan

    def _send(self, r: RolloutRecord, type_: str, devices: Sequence[str],
              fleets: Mapping[str, str], args: Mapping[str, Any], ttl_s: float, *,
              require_state: str | None = None, retry: bool = False) -> None:
        assert self.key is not None
        for at in range(0, len(devices), CHUNK):
            chunk = devices[at:at + CHUNK]
            streams = {d: commands.stream(fleets[d], d) for d in chunk}
            seqs = self.store.rollouts.next_command_seqs(sorted(set(streams.values())))
            built = {d: commands.build(self.store, self.key, fleet=fleets[d], device=d,
                                       type_=type_, args=args, ttl_s=ttl_s, clock=self.clock,
                                       seq=seqs[streams[d]]) for d in chunk}
            claimed = self.store.rollouts.claim_commands(r.id, built, self.clock(),
                                                         require_state=require_state, retry=retry)
            if claimed and (type_ != START or retry):  # a wave's starts: with the wave
                log.info("fleet rollout %s: %s%s to %d device(s)", r.id, type_,
                         " again (busy before)" if retry else "", len(claimed))
            self._publish([built[d] for d in claimed])

    def _republish(self, rollout_id: str) -> None:
        waiting = self.store.rollouts.unpublished_commands(rollout_id)
        if waiting:
            log.info("fleet rollout %s: publishing %d recorded command(s) again", rollout_id,
                     len(waiting))
            for at in range(0, len(waiting), CHUNK):
                self._publish(waiting[at:at + CHUNK])

    def _publish(self, batch: Sequence[Mapping[str, Any]]) -> None:
        if not batch:
            return
        self.publisher.publish(batch)  # ServiceUnavailable: stays recorded, unpublished
        self.store.rollouts.mark_published([str(c["id"]) for c in batch], self.clock())
        if self.metrics is not None:
            for c in batch:
                self.metrics.rollout_commands.labels(str(c["type"])).inc()

    def _once(self, cause: str, message: str, *args: Any, exc_info: bool = False) -> None:
        if cause not in self._said:
            self._said.add(cause)
            log.warning(message, *args, exc_info=exc_info)
