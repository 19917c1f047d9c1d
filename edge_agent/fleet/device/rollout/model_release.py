"""A model release's activation: the new version loaded beside the old one (or the name
drained), the pointer switched, the gate, and the old version let go or the pointer back.

    ACTIVATING  previous digest committed; a release that would take the chat template
                away (the previous version has one, the new one none) rolled back before
                anything loads; the previous version measured on the golden
                prompts (when a tokens/s floor is set); the new version loaded beside the
                old one when it fits without evicting anything — both held loaded —, else
                the name drained (new requests 503 + Retry-After, running ones finish on
                the old weights, old unloaded); the pointer switched (`rollout:<id>`).
    GATING      the gate (`fleet.device.rollout.health_gate`) on the new version: golden
                prompts as real requests, served digest, tokens/s floor, TTFT ceiling,
                memory headroom, optional soak (the first N real requests without a
                server error). With a speed floor the prompts wait (up to 60 s) for the
                requests still running on the old version to end, and a speed below the
                floor is measured once more before it counts.
    ACTIVE      gate passed: the old version is let go (unloaded once idle).
    ROLLED_BACK gate failed (or the load failed, or an operator asked): committed first,
                then the pointer goes back to the previous digest at once — the old version
                is still loaded, so no request waits — and the new version stays installed
                for diagnosis; the failing check is named with its figure.

Requests already running when the pointer moves finish on the weights they started on
(the registry resolves the pointer per request), so a client sees no failed request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from edge_agent.engine.modelops import ModelOps
from edge_agent.errors import EdgeAgentError
from edge_agent.fleet.device.rollout import health_gate
from edge_agent.fleet.device.rollout.activation import (
    Activation,
    RetryLater,
    failed,
    requested,
)
from edge_agent.fleet.device.rollout.health_gate import Check, GateReport, GateSpec
from edge_agent.fleet.device.rollout.store import Rollout, RolloutStore
from edge_agent.fleet.protocol.rollout_states import ACTIVATING, ACTIVE, GATING, STAGED
from edge_agent.names import ModelName

log = logging.getLogger(__name__)


def by(rollout: Rollout) -> str:
    return f"rollout:{rollout.id}"


def restore_pointer(ops: ModelOps, store: RolloutStore, rollout: Rollout) -> Rollout:
    """The switch back a ROLLED_BACK row committed: if the name still serves the rollout's
    digest, back to the previous one (a name that had none is removed: nothing may serve
    a release whose gate did not pass). Idempotent; `restored` once done."""
    active = ops.active_digest(rollout.name)
    if active is not None and active == rollout.target_digest:
        if rollout.previous_digest:
            ops.activate(rollout.name, rollout.previous_digest, by=by(rollout))
        else:
            ops.remove(rollout.name, by=by(rollout))  # 503 while in use: resume retries
    return store.update(rollout.id, restored=True)


class ModelRelease:
    """`activation.Release` for a release of a new version."""

    def __init__(self, act: Activation) -> None:
        self.act = act
        self.ops = act.ops

    async def activate(self, r: Rollout, spec: GateSpec, abort: Callable[[], bool]
                       ) -> Rollout:
        act, target = self.act, r.target_digest
        assert target is not None
        previous = self.ops.active_digest(r.name)
        r = await act.move(r, ACTIVATING, expect=STAGED, previous_digest=previous)
        if previous == target:
            r = await act.move(r, ACTIVE, reason="already active")
            self.evidence(r, [])
            return r
        template = self._template_check(r.name, previous, target)
        if not template.passed:  # before the switch: no chat is refused meanwhile
            return await self._roll_back(r, [template], held=False)
        checks: list[Check] = []
        baseline = None
        loader = self.ops.loader is not None
        drained = held = False
        try:
            if spec.needs_baseline and previous is not None:
                answers, _ = await health_gate.run_prompts(spec, r.name, act.probe)
                baseline = health_gate.tokens_per_s(answers)
            if loader and await self.ops.fits(r.name, target):
                held = True
                if previous is not None:
                    self.ops.hold(r.name, previous)
                self.ops.hold(r.name, target)
                await self.ops.load(r.name, digest=target)
            elif loader:
                drained = True
                self.ops.drain(r.name, True)
                await act.wait_idle(r.name)
                if previous is not None:
                    await self.ops.unload(r.name, previous)
            if abort():
                checks.append(requested())
            else:
                await asyncio.to_thread(self.ops.activate, r.name, target, by=by(r))
                act.tell("switched", r)
                if drained:  # by digest: the drain refuses requests for the name
                    await self.ops.load(r.name, digest=target)
        except RetryLater:
            self._let_go(r, held, drained)
            raise
        except Exception as exc:  # a bug must still end in a consistent pointer
            checks.append(failed(r, exc, "activation"))
        finally:
            if drained:
                self.ops.drain(r.name, False)
        if checks:
            return await self._roll_back(r, checks, held)
        switched_at = act.clock()
        r = await act.move(r, GATING, expect=ACTIVATING)
        report = await self._gate(r, spec, baseline, switched_at, abort)
        if not report.passed:
            return await self._roll_back(r, report.checks, held)
        r = await act.activated(r, report)
        await self._release(r, held, keep=target)
        self.evidence(r, report.checks)
        return r

    async def restore(self, r: Rollout) -> None:
        await asyncio.to_thread(restore_pointer, self.ops, self.act.store, r)

    def evidence(self, r: Rollout, checks: list[Check]) -> None:
        """The attempt's evidence row, with what the release runs with here: its default
        sampling parameters and the box's runtime plan for the name."""
        manifest = (r.release or {}).get("manifest") or {}
        settings = self.act.settings
        rt = settings.runtime
        override = settings.model_override(r.name)
        trained = manifest.get("context_length")
        ctx = override.context_length or rt.context_length
        self.act.evidence(r, checks, {
            "defaults": manifest.get("parameters") or {},
            "quantization": manifest.get("quantization"),
            "context_length": min(ctx, trained) if isinstance(trained, int) else ctx,
            "parallel": override.parallel or rt.parallel,
            "threads": override.threads or rt.threads,
            "n_gpu_layers": override.n_gpu_layers if override.n_gpu_layers is not None
            else rt.n_gpu_layers})

    def _template_check(self, name: ModelName, previous: str | None, target: str) -> Check:
        templates = {v.digest: v.model.chat_template
                     for v in self.ops.versions(name, missing_ok=True)}
        return health_gate.check_template(templates.get(previous) if previous else None,
                                          templates.get(target))

    async def _gate(self, r: Rollout, spec: GateSpec, baseline: float | None,
                    switched_at: float, abort: Callable[[], bool]) -> GateReport:
        assert r.target_digest is not None
        act = self.act
        report = act.gate_report(spec)
        if spec.needs_baseline and r.previous_digest is not None:
            await act.settle(r.name, r.previous_digest)
        answers, checks = await health_gate.run_prompts(spec, r.name, act.probe)
        report.checks.extend(checks)
        if answers:
            report.checks.append(health_gate.check_served(answers, r.target_digest))
        if spec.tokens_per_s_floor is not None and answers:
            speed = health_gate.check_speed(health_gate.tokens_per_s(answers), baseline,
                                            spec.tokens_per_s_floor)
            if not speed.passed and not abort():
                # One more pass before a verdict on speed: a burst of the store's own
                # traffic must not roll a sound release back (the better pass counts).
                again, _ = await health_gate.run_prompts(spec, r.name, act.probe)
                best = max(health_gate.tokens_per_s(answers) or 0.0,
                           health_gate.tokens_per_s(again) or 0.0)
                speed = health_gate.check_speed(best or None, baseline,
                                                spec.tokens_per_s_floor)
            report.checks.append(speed)
        if spec.ttft_ms_max is not None and answers:
            report.checks.append(health_gate.check_ttft(answers, spec.ttft_ms_max))
        return await act.gate_end(r, spec, report, switched_at, abort)

    async def _roll_back(self, r: Rollout, checks: list[Check], held: bool) -> Rollout:
        r = await self.act.rolled_back(r, checks)
        try:
            r = await asyncio.to_thread(restore_pointer, self.ops, self.act.store, r)
        except EdgeAgentError as exc:  # left `restored = 0`: resume finishes it
            log.error("rollout %s: switching back failed: %s", r.id, exc.message)
        await self._release(r, held, keep=r.previous_digest)
        self.evidence(r, checks)
        return r

    async def _release(self, r: Rollout, held: bool, keep: str | None) -> None:
        """Lets go of the holds; the version not kept is unloaded once idle."""
        if not held:
            return
        for digest in (r.previous_digest, r.target_digest):
            if digest is None:
                continue
            try:
                self.ops.hold(r.name, digest, False)
                if digest != keep:
                    await self.ops.unload(r.name, digest)
            except EdgeAgentError:  # removed meanwhile (a new name rolled back)
                pass

    def _let_go(self, r: Rollout, held: bool, drained: bool) -> None:
        """Nothing was switched and the rollout will be retried: no hold, no drain left."""
        if drained:
            self.ops.drain(r.name, False)
        for digest in (r.previous_digest, r.target_digest) if held else ():
            if digest is not None:
                try:
                    self.ops.hold(r.name, digest, False)
                except EdgeAgentError:
                    pass
