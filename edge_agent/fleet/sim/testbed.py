"""A private fleet on one machine, for the bench and the tests: a Mosquitto broker run from
the configuration `fleet broker-config` writes, and the controller (`fleet serve`) as a
subprocess, each on free loopback ports in a directory of the caller's.

`Broker` runs as the current user with its own passwd/ACL/conf and persistence in its own
data dir; it can be killed with SIGKILL and started again on the same port and data (the
outage scenarios), optionally with a TLS listener whose CA and server certificate are made
here. `ControllerProcess` is `python -m edge_agent fleet serve` with that broker's
controller credentials; its store is `<root>/controller.db`, read directly by the caller
once it has stopped. `Postgres` is `initdb` + `pg_ctl start` in a temp dir (unix socket
there too, trust auth, no fsync; as root it runs as the `postgres` user, since PostgreSQL
refuses to run as root), for two or more controllers on one store. `raise_nofile` lifts
this process's descriptor limit (children inherit it): a broker or a simulator of thousands
of devices needs one descriptor per connection.

Must never: touch a system broker, its files or port 1883; leave a process running after
`stop()`; import anything from tests/.
"""

from __future__ import annotations

import glob
import os
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from edge_agent.fleet.controller.broker import (
    BrokerPlan,
    TLSFiles,
    Uplink,
    write_broker_config,
)

MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in MOSQUITTO_PATHS if os.access(p, os.X_OK)), None)


def raise_nofile(want: int | None = None) -> int:
    """Raises RLIMIT_NOFILE's soft limit to `want` (default: as far as allowed — the hard
    limit, or for root the kernel's nr_open; never lowered); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if want is not None and want <= soft:
        return soft
    ceiling = hard
    if os.geteuid() == 0:  # root may raise the hard limit too, up to fs.nr_open
        try:
            ceiling = int(Path("/proc/sys/fs/nr_open").read_text().strip())
        except (OSError, ValueError):
            ceiling = hard
    target = ceiling if want is None else min(want, ceiling)
    if hard != resource.RLIM_INFINITY and target > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
            return target
        except (ValueError, OSError):
            target = hard
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.1
               ) -> bool:
    """Polls `predicate` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


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
class LocalCA:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls(folder: Path, hostname: str = "localhost") -> LocalCA:
    """A CA and a server certificate for `hostname` and 127.0.0.1 signed by it (PEM files,
    the key 0600): the fleet's own CA (`controller.pki`), living a day."""
    from edge_agent.fleet.controller.pki import FleetCA

    ca = FleetCA.init(folder, name="edge-agent test CA", days=1)
    ca.issue("server", "controller", dns=[hostname], ips=["127.0.0.1"], days=1)
    return LocalCA(ca.cert_file, folder / "server.pem", folder / "server.key")


# -- Mosquitto -----------------------------------------------------------------------------

@dataclass
class Broker:
    """A private broker; `start()`, `kill()` (SIGKILL), `start()` again: same port, same data."""

    root: Path
    fleet: str = "f1"
    devices: tuple[str, ...] = ()
    controller_user: str = "controller"
    tls: bool = False
    passwd_tool: bool = True  # False: the password hashes edge-agent computes itself
    port: int = field(default_factory=free_port)
    tls_port: int = 0
    ca: LocalCA | None = None
    proc: subprocess.Popen[bytes] | None = None
    # Connections and disconnections are `notice`: thousands of lines for a large fleet.
    log_types: tuple[str, ...] = ("error", "warning", "notice")
    autosave_interval: int = 1
    regions: tuple[tuple[str, tuple[str, ...]], ...] = ()  # the central one's bridged regions
    uplink: Uplink | None = None  # a region's: its bridge to the central one
    client_certs: bool = False  # TLS listener: every client shows a certificate of `ca`

    def __post_init__(self) -> None:
        binary = find_mosquitto()
        if binary is None:
            raise RuntimeError("mosquitto is not installed")
        self.binary = binary
        self.out = self.root / "broker"
        self.data = self.root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.started = False
        if self.tls:
            self.ca = make_tls(self.root / "tls")
            self.tls_port = free_port()
        self._configure()

    def _configure(self) -> None:
        tls = None if self.ca is None else TLSFiles(
            self.ca.server_cert, self.ca.server_key,
            self.ca.ca_cert if self.client_certs else None)
        self.plan = BrokerPlan(
            fleet=self.fleet, devices=self.devices, controller_user=self.controller_user,
            port=self.port, tls=tls, tls_bind="127.0.0.1", tls_port=self.tls_port,
            data_dir=self.data, autosave_interval=self.autosave_interval,
            regions=self.regions, uplink=self.uplink)
        self.files = write_broker_config(self.plan, self.out, use_tool=self.passwd_tool)
        # The generated file as it is, plus what a private run needs: stay the current user
        # (as root Mosquitto would switch to `mosquitto`, who cannot read a 0600 passwd)
        # and a log to show when something fails.
        extra = [f"log_dest file {self.root / 'mosquitto.log'}",
                 *(f"log_type {t}" for t in self.log_types)]
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

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, timeout: float = 15.0) -> Broker:
        """Start (again, after `kill()`: same port, same data). A first start whose port
        was taken meanwhile moves to free ports and rewrites the config."""
        for attempt in range(5):
            self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_port(self.port, timeout, self.proc)
                if self.tls_port:
                    wait_port(self.tls_port, timeout, self.proc)
                # Someone else may be the one answering on the port: a broker that could
                # not bind exits within milliseconds.
                time.sleep(0.2)
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mosquitto exited ({self.proc.returncode})")
                self.started = True
                return self
            except RuntimeError as exc:
                self.kill()
                if self.started or "in use" not in self.log() or attempt == 4:
                    raise RuntimeError(f"{exc}\n{self.log()}") from None
                self.port, self.tls_port = free_port(), free_port() if self.tls_port else 0
                self._configure()
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


