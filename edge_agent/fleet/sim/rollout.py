"""Scripted rollouts on simulated boxes: how a box answers rollout.start, rollout.cancel
and rollout.rollback (`BoxRollouts`: every state transition as a `rollout` audit message,
with an outcome chosen by the caller), and `LinkFleet`, the fleet simulator
(`fleet.sim.fleet`: the agent's own link code per device — its command gate checks
signature, seq and expiry, its outbox waits for the controller's acks — on one selector
loop) with a `BoxRollouts` per device. What the controller's wave tests and
`edge-agent bench rollout` drive rollouts against, without a model on any box.

Outcomes:

    active        RECEIVED … GATING → ACTIVE
    slow          the same, each step `slow_step_s` long (default five times step_s)
    rolled_back   … GATING → ROLLED_BACK (a gate check failed)
    rejected      RECEIVED → REJECTED (agent_too_old)
    failed        RECEIVED → DOWNLOADING → FAILED, retried once, FAILED for good
    busy          rollout.start refused (another rollout of the name is live), always
    busy_once     refused so the first time; the next rollout.start goes on as `active`
    silent        nothing at all (a box that lost its way: the device timeout)

An agent release (`rollout.start` of `protocol.agent_release.AGENT_NAME`) takes the same
path with the box's restart in it: at the switch the box goes away and comes back running
the new version (a new birth saying so, `restart(version)`); `rolled_back` comes back once
more on the version it ran, its starts spent ("started 3 time(s) without passing its
gate"), as the base entry of a real box puts it back.

Cancels and rollbacks follow the box's rules (`fleet.device.rollout.runner`): a cancel before the
switch, a rollback of an ACTIVE release, a rollback while switching fails the gate.
Must never: block the simulator's loop (steps run as its timers, scripts on its pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.fleet.device.link.core import LinkOptions
from edge_agent.fleet.protocol.agent_release import is_agent_name
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.envelope import AUDIT
from edge_agent.fleet.sim.device import SimDevice, default_facts
from edge_agent.fleet.sim.fleet import SimOptions, Simulator

Step = tuple[str, "str | None", dict[str, Any]] | Callable[[], None]
PATH = ("RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "ACTIVATING", "GATING")
BEFORE_SWITCH = {"RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "FAILED"}
FINAL = {"ACTIVE", "ROLLED_BACK", "REJECTED", "CANCELLED"}


class BoxRollouts:
    """One box's rollout behaviour, apart from how it talks: `emit(kind, body)` sends an
    audit message, `later(delay_s, fn)` runs a step later. `commands`: (monotonic time,
    type, args) of every rollout command run; `states`: (monotonic time, rollout id,
    state) of every transition reported."""

    def __init__(self, outcome: str, step_s: float, emit: Callable[[str, dict[str, Any]], Any],
                 later: Callable[[float, Callable[[], None]], None], *,
                 slow_step_s: float | None = None,
                 restart: Callable[[str | None], None] | None = None) -> None:
        """`restart(version)`: the box restarts into agent `version` (None: the one it
        ran before the switch)."""
        self.outcome = outcome
        self.step_s = (5 * step_s if slow_step_s is None else slow_step_s) \
            if outcome == "slow" else step_s
        self.emit = emit
        self.later = later
        self.commands: list[tuple[float, str, dict[str, Any]]] = []
        self.states: list[tuple[float, str, str]] = []
        self.rollouts: dict[str, str] = {}  # rollout id -> state
        self.aborts: set[str] = set()  # rollouts asked to roll back while switching
        self.restart = restart
        self.lock = threading.RLock()

    def command(self, type_: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """The command's result (status ok), or None where a silent box says nothing."""
        self.commands.append((time.monotonic(), type_, dict(args)))
        rid = str(args.get("rollout_id"))
        if type_ == "rollout.start":
            return self._start(rid, str(args.get("name")), str(args.get("version")))
        if type_ == "rollout.cancel":
            return self._cancel(rid)
        if type_ == "rollout.rollback":
            return self._rollback(rid)
        return None

    def _start(self, rid: str, name: str = "", version: str = "") -> dict[str, Any] | None:
        if self.outcome == "silent":
            return None
        if self.outcome == "busy" or (self.outcome == "busy_once" and not any(
                t == "rollout.start" for _, t, _ in self.commands[:-1])):
            self.emit("rollout", {"event": "rollout.refused", "accepted": False,
                                  "refused": "busy", "rollout_id": rid,
                                  "live": {"rollout_id": "older", "state": "STAGED"}})
            return {"accepted": False, "refused": "busy"}
        self._move(rid, "RECEIVED")
        if self.outcome == "rejected":
            self._chain(rid, [("REJECTED", "agent_too_old", {})])
        elif self.outcome == "failed":
            self._chain(rid, [("DOWNLOADING", None, {}),
                              ("FAILED", "unreachable", {"failures": 1, "limit": 2}),
                              ("RECEIVED", "retry 2", {}), ("DOWNLOADING", None, {}),
                              ("FAILED", "unreachable", {"failures": 2, "limit": 2})])
        elif is_agent_name(name) and self.restart is not None:
            restart = self.restart
            steps: list[Step] = [(s, None, {}) for s in PATH[1:5]]
            steps.append(lambda: restart(version))
            if self.outcome == "rolled_back":  # the new version never passes its gate
                steps += [lambda: restart(None),
                          ("ROLLED_BACK", f"{version} started 3 time(s) without passing its "
                           "gate (fleet.agent_max_boots)", {})]
            else:
                steps += [("GATING", None, {}), ("ACTIVE", None, {})]
            self._chain(rid, steps)
        else:
            end = ("ROLLED_BACK", "gate check prompt:hello:contains failed") \
                if self.outcome == "rolled_back" else ("ACTIVE", None)
            self._chain(rid, [(s, None, {}) for s in PATH[1:]] + [(end[0], end[1], {})])
        return {"accepted": True, "rollout_id": rid}

    def _chain(self, rid: str, steps: Sequence[Step]) -> None:
        if not steps:
            return
        first, rest = steps[0], steps[1:]
        if callable(first):  # the box's restart: no transition of its own
            def act() -> None:
                if self.rollouts.get(rid) not in FINAL:
                    first()
                self._chain(rid, rest)

            self.later(self.step_s, act)
            return
        state, reason, details = first

        def step() -> None:
            with self.lock:
                current = self.rollouts.get(rid)
                if current in FINAL:
                    return  # cancelled or rolled back meanwhile
                if rid in self.aborts and current in ("ACTIVATING", "GATING"):
                    self._move(rid, "ROLLED_BACK", "gate check rollback_requested failed")
                    return
                self._move(rid, state, reason, details)
            self._chain(rid, rest)

        self.later(self.step_s, step)

    def _move(self, rid: str, to: str, reason: str | None = None,
              details: dict[str, Any] | None = None) -> None:
        with self.lock:
            was = self.rollouts.get(rid)
            self.rollouts[rid] = to
            self.states.append((time.monotonic(), rid, to))
        self.emit("rollout", {"event": "rollout.transition", "from": was, "to": to,
                              "rollout_id": rid, "name": "sim", "version": "2", "state": to,
                              "reason": reason, "details": details or {}})

    def _cancel(self, rid: str) -> dict[str, Any]:
        with self.lock:
            state = self.rollouts.get(rid)
            if state in BEFORE_SWITCH:
                self._move(rid, "CANCELLED", "cancel requested")
                return {"accepted": True}
        return {"accepted": False, "refused": (
            "activating" if state in ("ACTIVATING", "GATING") else "unknown")}

    def _rollback(self, rid: str) -> dict[str, Any]:
        with self.lock:
            state = self.rollouts.get(rid)
            if state == "ACTIVE":
                self._move(rid, "ROLLED_BACK", "rollback requested")
            elif state in ("ACTIVATING", "GATING"):
                self.aborts.add(rid)
            elif state in BEFORE_SWITCH:
                self._move(rid, "CANCELLED", "cancel requested")
        return {"accepted": state is not None}

    # -- what the test reads --------------------------------------------------------------
    def got(self, type_: str) -> list[float]:
        return [t for t, kind, _ in list(self.commands) if kind == type_]

    def state(self, rid: str) -> str | None:
        with self.lock:
            return self.rollouts.get(rid)

    def reached(self, rid: str, state: str) -> float | None:
        return next((t for t, r, s in list(self.states) if r == rid and s == state), None)


