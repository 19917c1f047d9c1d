"""How the box's fleet files open: `outbox.db`, `fleet.db` and `rollouts.db` are each one
SQLite connection in WAL mode with `synchronous=FULL`, migrated by sqlite-utils.

FULL because each of them is acted on right after a commit — a seq the controller may see,
a command acknowledged to the broker, a rollout's transition — so a power cut must not take
a commit back. Batched commits keep it cheap (the outbox: FULL with batches of 100 as fast
as NORMAL on loopback). One connection shared across threads (`check_same_thread=False`):
each owner uses it only under its own lock.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.owner_only import private_file


def open_durable(path: Path, migrations: Migrations) -> Database:
    # 0600, and so its -wal and -shm, under any umask
    db = Database(sqlite3.connect(private_file(path), check_same_thread=False))
    db.enable_wal()
    db.execute("PRAGMA synchronous = FULL")
    migrations.apply(db)
    return db


class DurableStore:
    """One such file behind an instance lock: `_db` is used only while `_lock` is held,
    from whichever thread holds it; `_clock` stamps rows (injected in tests)."""

    def __init__(self, path: Path, migrations: Migrations, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._db = open_durable(path, migrations)

    def close(self) -> None:
        with self._lock:
            self._db.close()
