"""Installed versions of each model name and the pointer to the active one: `models.db`.

A name (`gemma3:270m`) may have several installed versions, one per digest; one of them is
active, and that one serves. The pointer, the versions and their history live in
`<state-dir>/models.db` (SQLite, WAL, schema as sqlite-utils migrations), so a switch made
by the CLI in another process is seen by the server at its next lookup, and every change is
one transaction: a process killed mid-switch leaves the old digest active or the new one,
never neither.

Owns the SQL only. Never touches a blob or a manifest file: `ModelStore` does, inside a
transaction opened here (`VersionDB.transaction`), so that a file operation and the rows
that describe it are ordered by the same write lock across processes.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.engine.models.entries import InstalledModel
from edge_agent.errors import ModelNotFound
from edge_agent.owner_only import private_file

MODELS_DB = "models.db"
MIGRATIONS = Migrations("edge-agent-models")
BUSY_TIMEOUT_S = 15.0  # another process's switch takes milliseconds; an install's commit too

# History actions. activate and rollback move the pointer (`previous` is the digest they
# moved it from); install and copy add a version; remove drops one.
INSTALL, ACTIVATE, ROLLBACK, COPY, REMOVE = "install", "activate", "rollback", "copy", "remove"


@MIGRATIONS()
def m001_versions(db: Database) -> None:
    # `last_active`: when a version stopped being the active one (NULL: never active, or
    # active now). Rollback and retention both order by it.
    db.execute("""CREATE TABLE versions (
        name TEXT NOT NULL, digest TEXT NOT NULL, manifest TEXT NOT NULL,
        installed_at REAL NOT NULL, last_active REAL,
        PRIMARY KEY (name, digest))""")
    db.execute("CREATE INDEX versions_digest ON versions (digest)")
    db.execute("""CREATE TABLE active (
        name TEXT PRIMARY KEY, digest TEXT NOT NULL, since REAL NOT NULL, actor TEXT NOT NULL,
        FOREIGN KEY (name, digest) REFERENCES versions (name, digest))""")
    db.execute("""CREATE TABLE history (
        id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, digest TEXT NOT NULL,
        previous TEXT, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
        detail TEXT NOT NULL DEFAULT '')""")
    db.execute("CREATE INDEX history_name ON history (name, id)")


@dataclass(frozen=True)
class Version:
    """One installed version of a name."""

    model: InstalledModel
    active: bool
    last_active: float | None  # when it was last switched away from; None: never (or now)

    @property
    def digest(self) -> str:
        return self.model.digest


@dataclass(frozen=True)
class HistoryEntry:
    id: int
    name: str
    digest: str
    previous: str | None  # the digest active before, for activate and rollback
    at: float
    by: str  # operator:<tenant>, cli:<user>, rollout:<id>, install, upgrade
    action: str
    detail: str = ""


def _model(manifest: str) -> InstalledModel:
    return InstalledModel.model_validate_json(manifest)


class Txn:
    """The statements of one write transaction (the caller holds SQLite's write lock)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.now = time.time()

    # -- reads inside the transaction ------------------------------------------------------
    def active_digest(self, name: str) -> str | None:
        row = self.conn.execute("SELECT digest FROM active WHERE name = ?", [name]).fetchone()
        return str(row[0]) if row else None

    def active(self, name: str) -> InstalledModel | None:
        row = self.conn.execute(
            "SELECT v.manifest FROM active a JOIN versions v USING (name, digest) "
            "WHERE a.name = ?", [name]).fetchone()
        return _model(row[0]) if row else None

    def version(self, name: str, digest: str) -> InstalledModel | None:
        row = self.conn.execute("SELECT manifest FROM versions WHERE name = ? AND digest = ?",
                                [name, digest]).fetchone()
        return _model(row[0]) if row else None

    def digests(self, name: str) -> list[str]:
        return [r[0] for r in self.conn.execute(
            "SELECT digest FROM versions WHERE name = ? ORDER BY installed_at", [name])]

    def referenced(self, digest: str) -> bool:
        return self.conn.execute("SELECT 1 FROM versions WHERE digest = ? LIMIT 1",
                                 [digest]).fetchone() is not None

    def previous_digest(self, name: str) -> str | None:
        """The installed version that was active most recently before the current one."""
        row = self.conn.execute(
            "SELECT digest FROM versions WHERE name = ? AND last_active IS NOT NULL AND "
            "digest IS NOT (SELECT digest FROM active WHERE name = ?) "
            "ORDER BY last_active DESC LIMIT 1", [name, name]).fetchone()
        return str(row[0]) if row else None

    # -- writes ----------------------------------------------------------------------------
    def add(self, model: InstalledModel, *, by: str, action: str = INSTALL,
            detail: str = "") -> None:
        """A version (or a new manifest for one already installed: its `last_active`
        stays)."""
        self.conn.execute(
            "INSERT INTO versions (name, digest, manifest, installed_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (name, digest) DO UPDATE SET manifest = excluded.manifest, "
            "installed_at = excluded.installed_at",
            [model.name, model.digest, model.model_dump_json(), model.installed_at])
        self._log(model.name, model.digest, None, by, action, detail)

    def switch(self, name: str, digest: str, *, by: str, action: str = ACTIVATE) -> bool:
        """Point `name` at an installed `digest`; False when it already was."""
        previous = self.active_digest(name)
        if previous == digest:
            return False
        if self.version(name, digest) is None:
            raise ModelNotFound(f"model '{name}' has no installed version "
                                f"sha256:{digest[:12]}", param="digest")
        if previous is not None:
            self.conn.execute("UPDATE versions SET last_active = ? WHERE name = ? AND "
                              "digest = ?", [self.now, name, previous])
        self.conn.execute("UPDATE versions SET last_active = NULL WHERE name = ? AND "
                          "digest = ?", [name, digest])
        self.conn.execute(
            "INSERT INTO active (name, digest, since, actor) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, "
            "since = excluded.since, actor = excluded.actor", [name, digest, self.now, by])
        self._log(name, digest, previous, by, action)
        return True

    def retain(self, name: str, keep_previous: int, *, by: str) -> list[InstalledModel]:
        """Drop the versions of `name` that were active once, beyond the `keep_previous`
        most recently active; versions never active (installed for a later activation)
        stay until removed explicitly."""
        rows = self.conn.execute(
            "SELECT digest FROM versions WHERE name = ? AND last_active IS NOT NULL AND "
            "digest IS NOT (SELECT digest FROM active WHERE name = ?) "
            "ORDER BY last_active DESC", [name, name]).fetchall()
        dropped = []
        for (digest,) in rows[keep_previous:]:
            dropped += self.drop(name, digest, by=by,
                                 detail=f"retention: keep_previous = {keep_previous}")
        return dropped

    def drop(self, name: str, digest: str | None = None, *, by: str,
             detail: str = "") -> list[InstalledModel]:
        """Remove one version, or every version and the pointer of a name."""
        where, args = ("name = ?", [name]) if digest is None else \
            ("name = ? AND digest = ?", [name, digest])
        models = [_model(r[0]) for r in self.conn.execute(
            f"SELECT manifest FROM versions WHERE {where}", args)]
        self.conn.execute(f"DELETE FROM active WHERE {where}", args)
        self.conn.execute(f"DELETE FROM versions WHERE {where}", args)
        for m in models:
            self._log(name, m.digest, None, by, REMOVE, detail)
        return models

    def _log(self, name: str, digest: str, previous: str | None, by: str, action: str,
             detail: str = "") -> None:
        self.conn.execute(
            "INSERT INTO history (name, digest, previous, at, actor, action, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", [name, digest, previous, self.now, by, action,
                                             detail])


class VersionDB:
    """`models.db`, one connection per thread (SQLite serialises writers across threads
    and processes; WAL lets readers go on meanwhile)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        private_file(path)  # 0600, and so its -wal and -shm
        conn = self._conn()
        db = Database(conn)
        db.enable_wal()
        # Two processes opening a new file at once: the write lock makes the second wait
        # and then find the migrations applied.
        conn.execute("BEGIN IMMEDIATE")
        try:
            MIGRATIONS.apply(db)
        except BaseException:
            conn.rollback()
            raise
        conn.execute("COMMIT")

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # Autocommit: transactions are the explicit BEGIN IMMEDIATE of `transaction`.
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
            # FULL: an activation that returned survives a power cut, not only a crash.
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        """One write transaction: committed when the block ends, rolled back on an error."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield Txn(conn)
        except BaseException:
            conn.rollback()
            raise
        conn.execute("COMMIT")

    # -- reads (each sees the last committed state, whichever process wrote it) -----------
    def active_digest(self, name: str) -> str | None:
        row = self._conn().execute("SELECT digest FROM active WHERE name = ?",
                                   [name]).fetchone()
        return str(row[0]) if row else None

    def active(self, name: str) -> InstalledModel | None:
        row = self._conn().execute(
            "SELECT v.manifest FROM active a JOIN versions v USING (name, digest) "
            "WHERE a.name = ?", [name]).fetchone()
        return _model(row[0]) if row else None

    def actives(self) -> list[InstalledModel]:
        return [_model(r[0]) for r in self._conn().execute(
            "SELECT v.manifest FROM active a JOIN versions v USING (name, digest) "
            "ORDER BY a.name")]

    def active_since(self, name: str) -> tuple[float, str] | None:
        row = self._conn().execute("SELECT since, actor FROM active WHERE name = ?",
                                   [name]).fetchone()
        return (float(row[0]), str(row[1])) if row else None

    def versions(self, name: str) -> list[Version]:
        """Every installed version of `name`, the active one first, then the most
        recently active, then those never active (newest install first)."""
        rows = self._conn().execute(
            "SELECT v.manifest, a.digest IS NOT NULL, v.last_active FROM versions v "
            "LEFT JOIN active a ON a.name = v.name AND a.digest = v.digest "
            "WHERE v.name = ? ORDER BY a.digest IS NULL, v.last_active IS NULL, "
            "v.last_active DESC, v.installed_at DESC", [name]).fetchall()
        return [Version(_model(m), bool(is_active), last) for m, is_active, last in rows]

    def names(self) -> list[str]:
        return [r[0] for r in self._conn().execute(
            "SELECT DISTINCT name FROM versions ORDER BY name")]

    def known(self, name: str, digest: str) -> bool:
        return self._conn().execute("SELECT 1 FROM versions WHERE name = ? AND digest = ?",
                                    [name, digest]).fetchone() is not None

    def history(self, name: str | None = None, limit: int | None = None
                ) -> list[HistoryEntry]:
        """Newest first."""
        sql = "SELECT id, name, digest, previous, at, actor, action, detail FROM history"
        args: list[object] = []
        if name is not None:
            sql += " WHERE name = ?"
            args.append(name)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [HistoryEntry(*row) for row in self._conn().execute(sql, args)]