class LinkFleet:
    """The fleet simulator (`fleet.sim.fleet`: the agent's own link code per device — its
    command gate, outbox and acks — on one selector loop), each device's rollout commands
    scripted by a `BoxRollouts`. A silent box's gate still answers its command (accepted);
    the box then never reports."""

    def __init__(self, broker_url: str, *, fleet: str, password_file: Callable[[str], Path],
                 public_key: Ed25519PublicKey, devices: Iterable[str], root: Path,
                 outcomes: dict[str, str] | None = None, step_s: float = 0.05,
                 slow_step_s: float | None = None, ack_timeout_s: float = 60.0,
                 agent_version: str = "sim", restart_s: float = 0.5) -> None:
        """`agent_version`: what every box runs at first (its births say it; an agent
        release changes it, `BoxRollouts`); `restart_s`: how long a box is away when it
        restarts."""
        names = list(devices)
        self.versions = dict.fromkeys(names, agent_version)
        self.restart_s = restart_s
        self.sim = Simulator(broker_url, fleet=fleet, devices=names,
                             password_file=password_file, root=root,
                             script=self._script, public_key=public_key, facts=self._facts,
                             options=SimOptions(reconnect_min_s=0.2, reconnect_max_s=1.0,
                                                sweep_s=2.0, stop_wait_s=3.0,
                                                link=LinkOptions(ack_timeout_s=ack_timeout_s)))
        self.boxes = {d: BoxRollouts((outcomes or {}).get(d, "active"), step_s,
                                     self._emitter(self.sim.devices[d]), self.sim.call_later,
                                     slow_step_s=slow_step_s, restart=self._restarter(d))
                      for d in names}

    def _facts(self, device: SimDevice) -> dict[str, Any]:
        return {**default_facts(device), "agent_version": self.versions[device.device]}

    def _restarter(self, device: str) -> Callable[[str | None], None]:
        """The box's restart into an agent version (None: back to the one before)."""
        before: list[str] = []

        def restart(version: str | None) -> None:
            if version is not None:
                before[:] = [self.versions[device]]
                self.versions[device] = version
            elif before:
                self.versions[device] = before[0]
            self.sim.take_offline(device)
            self.sim.call_later(self.restart_s, lambda: self.sim.bring_online(device))

        return restart

    @staticmethod
    def _emitter(device: SimDevice) -> Callable[[str, dict[str, Any]], Any]:
        return lambda kind, body: device.emit(kind, AUDIT, {**body, "ts": time.time()})

    def _script(self, device: SimDevice, command: Command) -> Mapping[str, Any]:
        result = self.boxes[device.device].command(command.type, command.args)
        return result if result is not None else {"accepted": True}

    def connect(self, timeout: float = 60.0) -> LinkFleet:
        self.sim.start()
        if not self.sim.wait_connected(timeout):
            raise TimeoutError(f"{self.sim.connected()} of {len(self.boxes)} connected")
        return self

    def close(self) -> None:
        self.sim.stop()

    def __getitem__(self, device: str) -> BoxRollouts:
        return self.boxes[device]
