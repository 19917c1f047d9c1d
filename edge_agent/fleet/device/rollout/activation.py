"""A staged release's activation: what both kinds of release share, and the one door the
runner goes through.

A release is switched to and gated by one of two implementations of `Release`:
`model_release.ModelRelease` (a new version, loaded beside the old one or after a drain,
the pointer switched) and `capacity_release.CapacityRelease` (the runtime of the version
served, staged). Both take the same states — ACTIVATING, GATING, then ACTIVE or
ROLLED_BACK — through the same `Activation`, which holds what they share: the committed
moves, the gate's common checks (memory headroom, the soak of real requests, an operator's
rollback), the commit of ACTIVE and of ROLLED_BACK, draining and settling, and the evidence
row every attempt ends with (`ledger.evidence`, also sent as `audit`). The runner picks
the implementation by the rollout (`Activator.release`) to activate it, and to finish its
way back after a restart or an operator's rollback (`Release.restore`).

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
from edge_agent.fleet.device.rollout import health_gate
from edge_agent.fleet.device.rollout.health_gate import Check, GateReport, GateSpec, Probe
from edge_agent.fleet.device.rollout.store import Rollout, RolloutStore
from edge_agent.fleet.protocol.agent_release import is_agent_name
from edge_agent.fleet.protocol.rollout_states import ACTIVE, GATING, ROLLED_BACK
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


class Release(Protocol):
    """One kind of release's activation."""

    async def activate(self, r: Rollout, spec: GateSpec, abort: Callable[[], bool]
                       ) -> Rollout:
        """STAGED → ACTIVATING → GATING → ACTIVE | ROLLED_BACK (raises RetryLater when
        nothing was switched and another attempt may work)."""

    async def restore(self, r: Rollout) -> None:
        """Finishes the way back of a rollout committed ROLLED_BACK with `restored` 0;
        idempotent."""

    def evidence(self, r: Rollout, checks: list[Check]) -> None:
        """The attempt's evidence row, with what the release runs with here."""


class Activation:
    """What both implementations of `Release` share (see the module's docstring)."""

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

    # -- the gate's common checks ------------------------------------------------------------
    @staticmethod
    def gate_report(spec: GateSpec) -> GateReport:
        """A report opened with the memory headroom, where the release asks for one."""
        report = GateReport()
        if spec.memory_headroom_bytes is not None:
            report.checks.append(health_gate.check_memory(psutil.virtual_memory().available,
                                                          spec.memory_headroom_bytes))
        return report

    async def gate_end(self, r: Rollout, spec: GateSpec, report: GateReport,
                       switched_at: float, abort: Callable[[], bool]) -> GateReport:
        """The report closed with the soak (when everything else passed) and an
        operator's rollback."""
        if report.passed and spec.soak_requests and not abort():
            report.checks.append(await self._soak(r, spec, switched_at, abort))
        if abort():
            report.checks.append(requested())
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

    # -- the two ends ------------------------------------------------------------------------
    async def activated(self, r: Rollout, report: GateReport, **details: Any) -> Rollout:
        """GATING → ACTIVE committed, with the gate's checks."""
        return await self.move(r, ACTIVE, expect=GATING, gate={"checks": report.as_list()},
                               details={"checks": len(report.checks), **details})

    async def rolled_back(self, r: Rollout, checks: list[Check]) -> Rollout:
        """ROLLED_BACK committed (`restored` 0) with the failing checks named, before the
        release goes back."""
        report = GateReport(list(checks))
        return await self.move(r, ROLLED_BACK, reason=report.reason() or "rolled back",
                               details={"failed": [c.name for c in report.failed]},
                               gate={"checks": report.as_list()}, restored=False)

    # -- waiting for the name ----------------------------------------------------------------
    async def settle(self, name: ModelName, previous: str) -> None:
        """Before the speed is measured: the requests still running on the previous
        version (started before the switch) end first, up to `settle_s` — two versions
        decoding at once share the CPU, and the new one would look slower than it is."""
        deadline = self.clock() + self.settle_s
        while self.ops.busy(name, previous) > 0 and self.clock() < deadline:
            await asyncio.sleep(min(self.poll_s, 0.05))

    async def wait_idle(self, name: str | ModelName) -> None:
        """Returns once no request holds `name` (RetryLater past the drain timeout)."""
        key = name if isinstance(name, ModelName) else ModelName.parse(name)
        deadline = self.clock() + self.drain_timeout_s
        while (busy := self.ops.busy(key)) > 0:
            if self.clock() >= deadline:
                raise RetryLater("drain_timeout", {"busy": busy,
                                                   "waited_s": self.drain_timeout_s})
            await asyncio.sleep(min(self.poll_s, 0.05))

    def tell(self, event: str, r: Rollout) -> None:
        if self.hook is not None:
            self.hook(event, r)

    # -- evidence -----------------------------------------------------------------------------
    def evidence(self, r: Rollout, checks: list[Check], parameters: Mapping[str, Any]
                 ) -> None:
        row = evidence_row(r, checks, self.hardware(), parameters, self.clock())
        try:
            record_evidence(self.ledger_path, row)
        except Exception:  # the rollout's outcome stands; the audit message still goes
            log.exception("rollout %s: evidence row not written", r.id)
        self.emit({"event": "rollout.evidence", **row})


class Activator:
    """The runner's door: the two implementations over one `Activation`."""

    def __init__(self, act: Activation, model: Release, capacity: Release,
                 agent: Release | None = None) -> None:
        self.act = act
        self._model = model
        self._capacity = capacity
        self._agent = agent

    def release(self, r: Rollout) -> Release:
        """The implementation a rollout is activated and restored by (an agent release
        goes by its reserved name; a capacity release carries its change of runtime in
        `config`)."""
        if self._agent is not None and is_agent_name(r.name):
            return self._agent
        return self._capacity if r.config else self._model

    async def run(self, r: Rollout, abort: Callable[[], bool]) -> Rollout:
        spec = health_gate.parse_spec(((r.release or {}).get("manifest") or {}).get("gate"))
        assert r.target_digest is not None
        return await self.release(r).activate(r, spec, abort)


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


def failed(r: Rollout, exc: Exception, step: str) -> Check:
    """The check an exception during the switch becomes: an EdgeAgentError is the load's
    refusal (its message says why); anything else is a flaw, logged with its traceback."""
    if isinstance(exc, EdgeAgentError):
        return Check("load", False, type(exc).__name__, None, exc.message[:200])
    log.exception("rollout %s: %s failed", r.id, step)
    return Check("activation", False, type(exc).__name__, None, str(exc)[:200])


def requested() -> Check:
    return Check("rollback_requested", False, "requested", None,
                 "an operator asked for a rollback")


def interrupted(state: str) -> str:
    """The reason of a rollout a restart found switching."""
    return "interrupted during gating" if state == GATING else "interrupted during activation"

