"""Scripted boxes for the controller's rollout tests: how a box answers rollout.start,
rollout.cancel and rollout.rollback (`BoxRollouts`: a `cmd/result` and every state
transition as `rollout` audit messages, with an outcome chosen by the test), on two
transports:

    LinkFleet   the fleet simulator (`fleet.simulate`): the agent's own link code per
                device on one selector loop — its command gate checks signature, seq and
                expiry, its outbox waits for the controller's acks. The 100-box tests.
    SimFleet    a paho client per box (`SimBox`) with a persistent session the broker
                keeps while the box is offline: the offline and restart scenarios.

Outcomes:

    active        RECEIVED … GATING → ACTIVE
    slow          the same, each step five times slower
    rolled_back   … GATING → ROLLED_BACK (a gate check failed)
    rejected      RECEIVED → REJECTED (agent_too_old)
    failed        RECEIVED → DOWNLOADING → FAILED, retried once, FAILED for good
    busy          rollout.start refused (another rollout of the name is live)
    silent        nothing at all (a box that lost its way: the device timeout)

Cancels and rollbacks follow the box's rules (`fleet.rollout`): a cancel before the
switch, a rollback of an ACTIVE release, a rollback while switching fails the gate.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_agent.fleet.commands import Command
from edge_agent.fleet.envelope import AUDIT
from edge_agent.fleet.refusals import CommandRefused
from edge_agent.fleet.signing import load_public, verify
from edge_agent.fleet.simdevice import SimDevice
from edge_agent.fleet.simulate import SimOptions, Simulator
from tests.brokers import FLEET, Mosquitto

PATH = ("RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "ACTIVATING", "GATING")
BEFORE_SWITCH = {"RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "FAILED"}
FINAL = {"ACTIVE", "ROLLED_BACK", "REJECTED", "CANCELLED"}


class Scheduler:
    """One thread running every device's timed steps, in time order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._count = itertools.count()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="sim-scheduler", daemon=True)
        self._thread.start()

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._count), fn))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._heap
                                          or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            fn()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(5)


