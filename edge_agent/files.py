"""Writing a small file whole — the fleet's keys, the broker's passwd/ACL/config, release
metadata, the config overlay, the ledger-summary watermark — holding a lock file (the
release repository, the box's TUF metadata, one download's part) across processes, and
naming a file inside a directory from a name that came from elsewhere (`inside`).

A temporary file beside the target is created private (mkstemp: 0600, a unique name, so
two writers never share it), set to `mode`, written, fsynced, then renamed over the
target: a reader sees the old file or the new one, never a gap, and a key is never
readable by others, not even for an instant. `sync_dir` also fsyncs the folder, so the
rename itself survives a power cut (state a box acts on at its next start).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class EscapesDirectory(ValueError):
    """A file name that would put the file somewhere other than directly in the
    directory meant to hold it."""


def inside(directory: Path, name: str) -> Path:
    """`directory / name`, or EscapesDirectory unless that is a file directly in
    `directory`: a plain name (no separator, no `..`, no NUL) that still lands there once
    resolved, links included. Names built from signed metadata or a stored row (a
    download's `<sha256>.part`) pass through here, so a name is never a path, whatever
    the checks before it let through, and a link planted where a file is written never
    sends the bytes (or an unlink) elsewhere."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise EscapesDirectory(f"{name[:80]!r} is not a plain file name")
    path = directory / name
    base = directory.resolve()
    if path.resolve().parent != base:
        raise EscapesDirectory(f"{name[:80]!r} resolves outside {base}")
    return path


def atomic_write(path: Path, data: bytes, mode: int = 0o600, *, sync_dir: bool = False,
                 owner: tuple[int, int] | None = None) -> None:
    """`data` in `path` by rename, never half-written; 0600 unless told (what the box
    writes is its state, owner-only; a public key or served metadata asks for 0644).
    `owner` (uid, gid): the new file's, set before the rename, so no reader of the old
    file (a broker running as its own user) ever finds it unreadable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing) for the block: one holder at a
    time across processes, released even when the holder is killed."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                           0o600), "a") as fh:  # owner-only whatever the umask
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
