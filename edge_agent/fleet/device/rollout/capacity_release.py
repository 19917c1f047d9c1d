"""A capacity release's activation: the staged runtime swapped in on the version served,
gated against the box's own baseline, and kept (written to the overlay) or swapped back.
The states, the checks and what survives a restart: `capacity`'s docstring, whose helpers
(keys, effective values, the swap, the comparisons) this uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from edge_agent.config import Settings
from edge_agent.errors import EdgeAgentError
from edge_agent.fleet.device.link.overlay import (
    MISSING,
    apply_patch,
    copy_keys,
    overlay_values,
    restore_keys,
)
from edge_agent.fleet.device.rollout import capacity, health_gate
from edge_agent.fleet.device.rollout.activation import (
    Activation,
    RetryLater,
    failed,
    requested,
)
from edge_agent.fleet.device.rollout.health_gate import Check, GateReport, GateSpec
from edge_agent.fleet.device.rollout.store import Rollout
from edge_agent.fleet.protocol.rollout_states import ACTIVATING, GATING, STAGED

log = logging.getLogger(__name__)


class CapacityRelease:
    """`activation.Release` for a rollout with `config`: STAGED → ACTIVATING (baseline,
    staged runtime) → GATING → ACTIVE | ROLLED_BACK, on the version served."""

    def __init__(self, act: Activation) -> None:
        self.act = act
        self.ops = act.ops

    async def activate(self, r: Rollout, spec: GateSpec, abort: Callable[[], bool]
                       ) -> Rollout:
        act, target, change = self.act, r.target_digest, r.capacity
        assert target is not None and change is not None
        keys = capacity.overlay_changes(r.name, change)
        live = act.settings
        was = live.model_copy(deep=True)
        config = {"change": change, "before": capacity.effective(was, r.name),
                  "values_before": capacity.raw_values(was, keys),
                  "overlay_before": {k: v for k, v in
                                     overlay_values(live.state_dir, keys).items()
                                     if v is not MISSING}}
        previous = self.ops.active_digest(r.name)
        r = await act.move(r, ACTIVATING, expect=STAGED, previous_digest=previous,
                           config=config)
        checks: list[Check] = []
        if previous != target:
            checks.append(Check("serving_version", False, (previous or "none")[:12],
                                target[:12], "a capacity release is gated on the version "
                                "the box serves; this box serves another"))
            return await self._back(r, checks, was, keys, swapped=False)
        try:
            staged = capacity.staged_settings(was, r.name, change)
        except EdgeAgentError as exc:
            checks.append(Check("config", False, "invalid", None, exc.message[:200]))
            return await self._back(r, checks, was, keys, swapped=False)
        config["after"] = capacity.effective(staged, r.name)
        r = await asyncio.to_thread(act.store.update, r.id, config=config)
        if self.ops.loader is not None:  # the baseline: the serving runtime, as it is
            await self.ops.load(r.name)
        baseline = await capacity.replay(spec, r.name, act.probe)
        swapped = False
        try:
            if abort():
                checks.append(requested())
            else:
                swapped = True
                await capacity.swap_runtime(
                    self.ops, r.name, target, act.wait_idle,
                    lambda: copy_keys(live, staged, keys))
                act.tell("switched", r)
        except RetryLater:
            if swapped:  # drained too long: nothing changed, the old settings stand
                copy_keys(live, was, keys)
            raise
        except Exception as exc:  # a bug must still end on the previous settings
            checks.append(failed(r, exc, "staging the runtime"))
        if checks:
            return await self._back(r, checks, was, keys, swapped=swapped)
        switched_at = act.clock()
        r = await act.move(r, GATING, expect=ACTIVATING)
        report = await self._gate(r, spec, baseline, switched_at, abort)
        if not report.passed:
            return await self._back(r, report.checks, was, keys, swapped=True)
        await asyncio.to_thread(apply_patch, was, live.state_dir, keys, capacity=True,
                                texts=True)
        r = await act.activated(r, report, config=change)
        self.evidence(r, report.checks)
        return r

    async def restore(self, r: Rollout) -> None:
        """The way back of a rollout already ROLLED_BACK (an operator's, or a restart's),
        idempotent: its overlay keys as they were before it (nothing to do if it never
        wrote them), the live settings as they were, and the model loaded again with them
        if they had changed; `restored` once done."""
        config = r.config or {}
        settings = self.act.settings
        keys = capacity.overlay_changes(r.name, config.get("change") or {})
        before = config.get("overlay_before") or {}
        await asyncio.to_thread(restore_keys, settings.state_dir,
                                {k: before.get(k, MISSING) for k in keys})
        values = config.get("values_before") or {}
        if values and capacity.raw_values(settings, keys) != values:
            await self._swap_back(r, capacity.with_values(settings, values), keys)
        await asyncio.to_thread(self.act.store.update, r.id, restored=True)

    def evidence(self, r: Rollout, checks: list[Check]) -> None:
        """The attempt's evidence row, with the change and the name's settings before and
        after it."""
        config = r.config or {}
        self.act.evidence(r, checks, {
            "capacity": {"change": config.get("change"), "before": config.get("before"),
                         "after": config.get("after")},
            "quantization": ((r.release or {}).get("manifest") or {}).get("quantization")})

    async def _gate(self, r: Rollout, spec: GateSpec, baseline: capacity.Replay,
                    switched_at: float, abort: Callable[[], bool]) -> GateReport:
        assert r.target_digest is not None
        act = self.act
        report = act.gate_report(spec)
        staged = await capacity.replay(spec, r.name, act.probe)
        report.checks.extend(staged.checks)
        report.checks.extend(capacity.compare(spec, baseline, staged))
        if staged.answers:
            report.checks.append(health_gate.check_served(list(staged.answers.values()),
                                                          r.target_digest))
        if spec.prompts:
            speed = capacity.compare_speed(spec, baseline, staged)
            if not all(c.passed for c in speed) and not abort():
                # One more pass before a verdict on speed (a burst of the store's own
                # traffic must not roll a sound change back): the better pass counts.
                again = await capacity.replay(spec, r.name, act.probe)
                better = capacity.compare_speed(spec, baseline, again)
                if sum(c.passed for c in better) > sum(c.passed for c in speed):
                    speed = better
            report.checks.extend(speed)
            burst = await capacity.replay(spec, r.name, act.probe, burst=True)
            report.checks.append(capacity.check_burst(burst, spec))
        if spec.ttft_ms_max is not None and staged.answers:
            report.checks.append(health_gate.check_ttft(list(staged.answers.values()),
                                                        spec.ttft_ms_max))
        return await act.gate_end(r, spec, report, switched_at, abort)

    async def _back(self, r: Rollout, checks: list[Check], was: Settings,
                    keys: Mapping[str, Any], *, swapped: bool) -> Rollout:
        """ROLLED_BACK committed, then the previous settings copied back and the model
        loaded with them again (the overlay never held the new ones)."""
        r = await self.act.rolled_back(r, checks)
        if swapped:
            await self._swap_back(r, was, keys)
        r = await asyncio.to_thread(self.act.store.update, r.id, restored=True)
        self.evidence(r, checks)
        return r

    async def _swap_back(self, r: Rollout, previous: Settings, keys: Mapping[str, Any]
                         ) -> None:
        """The live settings as `previous` has them for `keys`, the model loaded with
        them again; if that load fails the settings are back all the same, and the next
        request loads with them."""
        settings = self.act.settings
        try:
            await capacity.swap_runtime(self.ops, r.name, r.target_digest or "",
                                        self.act.wait_idle,
                                        lambda: copy_keys(settings, previous, keys))
        except Exception:
            copy_keys(settings, previous, keys)
            log.exception("rollout %s: loading %s again with its previous settings failed",
                          r.id, r.name)
