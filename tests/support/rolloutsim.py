"""Scripted boxes for the controller's rollout tests, on two transports:

    LinkFleet   the fleet simulator with a scripted `BoxRollouts` per device
                (`edge_agent.fleet.sim.rollout`, which `bench rollout` uses too): the
                100-box tests.
    SimFleet    a paho client per box (`SimBox`) with a persistent session the broker
                keeps while the box is offline: the offline and restart scenarios.

The outcomes (`active`, `slow`, `rolled_back`, `rejected`, `failed`, `busy`, `busy_once`,
`silent`) are `BoxRollouts`'.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.signing import load_public, verify
from edge_agent.fleet.sim.rollout import BoxRollouts
from edge_agent.fleet.sim.rollout import LinkFleet as _LinkFleet
from tests.support.brokers import FLEET, Mosquitto


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


class LinkFleet(_LinkFleet):
    """`fleet.sim.rollout.LinkFleet` on a test broker, with the test fleet's id."""

    def __init__(self, broker: Mosquitto, public_key: Path, devices: Iterable[str],
                 root: Path, *, outcomes: dict[str, str] | None = None,
                 step_s: float = 0.05, slow_step_s: float | None = None,
                 ack_timeout_s: float = 60.0) -> None:
        super().__init__(broker.url, fleet=FLEET, password_file=broker.password_file,
                         public_key=load_public(public_key), devices=devices, root=root,
                         outcomes=outcomes, step_s=step_s, slow_step_s=slow_step_s,
                         ack_timeout_s=ack_timeout_s)
