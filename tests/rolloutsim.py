"""Scripted boxes for the controller's rollout tests: each a real MQTT client of its own
(its device user, a persistent session, its birth and death), taking signed rollout.*
commands and answering them the way a box does on the wire — a `cmd/result` and every
state transition as `rollout` audit envelopes — with an outcome chosen by the test.

A stand-in for the fleet simulator (`fleet.simulate`, not on this branch yet): what it
scripts is only what the controller can see. Outcomes:

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_agent.fleet.refusals import CommandRefused
from edge_agent.fleet.signing import load_public, verify
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


@dataclass
class SimBox:
    """One scripted box. `commands`: (monotonic time, type, args) of every command run;
    `states`: (monotonic time, rollout id, state) of every transition reported."""

    device: str
    broker: Mosquitto
    public_key: Path
    sched: Scheduler
    outcome: str = "active"
    step_s: float = 0.05
    commands: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    states: list[tuple[float, str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self.bdseq = 0
        self.key = load_public(self.public_key)
        self.rollouts: dict[str, str] = {}  # rollout id -> state
        self.aborts: set[str] = set()  # rollouts asked to roll back while switching
        self.seen: set[str] = set()
        self.lock = threading.RLock()
        self.connected = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sim-{self.device}",
                                  protocol=mqtt.MQTTv5)
        self.client.username_pw_set(self.device, self.broker.password(self.device))
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = lambda *a: self.connected.clear()
        self.first = True

    # -- the link -----------------------------------------------------------------------------
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

    def _topic(self, kind: str) -> str:
        return f"edge/v1/{FLEET}/{self.device}/{kind}"

    def _emit(self, kind: str, body: dict[str, Any]) -> None:
        with self.lock:
            self.seq += 1
            env = {"v": 1, "device": self.device, "boot_id": self.boot_id, "seq": self.seq,
                   "kind": kind, "class": "audit", "ts": time.time(),
                   "body": {**body, "ts": time.time()}}
        self.client.publish(self._topic(kind), json.dumps(env).encode(), qos=1)

    # -- commands -------------------------------------------------------------------------------
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
            self._result(command, "refused", exc.reason, None)
            return
        args = command.get("args", {})
        self.commands.append((time.monotonic(), command["type"], args))
        handler = {"rollout.start": self._start, "rollout.cancel": self._cancel,
                   "rollout.rollback": self._rollback}.get(command["type"])
        if handler is not None:
            handler(command, str(args.get("rollout_id")))

    def _result(self, command: dict[str, Any], status: str, reason: str | None,
                result: dict[str, Any] | None) -> None:
        self._emit("cmd/result", {"id": command["id"], "type": command["type"],
                                  "status": status, "reason": reason, "result": result})

    def _start(self, command: dict[str, Any], rid: str) -> None:
        if self.outcome == "silent":
            return
        if self.outcome == "busy":
            self._emit("rollout", {"event": "rollout.refused", "accepted": False,
                                   "refused": "busy", "rollout_id": rid,
                                   "live": {"rollout_id": "older", "state": "STAGED"}})
            self._result(command, "ok", None, {"accepted": False, "refused": "busy"})
            return
        self._move(rid, "RECEIVED")
        self._result(command, "ok", None, {"accepted": True, "rollout_id": rid})
        if self.outcome == "rejected":
            self.sched.at(self.step_s, lambda: self._move(rid, "REJECTED", "agent_too_old"))
            return
        path = list(PATH[1:])
        if self.outcome == "failed":
            steps: list[tuple[str, str | None, dict[str, Any]]] = [
                ("DOWNLOADING", None, {}), ("FAILED", "unreachable",
                                            {"failures": 1, "limit": 2}),
                ("RECEIVED", "retry 2", {}), ("DOWNLOADING", None, {}),
                ("FAILED", "unreachable", {"failures": 2, "limit": 2})]
        else:
            end = ("ROLLED_BACK", "gate check prompt:hello:contains failed") \
                if self.outcome == "rolled_back" else ("ACTIVE", None)
            steps = [(s, None, {}) for s in path] + [(end[0], end[1], {})]
        self._chain(rid, steps)

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

        self.sched.at(self.step_s * (5 if self.outcome == "slow" else 1), step)

    def _move(self, rid: str, to: str, reason: str | None = None,
              details: dict[str, Any] | None = None) -> None:
        with self.lock:
            was = self.rollouts.get(rid)
            self.rollouts[rid] = to
            self.states.append((time.monotonic(), rid, to))
        self._emit("rollout", {"event": "rollout.transition", "from": was, "to": to,
                               "rollout_id": rid, "name": "sim", "version": "2",
                               "state": to, "reason": reason, "details": details or {}})

    def _cancel(self, command: dict[str, Any], rid: str) -> None:
        with self.lock:
            state = self.rollouts.get(rid)
            if state in BEFORE_SWITCH:
                self._move(rid, "CANCELLED", "cancel requested")
                self._result(command, "ok", None, {"accepted": True})
                return
        self._result(command, "ok", None, {"accepted": False, "refused": (
            "activating" if state in ("ACTIVATING", "GATING") else "unknown")})

    def _rollback(self, command: dict[str, Any], rid: str) -> None:
        with self.lock:
            state = self.rollouts.get(rid)
            if state == "ACTIVE":
                self._move(rid, "ROLLED_BACK", "rollback requested")
            elif state in ("ACTIVATING", "GATING"):
                self.aborts.add(rid)
            elif state in BEFORE_SWITCH:
                self._move(rid, "CANCELLED", "cancel requested")
        self._result(command, "ok", None, {"accepted": state is not None})

    # -- what the test reads --------------------------------------------------------------
    def got(self, type_: str) -> list[float]:
        return [t for t, kind, _ in list(self.commands) if kind == type_]

    def state(self, rid: str) -> str | None:
        with self.lock:
            return self.rollouts.get(rid)

    def reached(self, rid: str, state: str) -> float | None:
        return next((t for t, r, s in list(self.states) if r == rid and s == state), None)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class SimFleet:
    """Boxes `<prefix>-000` …, connected in parallel; `outcomes` by device, else active."""

    def __init__(self, broker: Mosquitto, public_key: Path, devices: Iterable[str], *,
                 outcomes: dict[str, str] | None = None, step_s: float = 0.05) -> None:
        self.sched = Scheduler()
        self.boxes = {d: SimBox(d, broker, public_key, self.sched,
                                (outcomes or {}).get(d, "active"), step_s) for d in devices}

    def connect(self) -> SimFleet:
        threads = [threading.Thread(target=b.connect) for b in self.boxes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self

    def close(self) -> None:
        for box in self.boxes.values():
            box.close()
        self.sched.stop()

    def __getitem__(self, device: str) -> SimBox:
        return self.boxes[device]
