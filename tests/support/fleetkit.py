"""What the fleet link's tests share: the real controller in-process (its ingest session and
a SQLite store), link settings for a test broker, signed commands, waiting.

The controller here is `edge_agent.fleet.controller.ingest.Ingest` as `fleet serve` runs
it (same client id, `clean_start=False`): stopping and starting it again resumes its
broker session, as a restarted controller does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.config import FleetSettings
from edge_agent.config.controller import (
    BrokerSettings,
    ControllerSettings,
    IngestSettings,
)
from edge_agent.fleet.controller.ingest import Ingest
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.device.link.link import LinkOptions
from edge_agent.fleet.protocol.signing import generate_keypair, load_private, sign
from edge_agent.fleet.sim import testbed
from tests.support.brokers import FLEET, Mosquitto, MQTTClient


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02) -> bool:
    return testbed.wait_until(predicate, timeout, interval)


def fast_options(**change: Any) -> LinkOptions:
    """Test timings: acks overdue after 3 s, a stop waits at most 2 s for the death."""
    values: dict[str, Any] = {"ack_timeout_s": 3.0, "death_wait_s": 2.0,
                              "connack_timeout_s": 5.0, "stable_s": 5.0,
                              "connect_timeout_s": 2.0}
    values.update(change)
    return LinkOptions(**values)


def fleet_settings(broker: Mosquitto, device: str, *, tls: bool = False,
                   **change: Any) -> FleetSettings:
    values: dict[str, Any] = {
        "enabled": True, "broker": broker.tls_url if tls else broker.url, "fleet_id": FLEET,
        "device_id": device, "username": device, "password_file": broker.password_file(device),
        "reconnect_min_s": 0.1, "reconnect_max_s": 0.5, "keepalive_s": 10}
    if tls:
        assert broker.ca is not None
        values["ca_file"] = broker.ca.ca_cert
    values.update(change)
    return FleetSettings(**values)


class Controller:
    """The real ingest and store; `start`/`stop` as often as a test needs."""

    def __init__(self, broker: Mosquitto, root: Path, *,
                 key: Ed25519PrivateKey | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.key = key  # signs the acks, as `fleet serve` with its command_signing_key_file
        self.settings = ControllerSettings(
            state_dir=root,
            broker=BrokerSettings(url=broker.url, username="controller",
                                  password_file=broker.password_file("controller")),
            ingest=IngestSettings(batch_wait_s=0.02))
        self.store = SQLiteStore(root / "controller.db")
        self.metrics = ControllerMetrics(self.store)
        self.ingest: Ingest | None = None

    def start(self) -> Controller:
        self.ingest = Ingest(self.settings, self.store, self.metrics, key=self.key)
        self.ingest.start()
        assert self.ingest.wait_connected(15), "the controller did not connect"
        return self

    def stop(self) -> None:
        if self.ingest is not None:
            self.ingest.stop()
            self.ingest = None

    def close(self) -> None:
        self.stop()
        self.store.close()

    def stored(self, device: str) -> dict[str, list[list[int]]]:
        return {boot: self.store.stored_ranges(device, boot) for boot in self.store.boots(device)}

    def gaps(self, device: str) -> dict[str, list[list[int]]]:
        return {boot: g for boot in self.store.boots(device)
                if (g := self.store.gaps(device, boot))}

    def count(self, device: str, kind: str | None = None) -> int:
        return len(self.store.messages(device, kind=kind, limit=10**7))


class Signer:
    """The controller's command key (a fresh pair per test) and its per-stream seqs."""

    def __init__(self, folder: Path) -> None:
        self.private_path, self.public_path = folder / "cmd.key", folder / "cmd.pub"
        generate_keypair(self.private_path, self.public_path)
        self.key: Ed25519PrivateKey = load_private(self.private_path)
        self._seq: dict[str, int] = {}

    def command(self, device: str, type_: str, args: dict[str, Any] | None = None, *,
                key: Ed25519PrivateKey | None = None, **change: Any) -> dict[str, Any]:
        self._seq[device] = self._seq.get(device, 0) + 1
        now = time.time()
        obj = {"v": 1, "id": uuid.uuid4().hex, "fleet": FLEET, "device": device,
               "type": type_, "seq": self._seq[device], "issued_at": now,
               "expires_at": now + 300, "args": args or {}}
        obj.update(change)
        return sign(obj, key or self.key)


def send(client: MQTTClient, command: dict[str, Any]) -> bytes:
    """Publishes a command as the controller does (QoS 1 on the device's cmd topic)."""
    payload = json.dumps(command).encode()
    reason = client.publish(f"edge/v1/{FLEET}/{command['device']}/cmd", payload)
    assert reason == 0, reason  # 16: nobody subscribed, the command went nowhere
    return payload


def statuses(client: MQTTClient, device: str) -> list[dict[str, Any]]:
    """Births and deaths seen on the device's status topic, in order (empty payloads, a
    cleared retained message, left out)."""
    return [json.loads(p) for t, p, _ in client.received(f"edge/v1/{FLEET}/{device}/status")
            if p]
