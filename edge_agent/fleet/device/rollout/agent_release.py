"""An agent release's activation: the running version switches to the new one, which
proves itself after the restart, or the base entry puts the previous one back.

    old version   STAGED → ACTIVATING: the golden set on the default model (the baseline,
                  kept in the rollout's config), the databases snapshotted, the trial
                  written, `current` switched, a restart asked of systemd
    base entry    counts the new version's starts, or rolls it back (`device.agent.boot`)
    new version   ACTIVATING → GATING: ready within `fleet.agent_ready_timeout_s` of the
                  switch, the golden set again, compared with the baseline as a capacity
                  release compares (answers, tokens/s, first token); passed: the trial
                  committed, then ACTIVE; failed: the trial failed, a restart asked, and
                  the entry puts the previous version back
    previous      finds the trial rolled back: ROLLED_BACK with its reason and checks

A restart at any step converges (`converge`): no trial for the rollout (killed before the
switch began) or a trial whose switch never happened ends ROLLED_BACK; a gate a kill cut
is failed ("interrupted during gating"), never run again; a trial committed before a kill
ends ACTIVE. The trial file is the one record these steps agree on; the rollout row
follows it (a restored database may hold an older row).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edge_agent import __version__
from edge_agent.fleet.device.agent import snapshot, trial
from edge_agent.fleet.device.agent.slots import Slots
from edge_agent.fleet.device.agent.trial import (
    COMMITTED,
    FAILED,
    ROLLED_BACK,
    SWITCHING,
    TRYING,
    Trial,
)
from edge_agent.fleet.device.link.birth import llama_cpp_version
from edge_agent.fleet.device.rollout import capacity, health_gate
from edge_agent.fleet.device.rollout.activation import Activation, interrupted, requested
from edge_agent.fleet.device.rollout.health_gate import Check, GateReport, GateSpec
from edge_agent.fleet.device.rollout.store import Rollout
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    GATING,
    STAGED,
)
from edge_agent.fleet.protocol.rollout_states import (
    ROLLED_BACK as RS_ROLLED_BACK,
)
from edge_agent.names import ModelName

log = logging.getLogger(__name__)


class _Answer:
    """A baseline answer as the rollout's config keeps it across the restart."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.text = str(data.get("text", ""))
        self.completion_tokens = int(data.get("completion_tokens", 0))
        self.ttft_ms = float(data.get("ttft_ms", 0.0))
        self.eval_ms = float(data.get("eval_ms", 0.0))
        self.digest = str(data.get("digest", ""))


def _dump_replay(replay: capacity.Replay) -> dict[str, Any]:
    return {"answers": {k: {"text": a.text, "completion_tokens": a.completion_tokens,
                            "ttft_ms": a.ttft_ms, "eval_ms": a.eval_ms, "digest": a.digest}
                        for k, a in replay.answers.items()},
            "errors": dict(replay.errors), "checks": [c.as_dict() for c in replay.checks]}


def _load_replay(data: Mapping[str, Any] | None) -> capacity.Replay:
    data = data or {}
    return capacity.Replay(
        {k: _Answer(v) for k, v in (data.get("answers") or {}).items()},  # type: ignore[misc]
        dict(data.get("errors") or {}),
        [Check(**c) for c in data.get("checks") or []])


