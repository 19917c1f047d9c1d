"""Real local stand-ins for what the rollout runner is handed by the app, for tests:

- `DirReleases`: releases of GGUF files on disk. `download` copies in chunks into
  `dest_dir/<sha>.part`, resuming from what is there (as the HTTP transfer resumes with
  Range), with an optional rate, then checks length, sha256 and the GGUF header walk
  before renaming it; `install` is `ModelOps.install_verified(..., activate=False)`.
- `PaperLoader`: the registry's bookkeeping (versions by (name, digest), in use, holds,
  drain, room) without llama.cpp, so tiny GGUFs can be "loaded".
- `ScriptedProbe`: answers a golden prompt as the name's active version would, from a
  script per digest.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.models.entries import InstalledModel, ManifestExtras
from edge_agent.engine.models.gguf_probe import open_regular, precheck_open
from edge_agent.engine.request import GenerationRequest
from edge_agent.errors import ModelFileError, ServiceUnavailable
from edge_agent.fleet.device.rollout.outcomes import ReleaseFailed, ReleaseRejected
from edge_agent.names import ModelName
from tests.ggufgen import write_tiny_gguf

CHUNK = 64 * 1024


@dataclass(frozen=True)
class Release:
    name: str
    version: str
    length: int
    sha256: str
    manifest: dict[str, Any]
    path: Path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class DirReleases:
    releases: dict[tuple[str, str], Release] = field(default_factory=dict)
    # Outcomes to raise, in order, before lookups succeed (ReleaseFailed, ReleaseRejected).
    lookup_errors: list[Exception] = field(default_factory=list)
    lookups: int = 0
    copied: int = 0  # bytes copied by downloads, all of them
    chunk_delay_s: float = 0.0
    # Called after each chunk with (bytes done, total): a test's kill switch.
    after_chunk: Callable[[int, int], None] | None = None

    def add(self, name: str, version: str, path: Path,
            manifest: Mapping[str, Any] | None = None) -> Release:
        key = ModelName.parse(name)
        full = {"name": key, "version": version, "quantization": "F32",
                "context_length": 256, "license": "test", "tier": "experimental",
                "chat_template": None, "parameters": {}, "min_agent_version": "0.1.0",
                "gate": None, **(manifest or {})}
        release = Release(key, version, path.stat().st_size, sha256_of(path), full, path)
        self.releases[(key, version)] = release
        return release

    def lookup(self, name: str, version: str) -> Release:
        self.lookups += 1
        if self.lookup_errors:
            raise self.lookup_errors.pop(0)
        release = self.releases.get((ModelName.parse(name), version))
        if release is None:
            raise ReleaseRejected("unknown", name=name, version=version)
        return release

    def download(self, release: Release, dest_dir: Path, *,
                 progress: Callable[[int, int], None], max_bytes_per_s: int | None = None,
                 headroom: int) -> Path:
        dest_dir.mkdir(parents=True, exist_ok=True)
        final = dest_dir / f"{release.sha256}.gguf"
        if final.exists():
            self._check(final, release)
            return final
        part = dest_dir / f"{release.sha256}.part"
        done = part.stat().st_size if part.exists() else 0
        with release.path.open("rb") as src, part.open("ab") as out:
            src.seek(done)
            while chunk := src.read(CHUNK):
                out.write(chunk)
                out.flush()
                done += len(chunk)
                self.copied += len(chunk)
                progress(done, release.length)
                if self.after_chunk is not None:
                    self.after_chunk(done, release.length)
                if max_bytes_per_s:
                    time.sleep(len(chunk) / max_bytes_per_s)
                if self.chunk_delay_s:
                    time.sleep(self.chunk_delay_s)
        try:
            self._check(part, release)
        except ReleaseFailed:
            part.unlink()
            raise
        os.replace(part, final)
        return final

    @staticmethod
    def _check(path: Path, release: Release) -> None:
        size = path.stat().st_size
        if size != release.length:
            raise ReleaseFailed("length_mismatch", bytes=size, expected=release.length)
        if sha256_of(path) != release.sha256:
            raise ReleaseFailed("hash_mismatch", expected=release.sha256)
        with os.fdopen(open_regular(path), "rb") as fh:
            try:
                precheck_open(fh, path)
            except ModelFileError as exc:
                raise ReleaseRejected("not_gguf", error=exc.message) from None

    def install(self, release: Release, path: Path, modelops: ModelOps, *,
                by: str) -> InstalledModel:
        m = release.manifest
        extras = ManifestExtras(quantization=m.get("quantization") or "",
                                license=m.get("license") or "",
                                tier=m.get("tier") or "experimental",
                                chat_template=m.get("chat_template"),
                                template_source="release",
                                parameters=dict(m.get("parameters") or {}))
        return modelops.install_verified(path, release.name, release.sha256, by=by,
                                         expected_size=release.length, extras=extras,
                                         origin=f"release:{release.name}@{release.version}",
                                         activate=False)


@dataclass
class PaperModel:
    info: InstalledModel
    in_use: int = 0


class PaperLoader:
    """The registry's decisions on paper: what is loaded, held, drained, in use."""

    def __init__(self, store: ModelStore, *, room: bool = True) -> None:
        self.store = store
        self.room = room
        self.models: dict[tuple[str, str], PaperModel] = {}
        self.held: set[tuple[str, str]] = set()
        self.draining: set[str] = set()
        self.log: list[tuple[str, ...]] = []

    async def acquire(self, name: str, keep_alive: float | None = None,
                      digest: str | None = None) -> tuple[PaperModel, int]:
        key = ModelName.parse(name)
        if digest is None and key in self.draining:
            raise ServiceUnavailable(f"model '{key}' is switching versions", retry_after=2)
        info = self.store.get(key) if digest is None else next(
            v.model for v in self.store.versions(key) if v.digest == digest)
        model = self.models.setdefault((key, info.digest), PaperModel(info))
        self.log.append(("load", key, info.digest))
        model.in_use += 1
        return model, 0

    async def release(self, model: PaperModel) -> None:
        model.in_use -= 1
        k = (model.info.name, model.info.digest)
        if model.in_use == 0 and k not in self.held and \
                self.store.active_digest(k[0]) != k[1]:
            self.models.pop(k, None)

    async def unload(self, name: str, digest: str | None = None) -> bool:
        gone = [k for k, m in self.models.items() if k[0] == name
                and digest in (None, k[1]) and m.in_use == 0]
        for k in gone:
            del self.models[k]
            self.log.append(("unload", *k))
        return bool(gone)

    def loaded(self) -> list[PaperModel]:
        return list(self.models.values())

    def hold(self, name: str, digest: str, held: bool = True) -> None:
        self.log.append(("hold" if held else "unhold", name, digest))
        (self.held.add if held else self.held.discard)((name, digest))

    def drain(self, name: str, on: bool = True, retry_after: float = 2.0) -> None:
        self.log.append(("drain" if on else "undrain", name))
        (self.draining.add if on else self.draining.discard)(name)

    async def fits(self, name: str, digest: str) -> bool:
        return self.room

    def busy(self, name: str, n: int) -> None:
        """`n` requests in use on the name's active version (a test's load)."""
        info = self.store.get(name)
        self.models.setdefault((info.name, info.digest), PaperModel(info)).in_use = n


