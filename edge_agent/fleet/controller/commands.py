"""Signed commands from the controller: build, sign, record, publish, collect the results.

A command is signed with the controller's ed25519 key (`fleet keygen`), carries a
per-stream sequence (`<fleet>/<device>` or `<fleet>/all`, kept by the store) and an expiry,
and is recorded before it is published, so `fleet send` and the read API agree on what
was sent. Results come back through the boxes' outboxes and the running `fleet serve`
ingest; this module only reads them from the store. It never executes anything itself.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.config.controller import ControllerSettings
from edge_agent.errors import InvalidRequest, NotFound, ServiceUnavailable
from edge_agent.fleet.controller.paho_thread import disconnect_and_stop
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.command import MAX_COMMAND_BYTES
from edge_agent.fleet.protocol.envelope import dumps
from edge_agent.fleet.protocol.ids import check_id
from edge_agent.fleet.protocol.signing import sign

ALL = topics.ALL
DEFAULT_TTL_S = 300.0


@dataclass(frozen=True)
class Sent:
    command: dict[str, Any]
    expected: list[str]  # devices whose result is awaited (online ones for `all`)


def stream(fleet: str, device: str) -> str:
    """The store's name for a command sequence: one per device, one for the whole fleet."""
    return f"{fleet}/{device}"


def build(store: ControllerStore, key: Ed25519PrivateKey, *, fleet: str, device: str,
          type_: str, args: Mapping[str, Any] | None = None, ttl_s: float = DEFAULT_TTL_S,
          clock: Callable[[], float] = time.time, seq: int | None = None) -> dict[str, Any]:
    """A signed command with the stream's next seq (taken, so never reused; `seq`: one
    the caller took already, `next_command_seqs` for many at once)."""
    check_id("fleet", fleet)
    if device != ALL:
        check_id("device", device)
    if ttl_s <= 0:
        raise InvalidRequest("a command's time to live must be positive", param="ttl")
    now = clock()
    command = {"v": 1, "id": uuid.uuid4().hex, "fleet": fleet, "device": device,
               "type": type_,
               "seq": store.next_command_seq(stream(fleet, device)) if seq is None else seq,
               "issued_at": round(now, 3), "expires_at": round(now + ttl_s, 3),
               "args": dict(args or {})}
    signed = sign(command, key)
    if len(dumps(signed)) > MAX_COMMAND_BYTES:
        raise InvalidRequest(f"the command is over {MAX_COMMAND_BYTES} bytes", param="args")
    return signed


def targets(store: ControllerStore, fleet: str, device: str) -> list[str]:
    """Whose results to wait for: the device, or every online device of the fleet."""
    if device != ALL:
        return [device]
    return sorted(d["device"] for d in store.devices()
                  if d.get("fleet") == fleet and d.get("online"))


