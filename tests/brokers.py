"""Real servers for the fleet tests: a private Mosquitto and a private PostgreSQL.

`Mosquitto` runs the broker configuration `fleet broker-config` writes (passwd, acl,
mosquitto.conf with persistence in its own temp dir), as the current user, on a free port,
optionally with a TLS listener whose CA and server certificate are made here with
`cryptography`. It can be killed with SIGKILL and started again on the same port and data
dir (the outage tests). `Postgres` is `initdb` + `pg_ctl start` in a temp dir (unix socket
there too, trust auth, no fsync); as root it runs as the `postgres` user, since PostgreSQL
refuses to run as root.
"""

from __future__ import annotations

import datetime
import glob
import ipaddress
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.fleet.controller.broker import BrokerPlan, TLSFiles, write_broker_config

MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto")
FLEET = "f1"
DEVICES = ("store-a", "store-b", "store-c", "store-d")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in MOSQUITTO_PATHS if os.access(p, os.X_OK)), None)


def wait_port(port: int, timeout: float, alive: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if alive is not None and alive.poll() is not None:
                raise RuntimeError(
                    f"server exited ({alive.returncode}) before port {port} opened") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port} after {timeout} s") from None
            time.sleep(0.02)


# -- TLS -----------------------------------------------------------------------------------

@dataclass
class TestCA:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls(folder: Path, hostname: str = "localhost") -> TestCA:
    """A CA and a server certificate for localhost / 127.0.0.1 signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge-agent test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName(hostname), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = TestCA(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    out.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.server_key.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    out.server_key.chmod(0o600)
    return out


# -- Mosquitto -----------------------------------------------------------------------------

@dataclass
class Mosquitto:
    """A private broker; `start()`, `kill()` (SIGKILL), `start()` again: same port, same data."""

    root: Path
    fleet: str = FLEET
    devices: tuple[str, ...] = DEVICES
    controller_user: str = "controller"
    tls: bool = False
    passwd_tool: bool = True  # False: the password hashes edge-agent computes itself
    port: int = field(default_factory=free_port)
    tls_port: int = 0
    ca: TestCA | None = None
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        binary = find_mosquitto()
        if binary is None:
            raise RuntimeError("mosquitto is not installed")
        self.binary = binary
        self.out = self.root / "broker"
        self.data = self.root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        tls = None
        if self.tls:
            self.ca = make_tls(self.root / "tls")
            self.tls_port = free_port()
            tls = TLSFiles(self.ca.server_cert, self.ca.server_key)
        self.plan = BrokerPlan(
            fleet=self.fleet, devices=self.devices, controller_user=self.controller_user,
            port=self.port, tls=tls, tls_bind="127.0.0.1", tls_port=self.tls_port,
            data_dir=self.data, autosave_interval=1)
        self.files = write_broker_config(self.plan, self.out, use_tool=self.passwd_tool)
        # The generated file as it is, plus what a test run needs: stay the current user
        # (as root Mosquitto would switch to `mosquitto`, who cannot read a 0600 passwd)
        # and a log to show when a test fails.
        extra = [f"log_dest file {self.root / 'mosquitto.log'}", "log_type error",
                 "log_type warning", "log_type notice"]
        if os.geteuid() == 0:
            extra.append(f"user {pwd.getpwuid(os.geteuid()).pw_name}")
        self.conf = self.root / "test-mosquitto.conf"
        self.conf.write_text(self.files.conf.read_text() + "\n" + "\n".join(extra) + "\n")

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        return f"mqtts://localhost:{self.tls_port}"

    def password(self, user: str) -> str:
        return self.files.credentials[user].read_text().strip()

    def password_file(self, user: str) -> Path:
        return self.files.credentials[user]

    def log(self) -> str:
        path = self.root / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 15.0) -> Mosquitto:
        self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(self.port, timeout, self.proc)
            if self.tls_port:
                wait_port(self.tls_port, timeout, self.proc)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{self.log()}") from None
        return self

    def kill(self) -> None:
        """SIGKILL: no autosave at exit; what persistence wrote before is all there is."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


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
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -F "
                   "-c synchronous_commit=off -c full_page_writes=off")
        done = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                         str(self.root / "postgres.log"), "-o", options, "-w", "-t", "60",
                         "start")
        if done.returncode:
            log = (self.root / "postgres.log")
            raise RuntimeError(f"pg_ctl start failed: {done.stderr or done.stdout}\n"
                               f"{log.read_text() if log.exists() else ''}")
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
