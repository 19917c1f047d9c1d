"""Real servers for the fleet tests: a private Mosquitto and a private PostgreSQL.

`Mosquitto` is the package's `edge_agent.fleet.sim.testbed.Broker` (the bench runs it too): the
broker configuration `fleet broker-config` writes (passwd, acl, mosquitto.conf with
persistence in its own temp dir), as the current user, on a free port, optionally with a
TLS listener whose CA and server certificate are made with `cryptography`. It can be killed
with SIGKILL and started again on the same port and data dir (the outage tests).
`Postgres` is `initdb` + `pg_ctl start` in a temp dir (unix socket there too, trust auth,
no fsync); as root it runs as the `postgres` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.fleet.sim.testbed import (
    MOSQUITTO_PATHS,
    Broker,
    LocalCA,
    find_mosquitto,
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


# -- PostgreSQL ----------------------------------------------------------------------------

def find_postgres_bin() -> Path | None:
    """The folder holding initdb and pg_ctl: PATH, /usr/local/bin, then Debian's
    /usr/lib/postgresql/<version>/bin (newest first)."""
    found = shutil.which("initdb")
    candidates = [Path(found).parent] if found else []
    candidates.append(Path("/usr/local/bin"))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                           key=lambda p: int(Path(p).parent.name)
                                           if Path(p).parent.name.isdigit() else 0,
                                           reverse=True)]
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    return None


@dataclass
class Postgres:
    bindir: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="edge-pg-")))
    port: int = field(default_factory=free_port)
    superuser: str = "postgres"
    _user: str | None = None
    _made: int = 0

    def __post_init__(self) -> None:
        self.data = self.root / "data"
        if os.geteuid() == 0:  # PostgreSQL will not run as root
            self._user = next(u for u in ("postgres", "nobody") if _user_exists(u))
            info = pwd.getpwnam(self._user)
            os.chown(self.root, info.pw_uid, info.pw_gid)
        self.root.chmod(0o700)

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=120,
                              user=self._user, cwd=self.root, check=False)

    def start(self) -> Postgres:
        if not self.data.exists():
            done = self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust",
                             "-U", self.superuser, "-E", "UTF8", "--no-sync")
            if done.returncode:
                raise RuntimeError(f"initdb failed: {done.stderr or done.stdout}")
        log = self.root / "postgres.log"
        for attempt in range(5):
            options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -F "
                       "-c synchronous_commit=off -c full_page_writes=off")
            log.unlink(missing_ok=True)
            done = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                             str(log), "-o", options, "-w", "-t", "60", "start")
            if not done.returncode:
                return self
            text = log.read_text() if log.exists() else ""
            if "already in use" not in text or attempt == 4:
                raise RuntimeError(f"pg_ctl start failed: {done.stderr or done.stdout}\n{text}")
            self.port = free_port()  # taken between free_port() and the bind: another one
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.superuser}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        self._made += 1
        name = f"t{os.getpid()}_{self._made}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        return self.url(name)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


# -- A plain paho client for tests (a device stand-in, an eavesdropper) ---------------------

class MQTTClient:
    """paho v2, MQTT 5, its own network thread; records what arrives and each PUBACK's
    reason code, so a test checks what was delivered rather than what was granted."""

    def __init__(self, broker: Mosquitto, user: str | None, *, password: str | None = None,
                 tls: bool = False, ca: Path | None = None, client_id: str | None = None,
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
            self.client.tls_set(ca_certs=str(ca or (broker.ca.ca_cert if broker.ca else "")))
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
