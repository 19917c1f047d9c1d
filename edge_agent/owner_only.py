"""The box's state is owner-only: every folder it creates under its state dir is 0700,
every file and database 0600, whoever starts it and under whatever umask.

The ledger holds tenants' metadata, `keys.db` their key hashes, `redaction.key` the device's
HMAC key. The systemd unit's `UMask=0077` and `StateDirectoryMode=0700` cover `serve` under
systemd only; a box started by hand, a container's entry point, or a CLI command run first
(`models pull`, `keys add`) inherits the caller's umask, typically 0022. So each creation
point asks for its mode here rather than relying on a process-wide umask, which is shared
with every thread and would also reach what the box writes outside its state.

The mode is given to mkdir/open themselves, so nothing exists for an instant with wider
bits (a umask only ever removes bits), then set exactly. SQLite creates a database 0644 less
the umask, and its -wal, -shm and -journal with the database file's own mode: a database is
therefore created here, empty and 0600, before SQLite opens it (SQLite takes an empty file
as a new database). What exists already is never widened; `private_dir(..., narrow=True)`,
used once for the state dir at the start of `serve`, narrows that one folder when it is the
box's own and open to others (made by an earlier version or by hand under umask 0022) —
as systemd's `StateDirectoryMode=0700` narrows it at each start — which closes everything
below it at once.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
log = logging.getLogger(__name__)


def private_dir(path: Path, *, narrow: bool = False) -> Path:
    """`path` as a folder: it and every missing parent created 0700; an existing one is
    left as it is, unless `narrow` (see the module docstring)."""
    if not path.is_dir():
        if path.parent != path:
            private_dir(path.parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            if not path.is_dir():
                raise
        else:
            os.chmod(path, DIR_MODE)  # exactly: a umask such as 0o277 removed owner bits
            return path
    if narrow:
        _narrow(path)
    return path


def private_file(path: Path) -> Path:
    """`path` created empty and 0600 when missing (its folder 0700 as `private_dir`); an
    existing file is left as it is. Called before SQLite opens a database, so the database
    and the files SQLite makes beside it get 0600 (SQLite's `:memory:` is no file)."""
    if str(path) == ":memory:":
        return path
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        return path
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return path


def _narrow(path: Path) -> None:
    """Group and other bits off the folder when it belongs to this process's user; someone
    else's folder is left to its owner (doctor reports state the service does not own)."""
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or not mode & 0o077:
        return
    os.chmod(path, mode & DIR_MODE)
    log.warning("state dir %s was %o, open to other users: narrowed to %o", path, mode,
                mode & DIR_MODE)
