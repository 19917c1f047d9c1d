"""`edge-agent doctor`: one line per check of a box, each failure with its fix.

Reads and probes only: it never changes the state dir, never loads a model into a
running server's memory, and finishes in seconds plus one digest pass over the blobs.
"""

from __future__ import annotations

import datetime
import grp
import json
import os
import pwd
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from edge_agent.config import Settings, UpstreamSettings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.runtime import native
from edge_agent.errors import EdgeAgentError
from edge_agent.names import ModelName
from edge_agent.netaddr import is_loopback
from edge_agent.tls import (
    TLSFileError,
    certificates,
    fingerprint,
    key_matches,
    key_mode_problem,
    served_certificate,
)

Status = Literal["ok", "info", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" — fix: {self.fix}" if self.fix and self.status in ("warn", "fail") else ""
        return f"{self.status:<5} {self.name}: {self.detail}{fix}"


def run_checks(settings: Settings) -> list[Check]:
    checks = [Check("ok", "config", "settings are valid")]
    state = settings.state_dir
    checks.append(writable := _state_dir(state))
    if writable.status == "ok":
        checks.append(_ownership(state))
    store = ModelStore(state, settings.catalog_dir)
    models = store.installed() if state.is_dir() else []
    checks.append(_disk(state, store))
    default = ModelName.parse(settings.default_model)
    if not any(m.name == default for m in models):
        checks.append(Check("warn", f"model {default}", "not installed yet",
                            f"edge-agent models pull {default} (serve also does it at start)"))
    for m in models:
        try:
            store.verify(m)
            checks.append(Check("ok", f"model {m.name}",
                                f"sha256:{m.digest[:12]} and GGUF header verified"))
        except EdgeAgentError as exc:
            checks.append(Check("fail", f"model {m.name}", exc.message,
                                f"edge-agent models rm {m.name}, then pull or import it again"))
        checks += _other_versions(store, m.name)
    checks += _draft_models(settings, {m.name for m in models})
    checks.append(_ledger(state / "ledger.db"))
    runtime = native.check()  # in a child: a missing library must not stop the doctor
    if runtime.ok:
        checks += _llama_and_gpu(settings)
    else:
        checks += [Check("fail", native.NAME, p.detail, p.fix) for p in runtime.problems]
    checks += _tls(settings)
    checks.append(_port(settings))
    checks += _fleet(settings)
    for name, upstream in settings.upstreams.items():
        checks += _upstream(name, upstream)
    return checks


def _other_versions(store: ModelStore, name: ModelName) -> list[Check]:
    """Versions kept beside the active one (for a rollback, or installed for a later
    activation): a broken one does not stop serving, so it warns."""
    checks = []
    for v in store.versions(name):
        if v.active:
            continue
        label = f"model {name}@{v.digest[:12]}"
        kind = "kept for rollback" if v.last_active is not None else "installed, never active"
        try:
            store.verify(v.model)
            checks.append(Check("ok", label, f"{kind}; sha256 and GGUF header verified"))
        except EdgeAgentError as exc:
            checks.append(Check("warn", label, f"{kind}; {exc.message}",
                                "remove this version, or install the file again"))
    return checks


def _draft_models(settings: Settings, installed: set[str]) -> list[Check]:
    """A `draft_model` a model's settings name must be installed: a missing one is not an
    error at load (the model serves without guesses), so only the doctor says it. Its
    vocabulary is checked when the model loads (it takes both models in memory)."""
    checks = []
    for name, override in sorted(settings.models.overrides.items()):
        if not override.draft_model:
            continue
        label = f"draft model of {name}"
        try:
            draft = ModelName.parse(override.draft_model)
        except EdgeAgentError as exc:
            checks.append(Check("warn", label, exc.message, "name an installed model"))
            continue
        if draft in installed:
            checks.append(Check("ok", label, f"{draft} installed (its vocabulary is checked "
                                "when the model loads)"))
        else:
            checks.append(Check("warn", label, f"{draft} is not installed: {name} runs "
                                "without guesses", f"edge-agent models pull {draft}"))
    return checks


def _state_dir(state: Path) -> Check:
    if not state.exists():
        return Check("warn", "state dir", f"{state} does not exist yet",
                     f"create it (mkdir -p {state}) or let serve create it")
    try:
        with tempfile.NamedTemporaryFile(dir=state, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check("fail", "state dir", f"{state} is not writable ({exc.strerror})",
                     "chown the directory to the service user, or set --state-dir")
    return Check("ok", "state dir", f"{state} is writable")


OWNERSHIP_SCAN_MAX = 20_000  # entries looked at; a state dir holds far fewer


def _ownership(state: Path) -> Check:
    """Files under the state dir owned by another user than the dir's own (the service's):
    what a command run as root leaves behind (a lock folder, a database's -shm file), which
    the service then cannot write: a rollout's or a switch's failure much later."""
    owner = state.stat().st_uid
    strangers: list[str] = []
    seen = 0
    stack = [state]
    while stack and seen < OWNERSHIP_SCAN_MAX:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid != owner:
                strangers.append(os.path.relpath(entry.path, state))
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
    name = _user(owner)
    if strangers:
        shown = ", ".join(sorted(strangers)[:3]) + (", …" if len(strangers) > 3 else "")
        return Check("fail", "state ownership",
                     f"{len(strangers)} file(s) not owned by {name}, the state dir's owner "
                     f"(the service cannot write them): {shown}",
                     f"sudo chown -R {name}: {state}; run edge-agent commands as that user "
                     f"(sudo -u {name} edge-agent …)")
    return Check("ok", "state ownership", f"every file is {name}'s")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _disk(state: Path, store: ModelStore) -> Check:
    probe = state if state.exists() else state.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return Check("warn", "disk", f"cannot read free space of {probe}")
    biggest = max([e.size for e in store.catalog().values()] or [0])
    detail = f"{free / 2**30:.1f} GiB free at {probe}"
    if free < 2 * biggest:
        return Check("warn", "disk", detail + "; less than twice the largest catalog model",
                     "free space before installing or importing models")
    return Check("ok", "disk", detail)


def _ledger(path: Path) -> Check:
    from sqlite_utils import Database

    from edge_agent.ledger.store import pending_migrations

    if not path.exists():
        return Check("ok", "ledger", f"{path} will be created at start")
    try:
        db = Database(path)
        result = db.execute("PRAGMA quick_check").fetchone()[0]
        db.close()
        pending = pending_migrations(path)
    except Exception as exc:
        return Check("fail", "ledger", f"{path} cannot be read ({exc})",
                     "move the file aside; the server starts a new ledger")
    if result != "ok":
        return Check("fail", "ledger", f"{path} fails its integrity check: {result}",
                     "move the file aside; the server starts a new ledger")
    if pending:
        return Check("warn", "ledger", f"schema needs migrations {', '.join(pending)}",
                     "start the server (it migrates at start)")
    return Check("ok", "ledger", "schema current, integrity check passed")


def _llama_and_gpu(settings: Settings) -> list[Check]:
    from edge_agent.engine.runtime.llama import (
        gpu_offload_supported,
        resolve_gpu_layers,
        system_info,
    )
    from edge_agent.telemetry.hardware import NvmlReader

    info = system_info()
    features = " ".join(p.strip() for p in info.split("|") if p.strip().endswith("= 1"))
    out = [Check("ok", "llama.cpp", f"built with: {features or info}")]
    nvml = NvmlReader()
    offload = gpu_offload_supported()
    layers = resolve_gpu_layers(settings.runtime.n_gpu_layers)
    if nvml.available:
        out.append(Check("ok", "gpu", f"{', '.join(nvml.gpus)}; driver {nvml.driver_version}, "
                                      f"CUDA {nvml.cuda_version}"))
        if not offload:
            out.append(Check("warn", "offload", "a GPU is present but llama.cpp has no GPU "
                             "backend: inference runs on the CPU",
                             "reinstall with CMAKE_ARGS=\"-DGGML_CUDA=on\""))
        else:
            out.append(Check("ok", "offload", f"{layers} layers per model will be offloaded"))
    else:
        out.append(Check("ok", "gpu", "no NVIDIA GPU visible (NVML absent): CPU inference"))
        if offload and layers:
            out.append(Check("ok", "offload", f"llama.cpp has a GPU backend; {layers} layers "
                             "will be offloaded"))
    return out


TLS_EXPIRY_WARN_DAYS = 14  # time to get a new certificate signed and installed


def _tls(settings: Settings) -> list[Check]:
    """HTTPS: off on a LAN address is a warning (keys and prompts in clear; a refusal
    would stop boxes set up before TLS); on, its files as the service will load them: the
    certificate in date, the key owner-only and the certificate's, each file readable by
    the service user (the state dir's owner)."""
    server = settings.server
    files = server.tls
    if files is None:
        if is_loopback(server.host):
            return [Check("info", "tls", f"off: {server.host} is a loopback address")]
        return [Check("warn", "tls", f"off: {server.host} is served in clear, API keys and "
                                     "prompts cross the network unencrypted",
                      "set [server] tls_cert_file and tls_key_file (the store's or the "
                      "fleet's CA signs the box's certificate)")]
    user = settings.state_dir.stat().st_uid if settings.state_dir.is_dir() else os.geteuid()
    out = [_tls_certificate("tls certificate", files.cert, user, leaf=True)]
    out.append(_tls_key(files.key, files.cert, user))
    if files.client_ca is not None:
        out.append(_tls_certificate("tls client CA", files.client_ca, user, leaf=False))
    return out


def _tls_certificate(name: str, path: Path, user: int, *, leaf: bool) -> Check:
    fix = f"install a valid certificate at {path}, then systemctl reload edge-agent"
    unreadable = _unreadable_by(path, user)
    if unreadable:
        return Check("fail", name, unreadable, f"chown {_user(user)} {path}")
    try:
        found = certificates(path)
    except TLSFileError as exc:
        return Check("fail", name, str(exc), fix)
    now = datetime.datetime.now(datetime.timezone.utc)
    shown = found[:1] if leaf else found  # a chain's CAs outlive its leaf
    for cert in shown:
        subject = cert.subject.rfc4514_string()
        if cert.not_valid_after_utc <= now:
            return Check("fail", name, f"{subject} in {path} expired on "
                                       f"{cert.not_valid_after_utc:%Y-%m-%d}", fix)
        if cert.not_valid_before_utc > now:
            return Check("fail", name, f"{subject} in {path} is not valid before "
                                       f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
                                       "(or this clock is wrong)", fix)
    soonest = min(shown, key=lambda c: c.not_valid_after_utc)
    days = (soonest.not_valid_after_utc - now).total_seconds() / 86400
    detail = (f"{soonest.subject.rfc4514_string()} expires on "
              f"{soonest.not_valid_after_utc:%Y-%m-%d} ({days:.0f} days)")
    if leaf:
        detail += f", sha256 {fingerprint(path)[:16]}"
    else:
        detail = f"{len(found)} CA certificate(s); the first to end: {detail}"
    if days <= TLS_EXPIRY_WARN_DAYS:
        return Check("warn", name, detail, fix)
    return Check("ok", name, detail)


def _tls_key(key: Path, cert: Path, user: int) -> Check:
    name = "tls key"
    problem = key_mode_problem(key) or _unreadable_by(key, user)
    if problem:
        return Check("fail", name, problem,
                     f"chown {_user(user)} {key} && chmod 600 {key}")
    try:
        matches = key_matches(certificates(cert)[0], key)
    except TLSFileError as exc:
        return Check("fail", name, str(exc), "install the certificate's own key")
    if not matches:
        return Check("fail", name, f"{key} is not the key of {cert}",
                     "install the certificate and its key together")
    return Check("ok", name, f"owner-only, {_user(user)}'s, and the certificate's own")


def _unreadable_by(path: Path, uid: int) -> str:
    """Why `uid` (the service user) cannot read `path`, or "" (permission bits of the file
    itself; root reads anything)."""
    try:
        st = path.stat()
        with path.open("rb"):
            pass
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if uid == 0:
        return ""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == uid:
        bit = mode & 0o400
    elif st.st_gid in _groups(uid):
        bit = mode & 0o040
    else:
        bit = mode & 0o004
    return "" if bit else (f"{path} ({_user(st.st_uid)}, {mode:04o}) is not readable by "
                           f"{_user(uid)}, the service user")


def _groups(uid: int) -> set[int]:
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem}


def _port(settings: Settings) -> Check:
    host, port = settings.server.host, settings.server.port
    with socket.socket() as s:
        s.settimeout(1)
        busy = s.connect_ex((host, port)) == 0
    if not busy:
        return Check("ok", "port", f"{host}:{port} is free")
    files = settings.server.tls
    served = served_certificate(host, port) if files is not None else None
    if files is not None and served is not None:
        return _tls_port(host, port, files.cert, served)
    version = _health(f"http://{host}:{port}")
    if version is not None and files is not None:
        return Check("warn", "port", f"edge-agent {version} answers on {host}:{port} in "
                                     "plain HTTP, not HTTPS as configured",
                     "restart it to take the TLS settings (systemctl restart edge-agent)")
    if version is not None:
        return Check("ok", "port", f"edge-agent {version} answers on {host}:{port}")
    return Check("fail", "port", f"{host}:{port} is taken by another program",
                 "stop it, or set server.port")


def _tls_port(host: str, port: int, cert: Path, served: bytes) -> Check:
    """The box's HTTPS port: the certificate it serves is the file's (else a reload is
    due), and /health over it (a box asking client certificates answers only those)."""
    try:
        mine = fingerprint(served) == fingerprint(cert)
    except TLSFileError:
        mine = False
    version = _health(f"https://{host}:{port}")
    if version is None and not mine:
        return Check("fail", "port", f"{host}:{port} is taken by another program (it "
                                     f"serves another certificate than {cert})",
                     "stop it, or set server.port")
    who = f"edge-agent {version}" if version else "edge-agent (asks client certificates)"
    if not mine:
        return Check("warn", "port", f"{who} answers on https://{host}:{port} with another "
                                     f"certificate than {cert}",
                     "systemctl reload edge-agent (it reads the files again)")
    return Check("ok", "port", f"{who} answers on https://{host}:{port} with the "
                               "configured certificate")


def _health(base: str) -> str | None:
    """The version /health reports (no key needed, even on a box with tenants), or None.
    Unverified over HTTPS: this asks who answers; the certificate is checked apart."""
    try:
        r = httpx.get(f"{base}/health", timeout=2, verify=False)
        return str(r.json()["edge_agent"])
    except (httpx.HTTPError, ValueError, TypeError, KeyError):
        return None


def _fleet(settings: Settings, timeout_s: float = 5.0) -> list[Check]:
    """The fleet link: its files, the broker reached with the configured credentials
    (TCP, TLS, MQTT CONNECT; never as the device's own client id, which would throw a
    running agent off the broker), and what waits in the outbox."""
    from edge_agent.fleet.device.link.session import probe
    from edge_agent.fleet.protocol.signing import load_public

    fleet = settings.fleet
    if not fleet.enabled:
        return [Check("info", "fleet", "link disabled (fleet.enabled = false)")]
    address = fleet.broker_address
    out = [Check("ok", "fleet config", f"device {fleet.device_id} of fleet {fleet.fleet_id}, "
                                       f"broker {fleet.broker}")]
    files = {"fleet.password_file": fleet.password_file, "fleet.ca_file": fleet.ca_file,
             "fleet.client_cert": fleet.client_cert, "fleet.client_key": fleet.client_key,
             "fleet.command_public_key_file": fleet.command_public_key_file}
    broken = False
    for key, path in files.items():
        if path is None:
            continue
        try:
            data = path.read_bytes()
            if key == "fleet.command_public_key_file":
                load_public(path)
            elif key == "fleet.password_file" and not data.strip():
                raise ValueError("it is empty")
        except (OSError, ValueError) as exc:
            broken = True
            reason = getattr(exc, "strerror", None) or str(exc)
            out.append(Check("fail", "fleet files", f"{key} {path}: {reason}",
                             "make it readable by the service user, or fix the path"))
    if not broken:
        out.append(Check("ok", "fleet files", "every configured file is readable"))
    if fleet.command_public_key_file is None:
        out.append(Check("warn", "fleet commands", "no fleet.command_public_key_file: every "
                         "command will be refused and the controller's acks cannot be "
                         "verified (the broker's ACL alone guards the outbox)",
                         "install the controller's public key "
                         "(edge-agent fleet keygen) and set fleet.command_public_key_file"))
    found = probe(fleet, timeout_s)
    where = f"{address.host}:{address.port}"
    if found.ok:
        out.append(Check("ok", "fleet broker", f"{where}: {found.detail} in "
                                               f"{found.elapsed_s * 1000:.0f} ms"))
    else:
        # Unreachable is a state the link rides out (the box serves, the outbox keeps
        # everything); refused credentials or TLS are a configuration to fix.
        status: Status = "warn" if found.kind in ("refused", "timeout", "dns") else "fail"
        fixes = {"refused": "start the broker, or check fleet.broker's host and port",
                 "timeout": "check the network path and firewall to the broker",
                 "dns": "check fleet.broker's host name",
                 "not_authorized": "check fleet.username and fleet.password_file against "
                                   "the broker's passwd (fleet broker-config)",
                 "tls": "check fleet.ca_file and the broker's certificate (its name must "
                        "match the host in fleet.broker)",
                 "config": "fix the file named above"}
        out.append(Check(status, "fleet broker", f"{where}: {found.detail}; the box serves "
                                                 "without the link meanwhile",
                         fixes.get(found.kind, "see the broker's log")))
    out.append(_outbox(settings.state_dir / "outbox.db"))
    return out


def _upstream(name: str, up: UpstreamSettings, timeout_s: float = 5.0) -> list[Check]:
    """An upstream ([upstreams.NAME]): its key file, then `GET /models` as the box asks it
    (the key, the CA): reachable, its certificate trusted, the key taken, and every model
    the box maps to it listed. Unreachable is a warning (the box answers here meanwhile);
    a refused key or certificate, or a model it does not list, is a configuration to fix."""
    where = f"upstream {name}"
    try:
        key = up.api_key()
    except OSError as exc:
        return [Check("fail", where, f"api_key_file {up.api_key_file}: "
                                     f"{getattr(exc, 'strerror', None) or exc}",
                      "chmod 600 the key file, owned by the service user")]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    verify: bool | str = str(up.ca_file) if up.ca_file is not None else True
    try:
        answer = httpx.get(f"{up.base_url}/models", headers=headers, verify=verify,
                           timeout=timeout_s, trust_env=False)
    except httpx.ConnectError as exc:
        tls = "certificate" in str(exc).lower() or "ssl" in str(exc).lower()
        return [Check("fail" if tls else "warn", where, f"{up.base_url}: {exc}; requests "
                      "are answered here meanwhile",
                      "check ca_file and the upstream's certificate (its name must match "
                      "base_url's host)" if tls else "check the network path to it")]
    except httpx.HTTPError as exc:
        return [Check("warn", where, f"{up.base_url}: {type(exc).__name__}: {exc}",
                      "check the network path to it")]
    if answer.status_code in (401, 403):
        return [Check("fail", where, f"{up.base_url} refused the key ({answer.status_code})",
                      "check api_key_file against the upstream's keys")]
    if answer.status_code != 200:
        return [Check("warn", where, f"GET {up.base_url}/models answered "
                                     f"{answer.status_code}", "see the upstream's log")]
    try:
        listed = {str(m.get("id")) for m in answer.json().get("data", [])}
    except (ValueError, AttributeError):
        listed = set()
    missing = sorted(theirs for theirs in up.models.values() if theirs not in listed)
    if missing:
        return [Check("warn", where, f"{up.base_url} does not list {', '.join(missing)}",
                      "fix the names in its `models` table (the upstream's own names)")]
    return [Check("ok", where, f"{up.base_url}: reachable in "
                               f"{answer.elapsed.total_seconds() * 1000:.0f} ms, "
                               f"{len(up.models)} model(s) listed")]


def _outbox(path: Path) -> Check:
    """Messages waiting for the controller, read-only (the link owns the file)."""
    import sqlite3
    import time

    if not path.exists():
        return Check("ok", "fleet outbox", "empty (not created yet)")
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
        try:
            depth, oldest = conn.execute("SELECT COUNT(*), MIN(ts) FROM outbox").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return Check("warn", "fleet outbox", f"{path} cannot be read ({exc})",
                     "the link moves a corrupt outbox aside at its next start")
    if not depth:
        return Check("ok", "fleet outbox", "empty: the controller has everything")
    age = time.time() - float(oldest)
    return Check("ok" if age < 3600 else "warn", "fleet outbox",
                 f"{depth} messages wait for the controller, the oldest {age / 60:.0f} min old",
                 "check that the broker is reachable and the controller runs")


def render(checks: list[Check], as_json: bool) -> str:
    if as_json:
        return json.dumps([c.__dict__ for c in checks], indent=2)
    return "\n".join(c.line() for c in checks)
