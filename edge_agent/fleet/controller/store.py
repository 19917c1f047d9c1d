"""The controller's store: the `ControllerStore` interface and its two databases.

`SQLiteStore` (`<state>/controller.db`, the default: WAL, synchronous FULL, sqlite-utils
migrations) and `PostgresStore` (`--db postgresql://…`, psycopg 3, schema created and
migrated on open) behave the same: the queries are `sql.SQLStore`'s, written once; these
classes own only a connection, its lock and its transactions. An ack promises the device
that a message is stored, so the store never loses a commit it returned from (hence
SQLite's synchronous FULL) and never deletes a database it cannot read: it reports it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from edge_agent.errors import EdgeAgentError
from edge_agent.fleet.controller.audit import AuditStore
from edge_agent.fleet.controller.inbound import Acks, Inbound
from edge_agent.fleet.controller.operators import OperatorStore
from edge_agent.fleet.controller.retention import RetentionQueries
from edge_agent.fleet.controller.review import ReviewQueries
from edge_agent.fleet.controller.rollout_records import RolloutRecordStore
from edge_agent.fleet.controller.schema import SCHEMA
from edge_agent.fleet.controller.slo import SLOQueries
from edge_agent.fleet.controller.sql import SQLStore
from edge_agent.fleet.controller.transaction import Exec
from edge_agent.fleet.protocol.envelope import Ranges

if TYPE_CHECKING:
    import psycopg
    from sqlite_utils.migrations import Migrations

DB_FILE = "controller.db"


class FleetStoreError(EdgeAgentError):
    """The store cannot be opened or written (the database is down, unreadable or newer)."""


class StoreConflict(FleetStoreError):
    """Another writer's transaction crossed this one (PostgreSQL's deadlock or
    serialization failure: two controllers, or the leader's engine beside an ingest) and
    this one was rolled back whole. Nothing is wrong with the store or the data: the same
    transaction, tried again, goes through (an operator's request is answered 503 with a
    Retry-After, as for a server too busy to answer)."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(f"the store refused a transaction that crossed another writer's: "
                         f"{message}", retry_after=1.0)


class ControllerStore(Protocol):
    """The controller's store: devices, messages and commands here; rollouts, operators,
    the audit trail and the purge through the narrow query object each caller holds
    (`store.rollouts.create_rollout(…)`), whose interface lives beside its queries."""

    @property
    def rollouts(self) -> RolloutRecordStore: ...

    @property
    def operators(self) -> OperatorStore: ...

    @property
    def audit(self) -> AuditStore: ...

    @property
    def retention(self) -> RetentionQueries: ...

    @property
    def slo(self) -> SLOQueries: ...

    @property
    def review(self) -> ReviewQueries: ...

    def ingest(self, batch: Sequence[Inbound]) -> Acks: ...

    def birth(self, fleet: str, device: str, message: Mapping[str, Any],
              received: float) -> None: ...

    def death(self, fleet: str, device: str, message: Mapping[str, Any],
              received: float) -> bool: ...

    def devices(self) -> list[dict[str, Any]]: ...

    def retire(self, device: str, *, by: str | None, now: float) -> bool: ...

    def device(self, device: str) -> dict[str, Any] | None: ...

    def register(self, devices: Sequence[str], *, fleet: str, by: str,
                 now: float) -> list[str]: ...

    def unregister(self, device: str) -> bool: ...

    def registrations(self) -> dict[str, dict[str, Any]]: ...

    def controller_seen(self, controller: str, *, leader: bool, leader_since: float | None,
                        started: float, now: float, pid: int, host: str) -> None: ...

    def controllers(self) -> list[dict[str, Any]]: ...

    def counts(self) -> tuple[int, int]: ...

    def latest_metrics(self, device: str) -> dict[str, Any] | None: ...

    def messages(self, device: str, *, kind: str | None = None, boot_id: str | None = None,
                 since: float | None = None, limit: int = 100,
                 newest_first: bool = False) -> list[dict[str, Any]]: ...

    def record_dropped(self, device: str, ranges: Mapping[str, Any], reported: float) -> int: ...

    def dropped(self, device: str, boot_id: str) -> Ranges: ...

    def stored_ranges(self, device: str, boot_id: str) -> Ranges: ...

    def gaps(self, device: str, boot_id: str) -> Ranges: ...

    def boots(self, device: str) -> list[str]: ...

    def loss(self, device: str) -> dict[str, Any]: ...

    def next_command_seq(self, stream: str) -> int: ...

    def record_command(self, command: Mapping[str, Any], recorded: float) -> None: ...

    def command_result(self, device: str, body: Mapping[str, Any], received: float) -> bool: ...

    def command(self, command_id: str) -> dict[str, Any] | None: ...

    def last_error(self, device: str) -> dict[str, Any] | None: ...

    def command_results(self, command_id: str) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def open_store(db_url: str | None, state_dir: Path) -> SQLiteStore | PostgresStore:
    """`postgresql://…` (or `postgres://…`): PostgreSQL; None or `sqlite:///path`: SQLite
    (default `<state_dir>/controller.db`)."""
    if db_url is None:
        return SQLiteStore(state_dir / DB_FILE)
    scheme = urlsplit(db_url).scheme
    if scheme in ("postgresql", "postgres"):
        return PostgresStore(db_url)
    if scheme == "sqlite":
        return SQLiteStore(Path(db_url.removeprefix("sqlite://")))
    raise FleetStoreError(f"--db must be postgresql://… or sqlite:///path, not {scheme}://")