class AgentRelease:
    """`activation.Release` for a rollout of `protocol.agent_release.AGENT_NAME`."""

    def __init__(self, act: Activation, *, restart: Callable[[], None],
                 ready: Callable[[], bool], version: str = __version__,
                 running: Callable[[], str | None] | None = None) -> None:
        """`version`: the agent this process is; `running`: the release it runs from
        (None: the base install; default: read from the interpreter's prefix)."""
        self.act = act
        self.restart = restart
        self.ready = ready
        self.version = version
        self._running = running

    @property
    def slots(self) -> Slots:
        root = self.act.settings.fleet.agent_releases_dir
        assert root is not None  # the runner rejects agent releases without it
        return Slots(root)

    @property
    def state_dir(self) -> Path:
        return self.act.settings.state_dir

    def running(self) -> str | None:
        return self._running() if self._running is not None else self.slots.running()

    def _model(self) -> ModelName:
        return ModelName.parse(self.act.settings.default_model)

    # -- in the running (old) version ---------------------------------------------------------
    async def activate(self, r: Rollout, spec: GateSpec, abort: Callable[[], bool]
                       ) -> Rollout:
        act, slots = self.act, self.slots
        previous = slots.current()
        info: dict[str, Any] = {"from": self.version, "previous": previous,
                "llama_cpp_from": llama_cpp_version()}
        r = await act.move(r, ACTIVATING, expect=STAGED, config={"agent": info})
        if spec.prompts:
            if act.ops.loader is not None:
                await act.ops.load(self._model())
            baseline = await capacity.replay(spec, self._model(), act.probe)
            info["baseline"] = _dump_replay(baseline)
            r = await asyncio.to_thread(act.store.update, r.id, config={"agent": info})
        if abort():
            return await self._end_here(r, [requested()])
        snap = trial.agent_dir(self.state_dir) / "snapshots" / r.id
        shutil.rmtree(snap, ignore_errors=True)
        taken = await asyncio.to_thread(snapshot.take, self.state_dir, snap)
        t = Trial(r.id, r.version, previous, SWITCHING, act.clock(), str(snap))
        await asyncio.to_thread(trial.write, self.state_dir, t)
        await asyncio.to_thread(slots.switch, r.version)
        await asyncio.to_thread(trial.write, self.state_dir, t.but(state=TRYING))
        info["snapshot"] = taken
        r = await asyncio.to_thread(act.store.update, r.id, config={"agent": info})
        act.tell("switched", r)
        act.emit({"event": "agent.switching", "rollout_id": r.id, "from": self.version,
                  "to": r.version})
        self.restart()
        return r

    async def _end_here(self, r: Rollout, checks: list[Check]) -> Rollout:
        """ROLLED_BACK before anything was switched."""
        r = await self.act.rolled_back(r, checks)
        r = await asyncio.to_thread(self.act.store.update, r.id, restored=True)
        self.evidence(r, checks)
        return r

    # -- after a restart, in whichever version runs ---------------------------------------------
    async def converge(self, r: Rollout, spawn: Callable[[Any], None]) -> None:
        """What a start finds of an agent rollout that was switching, or rolled back with
        its end unrecorded (the module's doc). `spawn(coro)` runs the gate as a task (the
        start must not wait for it)."""
        t = await asyncio.to_thread(trial.read, self.state_dir)
        me = self.running()
        if t is None or t.rollout_id != r.id:
            if r.state in (ACTIVATING, GATING):
                r = await self.act.move(r, RS_ROLLED_BACK, reason=interrupted(r.state),
                                        expect=r.state, restored=False)
            await self._finish(r, None, [])
            return
        if t.state == ROLLED_BACK:
            await self._finish(r, t, [Check(**c) for c in t.checks] or [
                Check("agent", False, "rolled back", None, t.reason[:200])])
        elif t.state == COMMITTED:
            await self._committed(r, t)
        elif t.state in (SWITCHING, TRYING) and me == t.version:
            if r.state == GATING:
                await self._failed(r, t, [Check("agent", False, "interrupted", None,
                                                interrupted(GATING))],
                                   reason=interrupted(GATING))
            else:
                spawn(self._prove(r, t))
        else:  # failed, and the entry has not run since; or a version not the trial's
            log.warning("agent rollout %s: trial %s of %s found by %s; restarting for the "
                        "entry to decide", r.id, t.state, t.version, me or "the base install")
            if t.state != FAILED:
                await asyncio.to_thread(trial.write, self.state_dir, t.but(
                    state=FAILED, reason=f"running {me or 'the base install'}, not "
                    f"{t.version}"))
            self.restart()

    async def _prove(self, r: Rollout, t: Trial) -> None:
        """The new version's gate, then its commit or its failure."""
        act = self.act
        if r.state == ACTIVATING:
            r = await act.move(r, GATING, expect=ACTIVATING)
        deadline = t.switched_at + act.settings.fleet.agent_ready_timeout_s
        spec = health_gate.parse_spec(((r.release or {}).get("manifest") or {}).get("gate"))
        while not self.ready():
            if act.clock() > deadline:
                await self._failed(r, t, [Check("ready", False, "not ready", None,
                                                "not ready within fleet.agent_ready_timeout_s "
                                                "of the switch")])
                return
            await asyncio.sleep(act.poll_s)
        report = GateReport()
        info = (r.config or {}).get("agent") or {}
        report.checks.append(Check("agent_version", self.version == r.version, self.version,
                                   r.version, "the version that answers"))
        if spec.prompts:
            baseline = _load_replay(info.get("baseline"))
            staged = await capacity.replay(spec, self._model(), act.probe)
            report.checks.extend(staged.checks)
            report.checks.extend(capacity.compare(spec, baseline, staged))
            report.checks.extend(capacity.compare_speed(spec, baseline, staged))
            if spec.ttft_ms_max is not None and staged.answers:
                report.checks.append(health_gate.check_ttft(list(staged.answers.values()),
                                                            spec.ttft_ms_max))
        if act.clock() > deadline:
            report.checks.append(Check("ready", False, "late", None, "the gate ended after "
                                       "fleet.agent_ready_timeout_s"))
        if not report.passed:
            await self._failed(r, t, report.checks)
            return
        t = await asyncio.to_thread(trial.write, self.state_dir, t.but(
            state=COMMITTED, checks=[c.as_dict() for c in report.checks]))
        await self._committed(r, t)

    async def _committed(self, r: Rollout, t: Trial) -> None:
        """ACTIVE (if not yet), the evidence, the trial and snapshot gone, and every
        version but this one and the previous removed."""
        checks = [Check(**c) for c in t.checks]
        if r.state != ACTIVE:
            if r.state == ACTIVATING:
                r = await self.act.move(r, GATING, expect=ACTIVATING)
            r = await self.act.activated(r, GateReport(checks), agent=t.version)
        self.evidence(r, checks, t)
        await asyncio.to_thread(self._clean, t, {t.version, t.previous})

    async def _failed(self, r: Rollout, t: Trial, checks: list[Check],
                      reason: str | None = None) -> None:
        """The trial failed with the checks (kept in the trial: the database the
        previous version reads may be a restored one), then a restart for the entry."""
        reason = reason or GateReport(list(checks)).reason() or "its gate failed"
        await asyncio.to_thread(trial.write, self.state_dir, t.but(
            state=FAILED, reason=reason, checks=[c.as_dict() for c in checks]))
        self.act.emit({"event": "agent.failed", "rollout_id": r.id, "version": t.version,
                       "reason": reason})
        self.restart()

    async def _finish(self, r: Rollout, t: Trial | None, checks: list[Check]) -> None:
        """ROLLED_BACK recorded with the trial's reason, the evidence, the clean-up."""
        if r.state != RS_ROLLED_BACK:
            r = await self.act.rolled_back(r, checks) if t is None else await self.act.move(
                r, RS_ROLLED_BACK, reason=t.reason or "rolled back", expect=r.state,
                details={"failed": [c.name for c in checks if not c.passed],
                         "restored": t.restored, "boots": t.boots},
                gate={"checks": [c.as_dict() for c in checks]}, restored=False)
        r = await asyncio.to_thread(self.act.store.update, r.id, restored=True)
        self.evidence(r, checks, t)
        if t is not None:
            await asyncio.to_thread(self._clean, t, {t.previous, self.slots.current()})

    def _clean(self, t: Trial, keep: set[str | None]) -> None:
        trial.clear(self.state_dir)
        shutil.rmtree(t.snapshot, ignore_errors=True)
        self.slots.prune(keep)

    async def restore(self, r: Rollout) -> None:
        """A ROLLED_BACK agent rollout whose end a restart did not record."""
        t = await asyncio.to_thread(trial.read, self.state_dir)
        await self._finish(r, t if t is not None and t.rollout_id == r.id else None, [])

    def evidence(self, r: Rollout, checks: list[Check], t: Trial | None = None) -> None:
        info = (r.config or {}).get("agent") or {}
        self.act.evidence(r, checks, {"agent": {
            "from": info.get("from"), "to": r.version, "previous": info.get("previous"),
            "llama_cpp_from": info.get("llama_cpp_from"),
            "boots": t.boots if t else None,
            "restored": t.restored if t else None,
            "switch_s": round(time.time() - t.switched_at, 3) if t else None}})

    # -- an operator's rollback of an ACTIVE agent release ----------------------------------------
    def back_to_previous(self, r: Rollout) -> str | None:
        """`current` back to the version this release replaced (the databases as they
        are: the release was committed and what it wrote is the box's); the reason it
        cannot be, else None."""
        previous = ((r.config or {}).get("agent") or {}).get("previous")
        slots = self.slots
        if slots.current() != r.version:
            return "superseded"
        if previous is not None and not slots.installed(previous):
            return "previous_gone"
        slots.switch(previous)
        return None
