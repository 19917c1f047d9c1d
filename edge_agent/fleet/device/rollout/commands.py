"""The `rollout.*` commands on the device: `rollout.start` creates a rollout, `rollout.cancel`
and `rollout.rollback` stop or undo one. Apart from the runner (`fleet.device.rollout.runner`)
because they run elsewhere: in the box, on the fleet link's `fleet-commands` thread, not on the
server's event loop where the runner drives each rollout (tests call them from anywhere).

`RolloutCommands` is the base of `fleet.device.rollout.runner.RolloutManager`, not an object of
its own: its store, its lock and its runner are the manager's. A command commits what it decided,
then wakes the runner (`begin`: `_wake`) or interrupts a rollout's task (`cancel`:
`_interrupt`, after marking its download to stop in `_stop_ids`); a rollback during the
switch only asks (`_aborts`: the gate fails with `rollback_requested`). Those marks are
read by the runner on the loop and in its download threads, so they are touched only
under `_lock`. A command returns at once: it never awaits, never waits for the runner,
and never downloads, verifies or activates a release (the runner's). The one pointer it
moves is an ACTIVE rollout's switch back (`rollout.rollback`), committed as ROLLED_BACK
before it.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.fleet.device.link.command_gate import Handler
from edge_agent.fleet.device.rollout.activation import restore_pointer
from edge_agent.fleet.device.rollout.name_claim import NameHeld, name_claim
from edge_agent.fleet.device.rollout.rules import check_id, check_name, check_version, target
from edge_agent.fleet.device.rollout.store import (
    IllegalTransition,
    NameBusy,
    Rollout,
    RolloutStore,
)
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.refusals import MALFORMED, CommandRefused
from edge_agent.fleet.protocol.rollout_states import ACTIVE, CANCELLED, ROLLED_BACK, SWITCHING
from edge_agent.names import normalize_name


class RolloutCommands:
    # The manager's, used here (`fleet.device.rollout.runner.RolloutManager`).
    settings: Settings
    ops: ModelOps
    store: RolloutStore
    _stop_ids: set[str]
    _aborts: set[str]
    _lock: threading.Lock

    @property
    def work_dir(self) -> Path:
        raise NotImplementedError

    def _published(self, r: Rollout, was: str | None) -> None:
        raise NotImplementedError

    def _publish(self, body: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _wake(self, rollout_id: str) -> None:
        raise NotImplementedError

    def _interrupt(self, rollout_id: str) -> None:
        raise NotImplementedError

    def handlers(self) -> dict[str, Handler]:
        """`rollout.start` {rollout_id, name, version}; `rollout.cancel` {rollout_id} or
        {name}; `rollout.rollback` {rollout_id} or {name}. Results: `accepted` and the
        rollout's summary (a refusal says why in `refused`)."""
        return {"rollout.start": self._start_handler, "rollout.cancel": self._cancel_handler,
                "rollout.rollback": self._rollback_handler}

    def _start_handler(self, command: Command) -> dict[str, Any]:
        args = command.args
        if set(args) != {"rollout_id", "name", "version"}:
            raise CommandRefused(MALFORMED, "args must be {rollout_id, name, version}")
        rid, name, version = check_id(args["rollout_id"]), args["name"], args["version"]
        return self.begin(rid, check_name(name), check_version(version), command.id)

    def _cancel_handler(self, command: Command) -> dict[str, Any]:
        return self.cancel(**target(command.args))

    def _rollback_handler(self, command: Command) -> dict[str, Any]:
        return self.rollback(**target(command.args))

    def begin(self, rollout_id: str, name: str, version: str,
              command_id: str | None = None) -> dict[str, Any]:
        """A new rollout (RECEIVED, committed) and its task; the same id again reports
        it; refused while another rollout of the name is live, or a `models pull` of it
        runs (its row is created under the name's claim: `fleet.device.rollout.name_claim`)."""
        key = normalize_name(name)
        claim = name_claim(self.settings.state_dir, key, {"rollout_id": rollout_id}) \
            if self.store.get(rollout_id) is None else nullcontext()
        try:
            with claim:
                r, created = self.store.create(rollout_id, key, version,
                                               command_id=command_id)
        except NameBusy as busy:
            return self._busy(rollout_id, busy.live.name, busy.live.summary())
        except NameHeld as held:
            return self._busy(rollout_id, key, held.holder)
        if created:
            self._published(r, None)
            self._wake(r.id)
        return {"accepted": True, "created": created, **r.summary()}

    def _busy(self, rollout_id: str, name: str, live: Mapping[str, Any]) -> dict[str, Any]:
        body = {"accepted": False, "refused": "busy", "rollout_id": rollout_id,
                "name": name, "live": dict(live)}
        self._publish({"event": "rollout.refused", **body})
        return body

    def cancel(self, rollout_id: str | None = None, name: str | None = None
               ) -> dict[str, Any]:
        """Before activation: CANCELLED (a download stops at its next chunk, its partial
        file goes). From ACTIVATING on: refused (`rollout.rollback` is the way back)."""
        r = self._find(rollout_id, name)
        if r is None:
            return {"accepted": False, "refused": "unknown", "rollout_id": rollout_id,
                    "name": name}
        if not r.live:
            return {"accepted": r.state == CANCELLED, **r.summary()}
        if r.state in SWITCHING:
            return {"accepted": False, "refused": "activating", **r.summary()}
        with self._lock:
            self._stop_ids.add(r.id)
        try:
            r = self.store.transition(r.id, CANCELLED, reason="cancel requested",
                                      expect=r.state)
        except IllegalTransition:
            return self.cancel(r.id)  # it moved meanwhile: decide again
        self._published(r, None)
        self._interrupt(r.id)
        shutil.rmtree(self.work_dir / r.id, ignore_errors=True)
        return {"accepted": True, **r.summary()}

    def rollback(self, rollout_id: str | None = None, name: str | None = None
                 ) -> dict[str, Any]:
        """ACTIVE: back to the previous digest now (if the name still serves this
        rollout's digest). ACTIVATING/GATING: the gate fails with `rollback_requested`.
        Earlier: the rollout is cancelled."""
        r = self._find(rollout_id, name, prefer=ACTIVE)
        if r is None:
            return {"accepted": False, "refused": "unknown", "rollout_id": rollout_id,
                    "name": name}
        if r.state in SWITCHING:
            with self._lock:
                self._aborts.add(r.id)
            return {"accepted": True, "requested": True, **r.summary()}
        if r.live:
            return self.cancel(r.id)
        if r.state != ACTIVE:
            return {"accepted": r.state == ROLLED_BACK, **r.summary()}
        if self.ops.store.active_digest(r.name) != r.target_digest:
            return {"accepted": False, "refused": "superseded", **r.summary()}
        try:
            r = self.store.transition(r.id, ROLLED_BACK, reason="rollback requested",
                                      expect=ACTIVE, restored=False)
        except IllegalTransition:
            return self.rollback(r.id)
        self._published(r, None)
        r = restore_pointer(self.ops, self.store, r)
        return {"accepted": True, **r.summary()}

    def _find(self, rollout_id: str | None, name: str | None,
              prefer: str | None = None) -> Rollout | None:
        if rollout_id is not None:
            return self.store.get(rollout_id)
        assert name is not None
        key = normalize_name(name)
        live = self.store.live_for(key)
        if live is not None:
            return live
        return (self.store.latest_for(key, prefer) if prefer else None) \
            or self.store.latest_for(key)