class Publisher:
    """A connection of the controller's own for publishing commands (its own client id:
    the ingest's session is not disturbed), opened at the first `publish` and again after
    a loss. `publish` returns once the broker acknowledged each command (QoS 1 PUBACK) or
    raises ServiceUnavailable; `close` when done. One caller at a time."""

    def __init__(self, settings: ControllerSettings, *, timeout_s: float = 10.0,
                 client_id: str | None = None) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self.client_id = client_id or f"edge-fleet-send-{uuid.uuid4().hex[:8]}"
        self._client: mqtt.Client | None = None
        self._connected = threading.Event()

    def _connect(self) -> mqtt.Client:
        if self._client is not None and self._connected.is_set():
            return self._client
        self.close()
        broker = self.settings.broker
        address = broker.address
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=mqtt.MQTTv5)
        if broker.username:
            client.username_pw_set(broker.username, self.settings.broker_password())
        if address.tls:
            client.tls_set(ca_certs=str(broker.ca_file) if broker.ca_file else None,
                           certfile=str(broker.client_cert) if broker.client_cert else None,
                           keyfile=str(broker.client_key) if broker.client_key else None)
        client.max_inflight_messages_set(100)  # a wave's commands pipelined, not trickled
        answered = threading.Event()
        refused: list[str] = []
        connected = self._connected

        def on_connect(c: mqtt.Client, u: Any, flags: Any, reason: Any, props: Any) -> None:
            if reason.is_failure:
                refused.append(str(reason))
            else:
                connected.set()
            answered.set()

        def on_disconnect(c: mqtt.Client, u: Any, flags: Any, reason: Any,
                          props: Any) -> None:
            connected.clear()

        client.on_connect = on_connect
        client.on_disconnect = on_disconnect
        try:
            client.connect(address.host, address.port, keepalive=30)
        except OSError as exc:
            raise ServiceUnavailable(f"broker {broker.url} unreachable: {exc}") from None
        client.loop_start()
        self._client = client
        if not answered.wait(self.timeout_s) or refused:
            self.close()
            raise ServiceUnavailable(f"broker {broker.url} refused the controller: "
                                     f"{refused[0] if refused else 'no answer'}")
        return client

    def publish(self, commands: Sequence[Mapping[str, Any]]) -> None:
        """Each command on its topic (QoS 1); returns once the broker took them all."""
        if not commands:
            return
        client = self._connect()
        infos = [client.publish(topics.topic(str(c["fleet"]), str(c["device"]), topics.CMD),
                                dumps(dict(c)), qos=1) for c in commands]
        deadline = time.monotonic() + self.timeout_s
        for info in infos:
            try:
                info.wait_for_publish(max(0.0, deadline - time.monotonic()))
                done = info.is_published()
            except (RuntimeError, ValueError):  # paho: not connected (any more)
                done = False
            if not done:
                self.close()  # a fresh connection next time; the caller publishes again
                raise ServiceUnavailable(f"broker {self.settings.broker.url} did not "
                                         "acknowledge the command")

    def close(self) -> None:
        client, self._client = self._client, None
        self._connected.clear()
        if client is not None:
            disconnect_and_stop(client)


def publish(settings: ControllerSettings, command: Mapping[str, Any], *,
            timeout_s: float = 10.0) -> None:
    """One QoS 1 publish on the command's topic, with the controller's broker credentials
    and a connection of its own; returns once the broker has acknowledged it.
    ServiceUnavailable when the broker cannot be reached."""
    publisher = Publisher(settings, timeout_s=timeout_s)
    try:
        publisher.publish([command])
    finally:
        publisher.close()


def fleet_of(store: ControllerStore, device: str | None) -> str:
    """The fleet a device reported in (NotFound if it never did); for the whole fleet
    (None), the one fleet the store knows (InvalidRequest unless there is exactly one)."""
    if device is not None:
        row = store.device(device)
        if row is None:
            raise NotFound(f"device {device!r} has never reported to this controller")
        return str(row["fleet"])
    fleets = {str(d["fleet"]) for d in store.devices()}
    if len(fleets) != 1:
        raise InvalidRequest(f"--all needs --fleet (this controller knows {len(fleets)} "
                             "fleets)", param="fleet")
    return fleets.pop()


def send(settings: ControllerSettings, store: ControllerStore, key: Ed25519PrivateKey, *,
         fleet: str, device: str, type_: str, args: Mapping[str, Any] | None = None,
         ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> Sent:
    """Sign, record, publish. The results arrive later (see `wait`)."""
    if device != ALL and store.device(device) is None:
        raise NotFound(f"device {device!r} has never reported to this controller")
    command = build(store, key, fleet=fleet, device=device, type_=type_, args=args,
                    ttl_s=ttl_s, clock=clock)
    store.record_command(command, clock())
    publish(settings, command)
    return Sent(command, targets(store, fleet, device))


def wait(store: ControllerStore, sent: Sent, timeout_s: float, *, poll_s: float = 0.2,
         clock: Callable[[], float] = time.monotonic) -> list[dict[str, Any]]:
    """The results stored so far, once every expected device answered or at the timeout."""
    deadline = clock() + timeout_s
    while True:
        results = store.command_results(str(sent.command["id"]))
        if {r["device"] for r in results} >= set(sent.expected) or clock() >= deadline:
            return results
        time.sleep(poll_s)


@dataclass(frozen=True)
class CommandSender:
    """What `fleet send` needs of the controller, held by `fleet serve` for its API: the
    settings (broker, time to live) and the command key."""

    settings: ControllerSettings
    key: Ed25519PrivateKey

    def send(self, store: ControllerStore, *, fleet: str, device: str, type_: str,
             args: Mapping[str, Any] | None = None) -> Sent:
        return send(self.settings, store, self.key, fleet=fleet, device=device, type_=type_,
                    args=args, ttl_s=self.settings.command_ttl_s)
