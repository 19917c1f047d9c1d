"""Provisioning a Mosquitto broker for a fleet: `passwd`, `acl`, `mosquitto.conf`, and one
credentials file per device (what `edge-agent fleet broker-config` writes).

The devices file is plain text: one device id per line; blank lines and `#` comments are
ignored. Every id goes through `ids.check_id`; one bad or repeated id refuses the whole run
(naming its line), since a half-written ACL is worse than none.

The ACL gives each device explicit `topic` lines under its own `user` block — write on the
kinds a device sends (`topics.DEVICE_KINDS`: status and the outbox's kinds), read on the
kinds the controller sends it (`topics.CONTROLLER_KINDS`: its `ack` and `cmd`) and on
`edge/v1/{fleet}/all/cmd` — and the controller user `edge/v1/#`. A device can never publish
an ack or a command, not even on its own topics: a second client logged in with a box's
credentials could otherwise make that box delete outbox rows no controller stored.
Explicit lines rather than `pattern … %u`: a user added to the password file by hand with a
`/` in its name would reach into another device's tree through `%u`; with explicit lines a
user the ACL does not name can do nothing.

Passwords: generated (URL-safe random) unless `credentials/<user>.txt` already holds one,
so re-running after adding a device does not change everyone's password (delete a file to
rotate it). Hashed with `mosquitto_passwd -U` when it is installed, else in the same
PBKDF2-SHA512 `$7$` format Mosquitto 2 writes.

Past one broker, a region's broker is bridged to the central one. The central broker's
plan names each region (`regions`: its bridge user and the region's devices): the bridge
user may write the device kinds and read the controller kinds of exactly those devices,
and the fleet's `all/cmd` — the same rights as its boxes together, never more, so nothing
through a bridge can publish another region's topics or an ack. The region's plan names its
`uplink` (the central broker, the bridge user and its password): its `mosquitto.conf` gets
the bridge (MQTT 3.1.1 with `cleansession false`: each side queues for the other while
the uplink is down), forwarding the device kinds out and the controller kinds in. Its boxes connect
to it with the same per-device ACL; a box that moves region needs only its broker URL
changed (and its password, which each broker keeps). Every file is written atomically; the
password file and the credentials are mode 0600 when first written, and a re-run keeps the
owner, group and mode of `passwd`, `acl` and `mosquitto.conf` as it finds them (the broker's
user must go on reading them). This module never starts a broker.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from edge_agent.config import ConfigError
from edge_agent.files import atomic_write
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.ids import check_id

# Mosquitto 2's password hash: PBKDF2-SHA512, 101 iterations, 12-byte salt, 64-byte key.
HASH_ITERATIONS = 101
SECRET_MODE = 0o600
PUBLIC_MODE = 0o644
PASSWD, ACL, CONF, CREDENTIALS = "passwd", "acl", "mosquitto.conf", "credentials"


@dataclass(frozen=True)
class TLSFiles:
    cert: Path
    key: Path
    ca: Path | None = None  # for client certificates; unset: passwords only


@dataclass(frozen=True)
class Uplink:
    """A region's bridge to the central broker."""

    host: str
    port: int
    user: str  # its user on the central broker (a `regions` entry there)
    password: str
    tls: bool = False
    ca: Path | None = None  # the central broker's CA for mqtts:// (unset: the system's)


@dataclass(frozen=True)
class BrokerPlan:
    """What the broker serves: one fleet, its devices and the controller's user."""

    fleet: str
    devices: tuple[str, ...]
    controller_user: str = "controller"
    bind: str = "127.0.0.1"  # the plain listener: loopback unless asked (passwords in clear)
    port: int = 1883
    tls: TLSFiles | None = None
    tls_bind: str = ""  # "" = every address
    tls_port: int = 8883
    data_dir: Path = Path("/var/lib/mosquitto")
    autosave_interval: int = 60
    # The controller's queue while it restarts: Mosquitto's default (1000) drops the rest.
    max_queued_messages: int = 100_000
    # QoS 1 messages in flight per client, and the Receive Maximum the broker announces to
    # MQTT 5 clients: a box's link keeps its window under it (Mosquitto's default is 20,
    # which caps a backlog's drain at one round trip per 20 messages).
    max_inflight_messages: int = 1000
    conf_dir: Path | None = None  # where passwd/acl will be on the broker host; default out
    # The central broker's bridged regions: (bridge user, the region's devices).
    regions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    uplink: Uplink | None = None  # a region's broker: its bridge to the central one

    def users(self) -> tuple[str, ...]:
        return (*self.devices, self.controller_user, *(user for user, _ in self.regions))


@dataclass
class BrokerFiles:
    out: Path
    passwd: Path
    acl: Path
    conf: Path
    credentials: dict[str, Path] = field(default_factory=dict)
    new_passwords: list[str] = field(default_factory=list)  # users whose password is new