@dataclass(frozen=True)
class Answer:
    text: str
    completion_tokens: int
    ttft_ms: float
    eval_ms: float
    digest: str


class ScriptedProbe:
    """Answers as the active version of the requested name: `script[digest](request)`
    (default: "ok"), with the figures given."""

    def __init__(self, store: ModelStore,
                 script: Mapping[str, Callable[[GenerationRequest], str]] | None = None, *,
                 tokens_per_s: Mapping[str, float] | None = None, ttft_ms: float = 20.0
                 ) -> None:
        self.store = store
        self.script = dict(script or {})
        self.speed = dict(tokens_per_s or {})
        self.ttft_ms = ttft_ms
        self.calls: list[tuple[str, str]] = []  # (digest, prompt id or text)

    async def __call__(self, request: GenerationRequest) -> Answer:
        digest = self.store.active_digest(request.model) or ""
        text = self.script.get(digest, lambda _r: "ok")(request)
        self.calls.append((digest, request.prompt or str(request.messages)))
        tokens = max(2, len(text.split()) + 1)
        speed = self.speed.get(digest, 50.0)
        return Answer(text, tokens, self.ttft_ms, (tokens - 1) / speed * 1000, digest)


def write_gguf(path: Path, *, context_length: int = 256, floats: int = 24) -> Path:
    """A small valid GGUF whose size grows with `floats` (one f32 tensor), so a transfer
    has chunks to cut; distinct `context_length`s give distinct digests."""
    return write_tiny_gguf(path, context_length=context_length, name="rollout-test",
                           floats=floats)