class BoxRollouts:
    """One box's rollout behaviour, apart from how it talks: `emit(kind, body)` sends an
    audit message, `later(delay_s, fn)` runs a step later. `commands`: (monotonic time,
    type, args) of every rollout command run; `states`: (monotonic time, rollout id,
    state) of every transition reported."""

    def __init__(self, outcome: str, step_s: float, emit: Callable[[str, dict[str, Any]], Any],
                 later: Callable[[float, Callable[[], None]], None]) -> None:
        self.outcome = outcome
        self.step_s = step_s * (5 if outcome == "slow" else 1)
        self.emit = emit
        self.later = later
        self.commands: list[tuple[float, str, dict[str, Any]]] = []
        self.states: list[tuple[float, str, str]] = []
        self.rollouts: dict[str, str] = {}  # rollout id -> state
        self.aborts: set[str] = set()  # rollouts asked to roll back while switching
        self.lock = threading.RLock()

    def command(self, type_: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """The command's result (status ok), or None where a silent box says nothing."""
        self.commands.append((time.monotonic(), type_, dict(args)))
        rid = str(args.get("rollout_id"))
        if type_ == "rollout.start":
            return self._start(rid)
        if type_ == "rollout.cancel":
            return self._cancel(rid)
        if type_ == "rollout.rollback":
            return self._rollback(rid)
        return None

    def _start(self, rid: str) -> dict[str, Any] | None:
        if self.outcome == "silent":
            return None
        if self.outcome == "busy":
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
        else:
            end = ("ROLLED_BACK", "gate check prompt:hello:contains failed") \
                if self.outcome == "rolled_back" else ("ACTIVE", None)
            self._chain(rid, [(s, None, {}) for s in PATH[1:]] + [(end[0], end[1], {})])
        return {"accepted": True, "rollout_id": rid}

    def _chain(self, rid: str, steps: list[tuple[str, str | None, dict[str, Any]]]) -> None:
        if not steps:
            return
        (state, reason, details), rest = steps[0], steps[1:]

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


class SimBox(BoxRollouts):
    """A scripted box with an MQTT client of its own (paho's thread), whose session the
    broker keeps while it is offline: the offline and restart scenarios."""

    def __init__(self, device: str, broker: Mosquitto, public_key: Path, sched: Scheduler,
                 outcome: str = "active", step_s: float = 0.05) -> None:
        super().__init__(outcome, step_s, self._emit, sched.at)
        self.device, self.broker = device, broker
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self.bdseq = 0
        self.key = load_public(public_key)
        self.seen: set[str] = set()
        self.connected = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sim-{device}",
                                  protocol=mqtt.MQTTv5)
        self.client.username_pw_set(device, broker.password(device))
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = lambda *a: self.connected.clear()
        self.first = True

    def _status(self, type_: str) -> bytes:
        return json.dumps({"v": 1, "type": type_, "device": self.device, "fleet": FLEET,
                           "boot_id": self.boot_id, "bdseq": self.bdseq, "ts": time.time(),
                           "agent_version": "sim", "models": []}).encode()

    def connect(self) -> None:
        """Connect (the first time with a fresh session, later resuming it: commands sent
        while offline arrive now); returns once subscribed and born."""
        self.bdseq += 1
        self.client.will_set(self._topic("status"), self._status("death"), qos=1, retain=True)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", self.broker.port, keepalive=30,
                            clean_start=self.first, properties=props)
        self.first = False
        self.client.loop_start()
        if not self.connected.wait(20):
            raise TimeoutError(f"{self.device} did not connect")

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        if reason.is_failure:
            return
        client.subscribe(self._topic("cmd"), qos=1)
        client.publish(self._topic("status"), self._status("birth"), qos=1, retain=True)
        self.connected.set()

    def disconnect(self) -> None:
        """Offline, with the death published first; the broker keeps the session."""
        self.client.publish(self._topic("status"), self._status("death"), qos=1,
                            retain=True).wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()
        self.connected.clear()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _topic(self, kind: str) -> str:
        return f"edge/v1/{FLEET}/{self.device}/{kind}"

    def _emit(self, kind: str, body: dict[str, Any]) -> None:
        with self.lock:
            self.seq += 1
            env = {"v": 1, "device": self.device, "boot_id": self.boot_id, "seq": self.seq,
                   "kind": kind, "class": "audit", "ts": time.time(),
                   "body": {**body, "ts": time.time()}}
        self.client.publish(self._topic(kind), json.dumps(env).encode(), qos=1)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: Any) -> None:
        command = json.loads(message.payload)
        with self.lock:
            if command.get("id") in self.seen:
                return
            self.seen.add(command.get("id"))
        try:
            verify(command, self.key)
            if command["expires_at"] < time.time():
                raise CommandRefused("expired", "expired")
        except CommandRefused as exc:
            self._emit("cmd/result", {"id": command["id"], "type": command["type"],
                                      "status": "refused", "reason": exc.reason,
                                      "result": None})
            return
        result = self.command(command["type"], command.get("args", {}))
        if result is not None:
            self._emit("cmd/result", {"id": command["id"], "type": command["type"],
                                      "status": "ok", "reason": None, "result": result})


class SimFleet:
    """`SimBox`es `sim-000` …, each connected once (so each has its broker session)."""

    def __init__(self, broker: Mosquitto, public_key: Path, devices: Iterable[str], *,
                 outcomes: dict[str, str] | None = None, step_s: float = 0.05) -> None:
        self.sched = Scheduler()
        self.boxes = {d: SimBox(d, broker, public_key, self.sched,
                                (outcomes or {}).get(d, "active"), step_s) for d in devices}

    def connect(self) -> SimFleet:
        for box in self.boxes.values():
            box.connect()
        return self

    def close(self) -> None:
        for box in self.boxes.values():
            box.close()
        self.sched.stop()

    def __getitem__(self, device: str) -> SimBox:
        return self.boxes[device]


class LinkFleet:
    """The fleet simulator (`fleet.simulate`: the agent's own link code per device — its
    command gate, outbox and acks — on one selector loop), each device's rollout commands
    scripted by a `BoxRollouts`. A silent box's gate still answers its command (accepted);
    the box then never reports."""

    def __init__(self, broker: Mosquitto, public_key: Path, devices: Iterable[str],
                 root: Path, *, outcomes: dict[str, str] | None = None,
                 step_s: float = 0.05) -> None:
        names = list(devices)
        self.sim = Simulator(broker.url, fleet=FLEET, devices=names,
                             password_file=broker.password_file, root=root,
                             script=self._script, public_key=load_public(public_key),
                             options=SimOptions(reconnect_min_s=0.2, reconnect_max_s=1.0,
                                                sweep_s=2.0, stop_wait_s=3.0))
        self.boxes = {d: BoxRollouts((outcomes or {}).get(d, "active"), step_s,
                                     self._emitter(self.sim.devices[d]), self.sim.call_later)
                      for d in names}

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