def read_devices(path: Path) -> tuple[str, ...]:
    """The device ids of a devices file; ConfigError naming the line of the first bad one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the devices file {path}: {exc}") from exc
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        value = raw.split("#", 1)[0].strip()
        if not value:
            continue
        try:
            check_id("device", value)
        except ValueError as exc:
            raise ConfigError(f"{path}:{number}: {exc}; nothing was written") from None
        if value in seen:
            raise ConfigError(f"{path}:{number}: device id {value!r} repeats line "
                              f"{seen[value]}; nothing was written")
        seen[value] = number
    if not seen:
        raise ConfigError(f"{path} lists no device")
    return tuple(seen)


def check_plan(plan: BrokerPlan) -> None:
    """ConfigError unless every id is one the ACL can hold safely."""
    try:
        check_id("fleet", plan.fleet)
        check_id("controller user", plan.controller_user)
        for device in plan.devices:
            check_id("device", device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if plan.controller_user in plan.devices:
        raise ConfigError(f"the controller user {plan.controller_user!r} is also a device id")
    seen = {d: "this broker's devices" for d in plan.devices}
    seen[plan.controller_user] = "the controller user"
    for user, devices in plan.regions:
        try:
            check_id("bridge user", user)
            for device in devices:
                check_id("device", device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not devices:
            raise ConfigError(f"region {user!r} lists no device")
        for name in (user, *devices):
            if name in seen:
                raise ConfigError(f"{name!r} of region {user!r} is also in {seen[name]}")
            seen[name] = f"region {user!r}"
    if plan.uplink is not None:
        try:
            check_id("bridge user", plan.uplink.user)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """A Mosquitto 2 password-file hash (`$7$101$<salt>$<key>`, base64)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    key = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, HASH_ITERATIONS, 64)
    return (f"$7${HASH_ITERATIONS}${base64.b64encode(salt).decode()}"
            f"${base64.b64encode(key).decode()}")


def acl_text(plan: BrokerPlan) -> str:
    lines = ["# edge-agent fleet broker-config: per-user rules; a user not named here gets "
             "nothing.", f"user {plan.controller_user}", f"topic readwrite {topics.PREFIX}/#", ""]
    everyone = topics.topic(plan.fleet, topics.ALL, topics.CMD)
    for device in plan.devices:
        lines.append(f"user {device}")
        lines += [f"topic write {topics.topic(plan.fleet, device, kind)}"
                  for kind in sorted(topics.DEVICE_KINDS)]
        lines += [f"topic read {topics.topic(plan.fleet, device, kind)}"
                  for kind in sorted(topics.CONTROLLER_KINDS)]
        lines += [f"topic read {everyone}", ""]
    for user, devices in plan.regions:
        # A region's bridge: its boxes' rights together, nothing more.
        lines.append(f"user {user}")
        for device in devices:
            lines += [f"topic write {topics.topic(plan.fleet, device, kind)}"
                      for kind in sorted(topics.DEVICE_KINDS)]
            lines += [f"topic read {topics.topic(plan.fleet, device, kind)}"
                      for kind in sorted(topics.CONTROLLER_KINDS)]
        lines += [f"topic read {everyone}", ""]
    return "\n".join(lines)


def conf_text(plan: BrokerPlan, conf_dir: Path) -> str:
    lines = [
        "# edge-agent fleet broker-config: Mosquitto 2 for one fleet.",
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {conf_dir / PASSWD}",
        f"acl_file {conf_dir / ACL}",
        "# The controller connects with clean_start false: its queue must outlive a restart.",
        "persistence true",
        f"persistence_location {str(plan.data_dir).rstrip('/')}/",
        f"autosave_interval {plan.autosave_interval}",
        f"max_queued_messages {plan.max_queued_messages}",
        f"max_inflight_messages {plan.max_inflight_messages}",
        "",
        f"listener {plan.port} {plan.bind}".rstrip(),
        "protocol mqtt",
    ]
    if plan.tls is not None:
        lines += ["", f"listener {plan.tls_port} {plan.tls_bind}".rstrip(), "protocol mqtt",
                  f"certfile {plan.tls.cert}", f"keyfile {plan.tls.key}"]
        if plan.tls.ca is not None:
            # Without require_certificate Mosquitto never asks a client for a certificate,
            # and the CA would check nothing: each client shows one the CA signed, then its
            # password as on every listener.
            lines += [f"cafile {plan.tls.ca}", "require_certificate true"]
    if plan.uplink is not None:
        lines += ["", *bridge_lines(plan.fleet, plan.uplink)]
    return "\n".join(lines) + "\n"


