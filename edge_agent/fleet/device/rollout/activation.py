"""A staged release's activation: load beside (or drain), switch, gate, and keep or roll back.

    ACTIVATING  previous digest committed; a release that would take the chat template
                away (the previous version has one, the new one none) rolled back before
                anything loads; the previous version measured on the golden
                prompts (when a tokens/s floor is set); the new version loaded beside the
                old one when it fits without evicting anything — both held loaded —, else
                the name drained (new requests 503 + Retry-After, running ones finish on
                the old weights, old unloaded); the pointer switched (`rollout:<id>`).
    GATING      the gate (`fleet.device.rollout.health_gate`) on the new version: golden prompts
    as real             requests, served digest, tokens/s floor, TTFT ceiling, memory headroom,
                optional soak (the first N real requests without a server error). With
                a speed floor the prompts wait (up to 60 s) for the requests still
                running on the old version to end, and a speed below the floor is
                measured once more before it counts.
    ACTIVE      gate passed: the old version is let go (unloaded once idle).
    ROLLED_BACK gate failed (or the load failed, or an operator asked): committed first,
                then the pointer goes back to the previous digest at once — the old version
                is still loaded, so no request waits — and the new version stays installed
                for diagnosis; the failing check is named with its figure.

Requests already running when the pointer moves finish on the weights they started on
(the registry resolves the pointer per request), so a client sees no failed request.
Every attempt ends with one evidence row (`ledger.evidence`), also sent as `audit`.

A capacity release (a rollout with `config`) takes the same states on the version served,
its runtime staged instead of a new version: `fleet.device.rollout.capacity`.

Runs on the server's event loop; blocking work goes to threads. Must never import the
registry, the scheduler, the runtime or the request path's service (`ModelOps` and the
injected probe are the only ways to the models).
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import psutil

from edge_agent import __version__
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.errors import EdgeAgentError
from edge_agent.fleet.device.link.birth import llama_cpp_version
from edge_agent.fleet.device.link.overlay import MISSING, apply_patch, copy_keys, overlay_values
from edge_agent.fleet.device.rollout import capacity, health_gate
from edge_agent.fleet.device.rollout.health_gate import Check, GateReport, GateSpec, Probe
from edge_agent.fleet.device.rollout.store import Rollout, RolloutStore
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    GATING,
    ROLLED_BACK,
    STAGED,
)
from edge_agent.ledger.evidence import record_evidence, served_since
from edge_agent.names import ModelName

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 300.0
SETTLE_S = 60.0


class Move(Protocol):
    """The runner's committed, published transition (`RolloutManager._move`)."""

    def __call__(self, r: Rollout, to: str, *, reason: str | None = None,
                 details: Mapping[str, Any] | None = None, expect: str | None = None,
                 **fields: Any) -> Awaitable[Rollout]: ...


