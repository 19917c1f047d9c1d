"""Real servers for the fleet tests: a private Mosquitto and a private PostgreSQL.

`Mosquitto` is the package's `edge_agent.fleet.sim.testbed.Broker` (the bench runs it too): the
broker configuration `fleet broker-config` writes (passwd, acl, mosquitto.conf with
persistence in its own temp dir), as the current user, on a free port, optionally with a
TLS listener whose CA and server certificate are made with `cryptography`. It can be killed
with SIGKILL and started again on the same port and data dir (the outage tests).
`Postgres` is the testbed's too: `initdb` + `pg_ctl start` in a temp dir.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.fleet.sim.testbed import (
    MOSQUITTO_PATHS,
    Broker,
    LocalCA,
    Postgres,
    find_mosquitto,
    find_postgres_bin,
    free_port,
    make_tls,
    wait_port,
)

__all__ = ["DEVICES", "FLEET", "MOSQUITTO_PATHS", "MQTTClient", "Mosquitto", "Postgres",
           "TestCA", "find_mosquitto", "find_postgres_bin", "free_port", "make_tls",
           "wait_port"]

FLEET = "f1"
DEVICES = ("store-a", "store-b", "store-c", "store-d")
TestCA = LocalCA


@dataclass
class Mosquitto(Broker):
    """A private broker (`edge_agent.fleet.sim.testbed.Broker`) for fleet `f1` and the test
    devices unless told otherwise."""

    fleet: str = FLEET
    devices: tuple[str, ...] = DEVICES


# -- A plain paho client for tests (a device stand-in, an eavesdropper) ---------------------

class MQTTClient:
    """paho v2, MQTT 5, its own network thread; records what arrives and each PUBACK's
    reason code, so a test checks what was delivered rather than what was granted."""

    def __init__(self, broker: Mosquitto, user: str | None, *, password: str | None = None,
                 tls: bool = False, ca: Path | None = None, client_id: str | None = None,
                 client_cert: tuple[Path, Path] | None = None,
                 clean_start: bool = True, session_expiry: int = 0) -> None:
        import threading

        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.broker = broker
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2,
                                  client_id=client_id or f"test-{user}-{os.urandom(3).hex()}",
                                  protocol=mqtt.MQTTv5)
        if user is not None:
            self.client.username_pw_set(user, broker.password(user) if password is None
                                        else password)
        self.port = broker.tls_port if tls else broker.port
        if tls:
            self.client.tls_set(ca_certs=str(ca or (broker.ca.ca_cert if broker.ca else "")),
                                certfile=str(client_cert[0]) if client_cert else None,
                                keyfile=str(client_cert[1]) if client_cert else None)
        self.clean_start = clean_start
        self.session_expiry = session_expiry
        self.messages: list[tuple[str, bytes, bool]] = []
        self.puback: dict[int, int] = {}
        self.connack: Any = None
        self.cond = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.subacks: list[Any] = []

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        with self.cond:
            self.connack = reason
            self.cond.notify_all()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self.cond:
            self.messages.append((message.topic, bytes(message.payload), bool(message.retain)))
            self.cond.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any,
                    properties: Any) -> None:
        with self.cond:
            self.puback[mid] = int(reason.value)
            self.cond.notify_all()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any,
                      properties: Any) -> None:
        with self.cond:
            self.subacks.append(reasons)
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def connect(self, timeout: float = 10.0) -> Any:
        """The CONNACK's reason code (a failure too: check `.is_failure`)."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry
        self.client.connect("127.0.0.1" if self.port != self.broker.tls_port else "localhost",
                            self.port, keepalive=30, clean_start=self.clean_start,
                            properties=props)
        self.client.loop_start()
        if not self.wait(lambda: self.connack is not None, timeout):
            raise TimeoutError("no CONNACK")
        return self.connack

    def subscribe(self, *filters: str, timeout: float = 10.0) -> None:
        from paho.mqtt.subscribeoptions import SubscribeOptions

        before = len(self.subacks)
        self.client.subscribe([(f, SubscribeOptions(qos=1)) for f in filters])
        if not self.wait(lambda: len(self.subacks) > before, timeout):
            raise TimeoutError("no SUBACK")

    def publish(self, topic: str, payload: bytes | str, *, qos: int = 1, retain: bool = False,
                timeout: float = 10.0) -> int:
        """Publish and wait for the PUBACK; its reason code (0 ok, 16 no subscribers,
        135 not authorized)."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        if qos == 0:
            return 0
        if not self.wait(lambda: info.mid in self.puback, timeout):
            raise TimeoutError(f"no PUBACK for {topic}")
        return self.puback[info.mid]

    def received(self, prefix: str = "") -> list[tuple[str, bytes, bool]]:
        with self.cond:
            return [m for m in self.messages if m[0].startswith(prefix)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