def uplink_of(url: str, user: str, password_file: Path, ca: Path | None) -> Uplink:
    """The `--uplink` options as an Uplink; ConfigError for a URL or file that will not do."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ConfigError(f"--uplink {url!r}: mqtt://HOST:PORT or mqtts://HOST:PORT")
    try:
        password = password_file.read_text(encoding="utf-8").splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --uplink-password-file {password_file}: {exc}") from exc
    tls = parts.scheme == "mqtts"
    return Uplink(parts.hostname, parts.port or (8883 if tls else 1883), user, password, tls,
                  ca.absolute() if ca is not None else None)


def bridge_lines(fleet: str, up: Uplink) -> list[str]:
    """A region's bridge to the central broker (module docstring)."""
    lines = [
        "# The region's uplink: its boxes' reports out, the controller's acks and commands in;",
        "# cleansession false: while the uplink is down, this broker queues both ways.",
        f"connection edge-uplink-{up.user}",
        f"address {up.host}:{up.port}",
        # 3.1.1: its persistent session never expires at the centre, so what the controller
        # sends while the uplink is down waits there (a 5.0 bridge's session ends with its
        # connection). The link carries everything in its payloads: nothing is lost.
        "bridge_protocol_version mqttv311",
        f"remote_clientid {up.user}",
        f"local_clientid {up.user}-local",
        f"remote_username {up.user}",
        f"remote_password {up.password}",
        "cleansession false",
        "restart_timeout 1 15",
    ]
    if up.tls:
        lines.append(f"bridge_cafile {up.ca}" if up.ca is not None
                     else "bridge_capath /etc/ssl/certs")
    lines += [f"topic {topics.PREFIX}/{fleet}/+/{kind} out 1"
              for kind in sorted(topics.DEVICE_KINDS)]
    lines += [f"topic {topics.PREFIX}/{fleet}/+/{kind} in 1"
              for kind in sorted(topics.CONTROLLER_KINDS)]
    return lines


def _passwd_lines(passwords: dict[str, str], out: Path, tool: str | None) -> str:
    if tool is None:
        return "".join(f"{user}:{hash_password(pw)}\n" for user, pw in passwords.items())
    # One `mosquitto_passwd -U` over a plain-text file (0600, inside `out`) hashes every
    # user in one process; a `-b` per user would start thousands of processes.
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".passwd-plain.")
    try:
        os.fchmod(fd, SECRET_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.writelines(f"{user}:{pw}\n" for user, pw in passwords.items())
        done = subprocess.run([tool, "-U", tmp], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise ConfigError(f"{tool} -U failed: {(done.stderr or done.stdout).strip()}")
        return Path(tmp).read_text(encoding="utf-8")
    finally:
        Path(tmp).unlink(missing_ok=True)


def find_passwd_tool() -> str | None:
    return shutil.which("mosquitto_passwd") or next(
        (p for p in ("/usr/bin/mosquitto_passwd", "/usr/sbin/mosquitto_passwd")
         if os.access(p, os.X_OK)), None)


def write_broker_config(plan: BrokerPlan, out: Path, *,
                        passwd_tool: str | None = None, use_tool: bool = True) -> BrokerFiles:
    """Write passwd, acl, mosquitto.conf and credentials/<user>.txt under `out`."""
    check_plan(plan)
    out = out.absolute()
    creds = out / CREDENTIALS
    creds.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = BrokerFiles(out, out / PASSWD, out / ACL, out / CONF)
    passwords: dict[str, str] = {}
    for user in plan.users():
        path = creds / f"{user}.txt"
        known = path.read_text(encoding="utf-8").strip() if path.is_file() else ""
        if not known:
            known = secrets.token_urlsafe(24)
            atomic_write(path, f"{known}\n".encode(), SECRET_MODE)
            files.new_passwords.append(user)
        passwords[user] = known
        files.credentials[user] = path
    tool = (passwd_tool or find_passwd_tool()) if use_tool else None
    _rewrite(files.passwd, _passwd_lines(passwords, out, tool).encode(), SECRET_MODE)
    _rewrite(files.acl, acl_text(plan).encode(), PUBLIC_MODE)
    # With an uplink the file holds the bridge's password: owner-only at its first write.
    _rewrite(files.conf, conf_text(plan, plan.conf_dir or out).encode(),
             SECRET_MODE if plan.uplink is not None else PUBLIC_MODE)
    return files


def _rewrite(path: Path, data: bytes, mode: int) -> None:
    """A file Mosquitto reads, written anew: a first write gets `mode`; a rewrite keeps the
    owner, group and mode the operator gave it (`chown mosquitto: passwd`, as
    docs/fleet/controller.md says), so a re-run to add a device never locks the broker out
    of its own password file — every login, existing devices' included, would be refused
    at the next HUP."""
    try:
        st = path.stat()
    except FileNotFoundError:
        atomic_write(path, data, mode)
        return
    atomic_write(path, data, stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))