# -- the controller ------------------------------------------------------------------------

class ControllerProcess:
    """`edge-agent fleet serve` against `broker`, state in `root`, /metrics on a free port."""

    def __init__(self, broker: Broker, root: Path, *, log_level: str = "warning",
                 db: str | None = None, shared_group: str | None = None,
                 client_id: str | None = None) -> None:
        self.broker = broker
        self.root = root
        # Two or more controllers: one PostgreSQL store, a shared subscription, an id each.
        self.db_url, self.shared_group, self.client_id = db, shared_group, client_id
        self.state_dir = root / "controller"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def db(self) -> Path:
        return self.state_dir / "controller.db"

    def start(self, timeout: float = 60.0) -> ControllerProcess:
        """Starts and waits until it is subscribed at the broker."""
        self._log = (self.root / "controller.log").open("ab")
        # A config file of its own: never /etc/edge-agent-fleet/controller.toml of this
        # machine. One the caller wrote there is kept as it is (the rollout bench's).
        config = self.root / "controller.toml"
        broker = [f'{key} = "{value}"' for key, value in (
            ("shared_group", self.shared_group), ("client_id", self.client_id))
            if value is not None]
        ours = ((f'db = "{self.db_url}"\n' if self.db_url else "")
                + ("[broker]\n" + "\n".join(broker) + "\n" if broker else ""))
        if config.exists() and config.read_text().strip():
            if ours:
                raise ValueError(f"{config} exists: db, shared_group and client_id go in it")
        else:
            config.write_text(ours)
        argv = [sys.executable, "-m", "edge_agent", "fleet", "serve", "--config", str(config),
                "--state-dir", str(self.state_dir), "--broker", self.broker.url,
                "--username", self.broker.controller_user,
                "--password-file", str(self.broker.password_file(self.broker.controller_user)),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", self.log_level]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.connected():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the controller did not connect:\n{self.output()}")
            time.sleep(0.1)
        return self

    def connected(self) -> bool:
        try:
            return self.metric("edge_fleet_broker_connected") == 1.0
        except (httpx.HTTPError, ValueError):
            return False

    def leads(self) -> bool:
        """Whether this controller runs the engine and retention (`/healthz`)."""
        try:
            body = httpx.get(f"{self.url}/healthz", timeout=5).json()
            return bool(body["controller"]["leader"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    def kill(self) -> None:
        """SIGKILL, the way a host dies: what it held unacknowledged goes to the others."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def metrics(self) -> dict[str, float]:
        """/metrics, every sample summed over its labels (name -> value)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
        return out

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def device(self, device: str) -> dict[str, Any]:
        """The read API's view of one device (`online`, `last_seen`, …); {} if unknown."""
        response = httpx.get(f"{self.url}/devices/{device}", timeout=30)
        found = response.json() if response.status_code == 200 else {}
        return found if isinstance(found, dict) else {}

    def output(self) -> str:
        path = self.root / "controller.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM: it commits and acknowledges what it holds, then exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


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