class RetryLater(Exception):
    """Nothing was switched and another attempt may work (the name stayed busy)."""

    def __init__(self, reason: str, details: Mapping[str, Any]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = dict(details)


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


class Activator:
    def __init__(self, settings: Settings, ops: ModelOps, store: RolloutStore, probe: Probe,
                 move: Move, emit: Callable[[Mapping[str, Any]], None], *,
                 clock: Callable[[], float] = time.time, poll_s: float = 1.0,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, settle_s: float = SETTLE_S,
                 hook: Callable[[str, Rollout], None] | None = None,
                 hardware: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.settings = settings
        self.ops = ops
        self.store = store
        self.probe = probe
        self.move = move
        self.emit = emit
        self.clock = clock
        self.poll_s = poll_s
        self.drain_timeout_s = drain_timeout_s
        self.settle_s = settle_s
        self.hook = hook
        self.hardware = hardware or hardware_summary

    @property
    def ledger_path(self) -> Path:
        return self.settings.state_dir / "ledger.db"

    async def run(self, r: Rollout, abort: Callable[[], bool]) -> Rollout:
        """STAGED → ACTIVATING → GATING → ACTIVE | ROLLED_BACK (or FAILED: RetryLater)."""
        spec = health_gate.parse_spec(((r.release or {}).get("manifest") or {}).get("gate"))
        target = r.target_digest
        assert target is not None
        if r.capacity is not None:
            return await self._run_capacity(r, spec, target, abort)
        previous = self.ops.active_digest(r.name)
        r = await self.move(r, ACTIVATING, expect=STAGED, previous_digest=previous)
        if previous == target:
            r = await self.move(r, ACTIVE, reason="already active")
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
                answers, _ = await health_gate.run_prompts(spec, r.name, self.probe)
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
                await self._wait_idle(r.name)
                if previous is not None:
                    await self.ops.unload(r.name, previous)
            if abort():
                checks.append(_requested())
            else:
                await asyncio.to_thread(self.ops.activate, r.name, target, by=by(r))
                self._tell("switched", r)
                if drained:  # by digest: the drain refuses requests for the name
                    await self.ops.load(r.name, digest=target)
        except RetryLater:
            self._let_go(r, held, drained)
            raise
        except Exception as exc:  # a bug must still end in a consistent pointer
            checks.append(_failed(r, exc, "activation"))
        finally:
            if drained:
                self.ops.drain(r.name, False)
        if checks:
            return await self._roll_back(r, checks, held)
        switched_at = self.clock()
        r = await self.move(r, GATING, expect=ACTIVATING)
        report = await self._gate(r, spec, baseline, switched_at, abort)
        if not report.passed:
            return await self._roll_back(r, report.checks, held)
        r = await self.move(r, ACTIVE, expect=GATING, gate={"checks": report.as_list()},
                            details={"checks": len(report.checks)})
        await self._release(r, held, keep=target)
        self.evidence(r, report.checks)
        return r

    # -- a capacity release ----------------------------------------------------------------
    async def _run_capacity(self, r: Rollout, spec: GateSpec, target: str,
                            abort: Callable[[], bool]) -> Rollout:
        """STAGED → ACTIVATING (baseline, staged runtime) → GATING → ACTIVE | ROLLED_BACK,
        on the version served (`capacity`'s docstring)."""
        change = r.capacity
        assert change is not None
        keys = capacity.overlay_changes(r.name, change)
        live = self.settings
        was = live.model_copy(deep=True)
        config = {"change": change, "before": capacity.effective(was, r.name),
                  "values_before": capacity.raw_values(was, keys),
                  "overlay_before": {k: v for k, v in
                                     overlay_values(live.state_dir, keys).items()
                                     if v is not MISSING}}
        previous = self.ops.active_digest(r.name)
        r = await self.move(r, ACTIVATING, expect=STAGED, previous_digest=previous,
                            config=config)
        checks: list[Check] = []
        if previous != target:
            checks.append(Check("serving_version", False, (previous or "none")[:12],
                                target[:12], "a capacity release is gated on the version "
                                "the box serves; this box serves another"))
            return await self._capacity_back(r, checks, was, keys, swapped=False)
        try:
            staged = capacity.staged_settings(was, r.name, change)
        except EdgeAgentError as exc:
            checks.append(Check("config", False, "invalid", None, exc.message[:200]))
            return await self._capacity_back(r, checks, was, keys, swapped=False)
        config["after"] = capacity.effective(staged, r.name)
        r = await asyncio.to_thread(self.store.update, r.id, config=config)
        if self.ops.loader is not None:  # the baseline: the serving runtime, as it is
            await self.ops.load(r.name)
        baseline = await capacity.replay(spec, r.name, self.probe)
        swapped = False
        try:
            if abort():
                checks.append(_requested())
            else:
                swapped = True
                await capacity.swap_runtime(
                    self.ops, r.name, target, self.wait_idle,
                    lambda: copy_keys(live, staged, keys))
                self._tell("switched", r)
        except RetryLater:
            if swapped:  # drained too long: nothing changed, the old settings stand
                copy_keys(live, was, keys)
            raise
        except Exception as exc:  # a bug must still end on the previous settings
            checks.append(_failed(r, exc, "staging the runtime"))
        if checks:
            return await self._capacity_back(r, checks, was, keys, swapped=swapped)
        switched_at = self.clock()
        r = await self.move(r, GATING, expect=ACTIVATING)
        report = await self._capacity_gate(r, spec, baseline, switched_at, abort)
        if not report.passed:
            return await self._capacity_back(r, report.checks, was, keys, swapped=True)
        await asyncio.to_thread(apply_patch, was, live.state_dir, keys, capacity=True,
                                texts=True)
        r = await self.move(r, ACTIVE, expect=GATING, gate={"checks": report.as_list()},
                            details={"checks": len(report.checks), "config": change})
        self.evidence(r, report.checks)
        return r

    async def _capacity_gate(self, r: Rollout, spec: GateSpec, baseline: capacity.Replay,
                             switched_at: float, abort: Callable[[], bool]) -> GateReport:
        assert r.target_digest is not None
        report = GateReport()
        report.checks.extend(_memory(spec))
        staged = await capacity.replay(spec, r.name, self.probe)
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
                again = await capacity.replay(spec, r.name, self.probe)
                better = capacity.compare_speed(spec, baseline, again)
                if sum(c.passed for c in better) > sum(c.passed for c in speed):
                    speed = better
            report.checks.extend(speed)
            burst = await capacity.replay(spec, r.name, self.probe, burst=True)
            report.checks.append(capacity.check_burst(burst, spec))
        if spec.ttft_ms_max is not None and staged.answers:
            report.checks.append(health_gate.check_ttft(list(staged.answers.values()),
                                                        spec.ttft_ms_max))
        if report.passed and spec.soak_requests and not abort():
            report.checks.append(await self._soak(r, spec, switched_at, abort))
        if abort():
            report.checks.append(_requested())
        return report

    async def _capacity_back(self, r: Rollout, checks: list[Check], was: Settings,
                             keys: Mapping[str, Any], *, swapped: bool) -> Rollout:
        """ROLLED_BACK committed, then the previous settings copied back and the model
        loaded with them again (the overlay never held the new ones)."""
        report = GateReport(list(checks))
        reason = report.reason() or "rolled back"
        r = await self.move(r, ROLLED_BACK, reason=reason,
                            details={"failed": [c.name for c in report.failed]},
                            gate={"checks": report.as_list()}, restored=False)
        if swapped:
            try:
                await capacity.swap_runtime(
                    self.ops, r.name, r.target_digest or "", self.wait_idle,
                    lambda: copy_keys(self.settings, was, keys))
            except Exception as exc:  # the settings are back; the next request loads
                copy_keys(self.settings, was, keys)
                log.error("rollout %s: loading %s again with its previous settings failed: "
                          "%s", r.id, r.name, exc)
        r = await asyncio.to_thread(self.store.update, r.id, restored=True)
        self.evidence(r, report.checks)
        return r

    def _template_check(self, name: ModelName, previous: str | None, target: str) -> Check:
        templates = {v.digest: v.model.chat_template
                     for v in self.ops.versions(name, missing_ok=True)}
        return health_gate.check_template(templates.get(previous) if previous else None,
                                          templates.get(target))

    async def _gate(self, r: Rollout, spec: GateSpec, baseline: float | None,
                    switched_at: float, abort: Callable[[], bool]) -> GateReport:
        assert r.target_digest is not None
        report = GateReport()
        report.checks.extend(_memory(spec))
        if spec.needs_baseline and r.previous_digest is not None:
            await self._settle(r.name, r.previous_digest)
        answers, checks = await health_gate.run_prompts(spec, r.name, self.probe)
        report.checks.extend(checks)
        if answers:
            report.checks.append(health_gate.check_served(answers, r.target_digest))
        if spec.tokens_per_s_floor is not None and answers:
            speed = health_gate.check_speed(health_gate.tokens_per_s(answers), baseline,
                                     spec.tokens_per_s_floor)
            if not speed.passed and not abort():
                # One more pass before a verdict on speed: a burst of the store's own
                # traffic must not roll a sound release back (the better pass counts).
                again, _ = await health_gate.run_prompts(spec, r.name, self.probe)
                best = max(health_gate.tokens_per_s(answers) or 0.0,
                           health_gate.tokens_per_s(again) or 0.0)
                speed = health_gate.check_speed(best or None, baseline, spec.tokens_per_s_floor)
            report.checks.append(speed)
        if spec.ttft_ms_max is not None and answers:
            report.checks.append(health_gate.check_ttft(answers, spec.ttft_ms_max))
        if report.passed and spec.soak_requests and not abort():
            report.checks.append(await self._soak(r, spec, switched_at, abort))
        if abort():
            report.checks.append(_requested())
        return report

    async def _soak(self, r: Rollout, spec: GateSpec, since: float,
                    abort: Callable[[], bool]) -> Check:
        """The first `soak_requests` real requests the new version answers (the ledger's
        rows; the gate's own requests have none) within `soak_within_s`: none may end in a
        server error (a 503 for a full queue is the box's load, not the release)."""
        assert r.target_digest is not None
        deadline = since + spec.soak_within_s
        rows: list[dict[str, Any]] = []
        while True:
            rows = await asyncio.to_thread(served_since, self.ledger_path, r.name,
                                           r.target_digest, since, spec.soak_requests)
            errors = sum(1 for row in rows if _server_error(row.get("status")))
            if errors or len(rows) >= spec.soak_requests or self.clock() >= deadline \
                    or abort():
                return health_gate.check_soak(errors, len(rows), spec.soak_requests,
                                       spec.soak_within_s)
            await asyncio.sleep(self.poll_s)

    async def _roll_back(self, r: Rollout, checks: list[Check], held: bool) -> Rollout:
        report = GateReport(list(checks))
        reason = report.reason() or "rolled back"
        failed = [c.name for c in report.failed]
        r = await self.move(r, ROLLED_BACK, reason=reason, details={"failed": failed},
                            gate={"checks": report.as_list()}, restored=False)
        try:
            r = await asyncio.to_thread(restore_pointer, self.ops, self.store, r)
        except EdgeAgentError as exc:  # left `restored = 0`: resume finishes it
            log.error("rollout %s: switching back failed: %s", r.id, exc.message)
        await self._release(r, held, keep=r.previous_digest)
        self.evidence(r, report.checks)
        return r

    async def _settle(self, name: ModelName, previous: str) -> None:
        """Before the speed is measured: the requests still running on the previous
        version (started before the switch) end first, up to `settle_s` — two versions
        decoding at once share the CPU, and the new one would look slower than it is."""
        deadline = self.clock() + self.settle_s
        while self.ops.busy(name, previous) > 0 and self.clock() < deadline:
            await asyncio.sleep(min(self.poll_s, 0.05))

    async def wait_idle(self, name: str) -> None:
        """Returns once no request holds `name` (RetryLater past the drain timeout)."""
        await self._wait_idle(ModelName.parse(name))

    async def _wait_idle(self, name: ModelName) -> None:
        deadline = self.clock() + self.drain_timeout_s
        while (busy := self.ops.busy(name)) > 0:
            if self.clock() >= deadline:
                raise RetryLater("drain_timeout", {"busy": busy,
                                                   "waited_s": self.drain_timeout_s})
            await asyncio.sleep(min(self.poll_s, 0.05))

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

    def _tell(self, event: str, r: Rollout) -> None:
        if self.hook is not None:
            self.hook(event, r)

    # -- evidence -----------------------------------------------------------------------------
    def evidence(self, r: Rollout, checks: list[Check]) -> None:
        row = evidence_row(r, checks, self.hardware(), self._parameters(r), self.clock())
        try:
            record_evidence(self.ledger_path, row)
        except Exception:  # the rollout's outcome stands; the audit message still goes
            log.exception("rollout %s: evidence row not written", r.id)
        self.emit({"event": "rollout.evidence", **row})

    def _parameters(self, r: Rollout) -> dict[str, Any]:
        """What the release runs with here: its default sampling parameters and the
        box's runtime plan for the name; for a capacity release, the change with the
        name's settings before and after it."""
        if r.config:
            return {"capacity": {"change": r.config.get("change"),
                                 "before": r.config.get("before"),
                                 "after": r.config.get("after")},
                    "quantization": ((r.release or {}).get("manifest") or {})
                    .get("quantization")}
        manifest = (r.release or {}).get("manifest") or {}
        rt = self.settings.runtime
        override = self.settings.model_override(r.name)
        trained = manifest.get("context_length")
        ctx = override.context_length or rt.context_length
        return {"defaults": manifest.get("parameters") or {},
                "quantization": manifest.get("quantization"),
                "context_length": min(ctx, trained) if isinstance(trained, int) else ctx,
                "parallel": override.parallel or rt.parallel,
                "threads": override.threads or rt.threads,
                "n_gpu_layers": override.n_gpu_layers if override.n_gpu_layers is not None
                else rt.n_gpu_layers}


def evidence_row(r: Rollout, checks: list[Check], hardware: Mapping[str, Any],
                 parameters: Mapping[str, Any], now: float) -> dict[str, Any]:
    timings = {k: round(v, 3) for k, v in r.timings.items()}
    return {"id": f"{r.id}/{r.attempts}", "ts": now, "rollout_id": r.id,
            "attempt": r.attempts, "name": r.name, "version": r.version,
            "digest": r.target_digest or "", "previous_digest": r.previous_digest or "",
            "outcome": r.state, "reason": r.reason or "",
            "agent_version": __version__,
            "llama_cpp_version": llama_cpp_version() or "unknown",
            "hardware": dict(hardware), "parameters": dict(parameters),
            "checks": [c.as_dict() for c in checks], "timings": timings}


def hardware_summary() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {"machine": platform.machine(), "system": f"{platform.system()} {platform.release()}",
            "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "cpu_cores": psutil.cpu_count(logical=False), "ram_bytes": vm.total,
            "ram_available_bytes": vm.available}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()[:120]
    except OSError:
        pass
    return platform.processor()[:120]



def _server_error(status: Any) -> bool:
    return isinstance(status, int) and status >= 500 and status != 503


def _failed(r: Rollout, exc: Exception, step: str) -> Check:
    """The check an exception during the switch becomes: an EdgeAgentError is the load's
    refusal (its message says why); anything else is a flaw, logged with its traceback."""
    if isinstance(exc, EdgeAgentError):
        return Check("load", False, type(exc).__name__, None, exc.message[:200])
    log.exception("rollout %s: %s failed", r.id, step)
    return Check("activation", False, type(exc).__name__, None, str(exc)[:200])


def _memory(spec: GateSpec) -> list[Check]:
    """The gate's memory headroom, where the release asks for one (either algorithm)."""
    if spec.memory_headroom_bytes is None:
        return []
    available = psutil.virtual_memory().available
    return [health_gate.check_memory(available, spec.memory_headroom_bytes)]


def _requested() -> Check:
    return Check("rollback_requested", False, "requested", None,
                 "an operator asked for a rollback")


def interrupted(state: str) -> str:
    """The reason of a rollout a restart found switching."""
    return "interrupted during gating" if state == GATING else "interrupted during activation"