def _migrations() -> Migrations:
    """The schema steps as a sqlite-utils migration set (built per open: no module state)."""
    from sqlite_utils import Database
    from sqlite_utils.migrations import Migrations

    steps = Migrations("edge-agent-fleet-controller")

    def step(statements: tuple[str, ...]) -> Any:
        def apply(db: Database) -> None:
            for statement in statements:
                db.execute(statement)
        return apply

    for name, statements in SCHEMA:
        steps(name=name)(step(statements))
    return steps


class _SQLiteExec:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    def many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        if params:
            self._conn.executemany(sql, params)

    def inserted(self, sql: str, params: Sequence[Sequence[Any]]) -> list[bool]:
        # sqlite3's executemany takes no RETURNING; in-process statements cost microseconds.
        return [self._conn.execute(sql, row).fetchone() is not None for row in params]


class SQLiteStore(SQLStore):
    """`controller.db` in the state dir. One connection shared by the ingest thread and
    the API's threads under a lock; other processes (`fleet devices`) read beside it (WAL)."""

    def __init__(self, path: Path) -> None:
        from sqlite_utils import Database

        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            # isolation_level None: this class alone says where a transaction starts.
            self._conn = sqlite3.connect(path, check_same_thread=False, timeout=10,
                                         isolation_level=None)
            db = Database(self._conn)
            db.enable_wal()
            # FULL: an ack tells the device to delete its copy, so a commit acked must
            # survive a power cut too (NORMAL may lose the last commits).
            self._conn.execute("PRAGMA synchronous = FULL")
            _migrations().apply(db)
        except sqlite3.DatabaseError as exc:
            raise FleetStoreError(f"cannot open the controller store {path}: {exc} "
                                  "(left as it is)") from exc

    @contextmanager
    def _tx(self) -> Iterator[Exec]:
        with self._lock:
            # IMMEDIATE: take the write lock first, so a dedupe read and its inserts see
            # the same database even with `fleet send` writing from another process.
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SQLiteExec(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[Exec]:
        with self._lock:
            yield _SQLiteExec(self._conn)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _PostgresExec:
    """`?` placeholders become psycopg's `%s` (the shared SQL has no literal `?` or `%`)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._conn.cursor() as cur:
            cur.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return cur.fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._conn.cursor() as cur:
            cur.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return cur.rowcount

    def many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        if params:
            with self._conn.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), params)  # type: ignore[arg-type]

    def inserted(self, sql: str, params: Sequence[Sequence[Any]]) -> list[bool]:
        if not params:
            return []
        # One pipelined round trip for the batch; one result set (0 or 1 row) per row.
        with self._conn.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), params, returning=True)  # type: ignore[arg-type]
            out = []
            while True:
                out.append(cur.fetchone() is not None)
                if not cur.nextset():
                    return out


def _where(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    return f"postgresql://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}" \
           f"{parts.path}"


class PostgresStore(SQLStore):
    """For fleets past one machine. One connection under a lock, reopened when the server
    went away (the ingest retries the batch; nothing is acked until a commit succeeds)."""

    _MIGRATION_LOCK = 0x6564676566  # pg_advisory_xact_lock key: two controllers opening at once

    def __init__(self, url: str, *, connect_timeout: int = 10) -> None:
        self._url = url
        self._timeout = connect_timeout
        self._lock = threading.Lock()
        self._conn = self._connect()
        self._migrate()

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg

        try:
            return psycopg.connect(self._url, autocommit=True, connect_timeout=self._timeout)
        except psycopg.Error as exc:
            raise FleetStoreError(f"cannot reach the controller store at {_where(self._url)}: "
                                  f"{str(exc).strip().splitlines()[0]}") from exc

    def _migrate(self) -> None:
        with self._tx() as db:
            db.run("SELECT pg_advisory_xact_lock(?)", [self._MIGRATION_LOCK])
            db.run("CREATE TABLE IF NOT EXISTS fleet_migrations (name TEXT PRIMARY KEY, "
                   "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
            done = {row[0] for row in db.rows("SELECT name FROM fleet_migrations")}
            for name, statements in SCHEMA:
                if name not in done:
                    for statement in statements:
                        db.run(statement)
                    db.run("INSERT INTO fleet_migrations (name) VALUES (?)", [name])

    def _live(self) -> psycopg.Connection[Any]:
        if self._conn.closed or self._conn.broken:
            self._conn = self._connect()
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[Exec]:
        import psycopg

        with self._lock:
            conn = self._live()
            try:
                with conn.transaction():
                    yield _PostgresExec(conn)
            except psycopg.Error as exc:
                # SQLSTATE class 40, "transaction rollback": a deadlock (40P01) or a
                # serialization failure (40001). psycopg files the deadlock under its
                # OperationalError, so the class is read from the code, not the type.
                if (exc.sqlstate or "").startswith("40"):
                    raise StoreConflict(str(exc).strip().splitlines()[0]) from exc
                raise

    @contextmanager
    def _read(self) -> Iterator[Exec]:
        with self._lock:
            yield _PostgresExec(self._live())

    def close(self) -> None:
        with self._lock:
            self._conn.close()
