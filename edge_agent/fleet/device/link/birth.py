"""What a box says about itself on `status` (retained, QoS 1): the birth at every connect
and the death (the Will, and published before a clean disconnect).

    {"v":1,"type":"birth","device":…,"fleet":…,"boot_id":…,"bdseq":12,"ts":…,
     "agent_version":"0.1.0","llama_cpp_version":"0.3.36","hardware":{…},
     "models":[{"name":…,"digest":…,"active":true,"loaded":false}],"tenants":[…],
     "config_fingerprint":"<sha256>"}
    {"v":1,"type":"death","device":…,"fleet":…,"boot_id":…,"bdseq":12,"ts":…}

`facts_source` gathers the facts of a birth; each part is read on its own, so a part that
fails (models.db locked, no psutil reading) is left out and reported in `errors` instead of
holding the birth back. Models are read through `ModelOps` only; llama.cpp's version comes
from the package metadata — this module never imports llama_cpp (it would load the
library into a process that may not serve). The config fingerprint hashes the effective
settings with secrets left out and files named, not read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from edge_agent import __version__
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.fleet.protocol.envelope import dumps

log = logging.getLogger(__name__)
VERSION = 1
# Settings that are secrets: left out of the fingerprint (a hash of a short secret can be
# brute-forced, and the controller has no business comparing them).
SECRETS: tuple[tuple[str, ...], ...] = (("server", "metrics_key"),)

Facts = Callable[[], dict[str, Any]]


def death(*, fleet: str, device: str, boot_id: str, bdseq: int,
          ts: float | None = None) -> bytes:
    return dumps({"v": VERSION, "type": "death", "device": device, "fleet": fleet,
                  "boot_id": boot_id, "bdseq": bdseq,
                  "ts": time.time() if ts is None else ts})


def birth(facts: Mapping[str, Any], *, fleet: str, device: str, boot_id: str, bdseq: int,
          ts: float | None = None) -> bytes:
    """The birth: the protocol's fields first, the facts after (never overriding them)."""
    head = {"v": VERSION, "type": "birth", "device": device, "fleet": fleet,
            "boot_id": boot_id, "bdseq": bdseq, "ts": time.time() if ts is None else ts}
    return dumps({**dict(facts), **head})


def llama_cpp_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def config_fingerprint(settings: Settings) -> str:
    """sha256 of the effective settings as JSON (keys sorted), secrets left out; file
    settings count by their path, never their content."""
    data = settings.model_dump(mode="json")
    for path in SECRETS:
        node = data
        for part in path[:-1]:
            node = node.get(part, {})
        if isinstance(node, dict):
            node.pop(path[-1], None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def hardware(state_dir: Path, gpus: Callable[[], list[dict[str, Any]]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu_count": psutil.cpu_count(logical=True),
                           "ram_bytes": int(psutil.virtual_memory().total)}
    probe = state_dir if state_dir.exists() else state_dir.parent
    try:
        usage = shutil.disk_usage(probe)
        out["disk_bytes"], out["disk_free_bytes"] = int(usage.total), int(usage.free)
    except OSError:
        pass
    out["gpus"] = list(gpus()) if gpus is not None else []
    return out


def models(ops: ModelOps) -> list[dict[str, Any]]:
    """Every installed version of every name: digest, active, loaded."""
    try:
        loaded = {(s.info.name, s.info.digest) for s in ops.loaded()}
    except Exception:  # the registry's dict read from another thread: loaded is a hint
        loaded = set()
    out: list[dict[str, Any]] = []
    for model in ops.installed():
        for version in ops.versions(model.name):
            out.append({"name": model.name, "digest": version.digest, "active": version.active,
                        "loaded": (model.name, version.digest) in loaded})
    return out


def facts_source(settings: Callable[[], Settings], ops: ModelOps | None = None, *,
                 gpus: Callable[[], list[dict[str, Any]]] | None = None) -> Facts:
    """A callable giving a birth's facts now (settings may change under config.patch)."""

    def facts() -> dict[str, Any]:
        current = settings()
        out: dict[str, Any] = {"agent_version": __version__,
                               "llama_cpp_version": llama_cpp_version()}
        errors: dict[str, str] = {}
        parts: dict[str, Callable[[], Any]] = {
            "hardware": lambda: hardware(current.state_dir, gpus),
            "models": (lambda: models(ops)) if ops is not None else (lambda: []),
            "tenants": lambda: sorted(current.tenants),
            "config_fingerprint": lambda: config_fingerprint(current),
        }
        for name, read in parts.items():
            try:
                out[name] = read()
            except Exception as exc:  # one part failing never holds the birth back
                log.warning("fleet: birth without %s: %s", name, exc)
                errors[name] = type(exc).__name__
        if errors:
            out["errors"] = errors
        return out

    return facts
