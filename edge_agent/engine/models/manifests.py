"""`<state-dir>/manifests/*.json`: one file per name, the manifest of its active version.

Before `models.db` these files were the store; they are kept as a mirror of the pointer, so
that what reads or copies the folder (older tools, a state dir copied by hand) still finds
each name's active model, and a state dir from before the database is upgraded from them
(`ModelStore` imports, on opening, any manifest whose version the database does not know).

Owns the file format and atomic writes only; never decides what is active (`models.db`
does) and is only written inside a `models.db` write transaction, so that the file never
names a version the database has not got.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from urllib.parse import quote

from pydantic import ValidationError

from edge_agent.engine.models.entries import InstalledModel
from edge_agent.owner_only import private_dir

log = logging.getLogger(__name__)


def manifest_path(folder: Path, name: str) -> Path:
    return folder / f"{quote(name, safe='')}.json"


def read_all(folder: Path) -> list[InstalledModel]:
    """Every readable manifest; one that does not parse is logged and skipped (a file left
    half-written by a tool that wrote it in place must not stop the store opening)."""
    if not folder.is_dir():
        return []
    models = []
    for path in sorted(folder.glob("*.json")):
        try:
            models.append(InstalledModel.model_validate_json(path.read_bytes()))
        except (OSError, ValidationError) as exc:
            log.warning("manifest %s skipped: %s", path.name, str(exc).splitlines()[0])
    return models


def write(folder: Path, model: InstalledModel) -> None:
    private_dir(folder)
    # A name of its own per writer ('.' and no .json: never read as a manifest), then a
    # rename: a reader sees the old file or the new one.
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(model.model_dump_json(indent=2))
        os.replace(tmp, manifest_path(folder, model.name))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def drop(folder: Path, name: str) -> None:
    manifest_path(folder, name).unlink(missing_ok=True)


def clean(folder: Path) -> None:
    """Temporary files of writers killed mid-write (call under the write lock: nobody is
    writing one then)."""
    if folder.is_dir():
        for tmp in folder.glob(".manifest-*.tmp"):
            tmp.unlink(missing_ok=True)
