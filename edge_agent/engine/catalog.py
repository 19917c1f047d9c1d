"""The model catalog: what models exist (models/*.toml) and which are installed (blobs).

Owns `<state-dir>/blobs/sha256-<hex>` and `<state-dir>/manifests/*.json`. A blob enters
the store only after its sha256 matches and its GGUF header has been read in a bounded
child process (`gguf_probe`), so llama.cpp is never handed an unverified file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.resources
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from edge_agent.engine.gguf_probe import GGUFInfo, open_regular, precheck_open, probe
from edge_agent.errors import ModelFileError, ModelNotFound
from edge_agent.names import MAX_NAME_CHARS, normalize_name

__all__ = ["MAX_NAME_CHARS", "normalize_name"]  # where callers have always found them

Progress = Callable[[int, int], None]
_CHUNK = 1 << 20


class PackageSource(BaseModel):
    """A GGUF shipped inside a Python package: a file in its wheel, or a chunked assembly."""

    model_config = ConfigDict(extra="forbid")
    pypi: str
    file: str | None = None
    assemble: str | None = None


class CatalogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    family: str = ""
    parameter_size: str = ""
    quantization: str = ""
    context_length: int | None = None
    license: str = ""
    tier: str = "experimental"
    sha256: str
    size: int
    chat_template: str | None = None
    source: PackageSource
    parameters: dict[str, Any] = Field(default_factory=dict)


class InstalledModel(BaseModel):
    """What the store knows about an installed model; written as its manifest."""

    name: str
    digest: str
    size: int
    origin: str
    installed_at: float
    architecture: str
    family: str
    parameter_size: str
    quantization: str
    context_length: int | None
    embedding_length: int | None
    chat_template: str | None
    template_source: str
    has_fim: bool
    license: str = ""
    tier: str = "experimental"
    parameters: dict[str, Any] = Field(default_factory=dict)

    def blob_path(self, state_dir: Path) -> Path:
        return state_dir / "blobs" / f"sha256-{self.digest}"


def packaged_catalog_dir() -> Path:
    packaged = Path(str(importlib.resources.files("edge_agent"))) / "catalog_models"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "models"


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    with os.fdopen(open_regular(path), "rb") as fh:
        return _hash_copy(fh, None, progress)


class ModelStore:
    def __init__(self, state_dir: Path, catalog_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.catalog_dir = catalog_dir or packaged_catalog_dir()
        self.blobs = state_dir / "blobs"
        self.manifests = state_dir / "manifests"

    # -- catalog ---------------------------------------------------------------------------
    def catalog(self) -> dict[str, CatalogEntry]:
        import tomllib

        entries: dict[str, CatalogEntry] = {}
        for path in sorted(self.catalog_dir.glob("*.toml")):
            with path.open("rb") as fh:
                entry = CatalogEntry.model_validate(tomllib.load(fh))
            entries[normalize_name(entry.name)] = entry
        return entries

    # -- installed models ------------------------------------------------------------------
    def _manifest_path(self, name: str) -> Path:
        return self.manifests / f"{quote(name, safe='')}.json"

    def installed(self) -> list[InstalledModel]:
        if not self.manifests.is_dir():
            return []
        models = [
            InstalledModel.model_validate_json(p.read_text())
            for p in sorted(self.manifests.glob("*.json"))
        ]
        return sorted(models, key=lambda m: m.name)

    def get(self, name: str) -> InstalledModel:
        path = self._manifest_path(normalize_name(name))
        if not path.is_file():
            raise ModelNotFound(f"model '{name}' not found", param="model")
        return InstalledModel.model_validate_json(path.read_text())

    def is_installed(self, name: str) -> bool:
        return self._manifest_path(normalize_name(name)).is_file()

    def verify(self, model: InstalledModel, progress: Progress | None = None) -> GGUFInfo:
        """Full check of an installed blob: present, same size, same sha256, valid header."""
        blob = model.blob_path(self.state_dir)
        if not blob.is_file():
            raise ModelFileError(f"{model.name}: blob {blob.name} is missing")
        if blob.stat().st_size != model.size:
            raise ModelFileError(
                f"{model.name}: blob is {blob.stat().st_size} bytes, expected {model.size}"
            )
        actual = sha256_file(blob, progress)
        if actual != model.digest:
            raise ModelFileError(f"{model.name}: blob digest {actual[:12]} != {model.digest[:12]}")
        return probe(blob)

    def remove(self, name: str) -> InstalledModel:
        model = self.get(name)
        self._manifest_path(model.name).unlink()
        if not any(m.digest == model.digest for m in self.installed()):
            model.blob_path(self.state_dir).unlink(missing_ok=True)
        return model

    # -- installing ------------------------------------------------------------------------
    def pull(self, name: str, progress: Progress | None = None) -> InstalledModel:
        """Install a catalog entry from the package that ships it (no network needed)."""
        key = normalize_name(name)
        entry = self.catalog().get(key)
        if entry is None:
            raise ModelNotFound(f"model '{name}' is not in the catalog", param="model")
        with self._staging() as tmp:
            self._materialize(entry.source, tmp, progress)
            if tmp.stat().st_size != entry.size:
                raise ModelFileError(
                    f"{entry.name}: package {entry.source.pypi} gave {tmp.stat().st_size} bytes, "
                    f"catalog expects {entry.size}"
                )
            digest = sha256_file(tmp)
            if digest != entry.sha256:
                raise ModelFileError(
                    f"{entry.name}: package {entry.source.pypi} gave sha256 {digest[:12]}, "
                    f"catalog expects {entry.sha256[:12]}"
                )
            info = probe(tmp)
            return self._commit(tmp, digest, key, info, origin=f"pypi:{entry.source.pypi}",
                                entry=entry)

    def import_file(
        self, path: Path, name: str, progress: Progress | None = None
    ) -> InstalledModel:
        """Copy any local GGUF into the store under `name`, after checking its header.

        The source is opened once, as a regular file (a FIFO or device is refused, never
        waited on); its header is walked before gigabytes are copied, and the full read in
        the bounded child is of the staged copy, so the bytes checked are the bytes kept.
        """
        key = normalize_name(name)
        with os.fdopen(open_regular(path), "rb") as src:
            precheck_open(src, path)
            src.seek(0)
            with self._staging() as tmp:
                digest = _copy_hashing(src, tmp, progress)
                info = probe(tmp, label=path)
                return self._commit(tmp, digest, key, info, origin=f"import:{path.name}",
                                    entry=None)

    def _materialize(self, source: PackageSource, dest: Path, progress: Progress | None) -> None:
        try:
            dist = importlib.metadata.distribution(source.pypi)
        except importlib.metadata.PackageNotFoundError as exc:
            raise ModelFileError(
                f"package {source.pypi} is not installed (pip install {source.pypi})"
            ) from exc
        if source.file:
            located = Path(str(dist.locate_file(source.file)))
            if not located.is_file():
                raise ModelFileError(f"{source.pypi} has no file {source.file}")
            with os.fdopen(open_regular(located), "rb") as src:
                _copy_hashing(src, dest, progress)
        elif source.assemble:
            module = importlib.import_module(source.assemble)
            module.assemble(output_path=dest, overwrite=True)
        else:
            raise ModelFileError(f"catalog source for {source.pypi} names no file")

    def _staging(self) -> _Staging:
        self.blobs.mkdir(parents=True, exist_ok=True)
        return _Staging(self.blobs)

    def _commit(
        self,
        tmp: Path,
        digest: str,
        name: str,
        info: GGUFInfo,
        *,
        origin: str,
        entry: CatalogEntry | None,
    ) -> InstalledModel:
        template = entry.chat_template if entry and entry.chat_template else info.chat_template
        template_source = (
            "catalog" if entry and entry.chat_template else ("gguf" if template else "none")
        )
        model = InstalledModel(
            name=name,
            digest=digest,
            size=tmp.stat().st_size,
            origin=origin,
            installed_at=time.time(),
            architecture=info.architecture,
            family=(entry.family if entry and entry.family else info.architecture),
            parameter_size=(entry.parameter_size if entry else "") or info.parameter_size,
            quantization=(entry.quantization if entry else "") or info.quantization,
            context_length=info.context_length,
            embedding_length=info.embedding_length,
            chat_template=template,
            template_source=template_source,
            has_fim=info.has_fim,
            license=entry.license if entry else "",
            tier=entry.tier if entry else "experimental",
            parameters=dict(entry.parameters) if entry else {},
        )
        blob = model.blob_path(self.state_dir)
        os.replace(tmp, blob)
        self.manifests.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest_path(name)
        staged = manifest.with_suffix(".tmp")
        staged.write_text(model.model_dump_json(indent=2))
        os.replace(staged, manifest)
        return model


class _Staging:
    """A temporary file beside the blobs (same filesystem, so the final rename is atomic)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path: Path | None = None

    def __enter__(self) -> Path:
        fd, name = tempfile.mkstemp(prefix=".incoming-", dir=self.folder)
        os.close(fd)
        self.path = Path(name)
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _copy_hashing(src: BinaryIO, dest: Path, progress: Progress | None) -> str:
    with dest.open("wb") as fout:
        return _hash_copy(src, fout, progress)


def _hash_copy(src: BinaryIO, dest: BinaryIO | None, progress: Progress | None) -> str:
    """sha256 of an open file, copied to `dest` on the way when one is given."""
    digest = hashlib.sha256()
    total = os.fstat(src.fileno()).st_size
    done = 0
    while block := src.read(_CHUNK):
        digest.update(block)
        if dest is not None:
            dest.write(block)
        done += len(block)
        if progress:
            progress(done, total)
    return digest.hexdigest()
