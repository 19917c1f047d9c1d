"""The link's own state on the device: `<state_dir>/fleet.db` (SQLite, WAL, sqlite-utils
migrations).

- `meta`: `bdseq`, the birth/death sequence. `next_bdseq()` increments and COMMITS before
  it returns, so the Will set for a connect attempt carries a number no earlier session
  used, even after a kill -9 (Sparkplug's bdSeq: a stale death cannot mark a newer
  session offline).
- `streams`: the last command seq accepted per stream (this device's id, and `all`).
- `commands`: every authenticated command by id — stored before its PUBACK is sent, so a
  redelivery is recognised and never executed twice — with its outcome once there is one.

`synchronous=FULL`: a command stored here is acknowledged to the broker right after, and
a power cut must not make the box forget it (it would run it again on redelivery). The
rate is a few commands a day, so the fsync costs nothing. This module stores; it never
decides whether a command may run (`commands` does).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.fleet.device.durable import DurableStore

MIGRATIONS = Migrations("edge-agent-fleet")
OK, REFUSED, FAILED = "ok", "refused", "failed"
STATUSES = frozenset({OK, REFUSED, FAILED})


@MIGRATIONS()
def m001_link_state(db: Database) -> None:
    db.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    db.execute("CREATE TABLE streams (stream TEXT PRIMARY KEY, last_seq INTEGER NOT NULL)")
    db.execute("""CREATE TABLE commands (
        id TEXT PRIMARY KEY, stream TEXT NOT NULL, seq INTEGER NOT NULL,
        type TEXT NOT NULL, received_at REAL NOT NULL, payload BLOB NOT NULL,
        status TEXT, reason TEXT, result TEXT, executed_at REAL)""")
    db.execute("CREATE INDEX commands_received ON commands (received_at)")


class StoredCommand(NamedTuple):
    id: str
    stream: str
    seq: int
    type: str
    received_at: float
    payload: bytes  # the bytes as received
    status: str | None  # None: stored, not executed yet
    reason: str | None
    result: dict[str, Any] | None
    executed_at: float | None


class FleetState(DurableStore):
    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(path, MIGRATIONS, clock=clock)

    # -- bdseq ---------------------------------------------------------------------------

    def bdseq(self) -> int:
        """The bdseq of the current (or last) session; 0 before the first connect."""
        with self._lock:
            row = self._db.conn.execute("SELECT value FROM meta WHERE name = 'bdseq'").fetchone()
            return int(row[0]) if row else 0

    def next_bdseq(self) -> int:
        """The next bdseq, committed before it is returned (call before setting the Will)."""
        with self._lock, self._db.atomic():
            self._db.conn.execute(
                "INSERT INTO meta VALUES ('bdseq', 1) ON CONFLICT (name) DO UPDATE "
                "SET value = value + 1")
            (value,) = self._db.conn.execute(
                "SELECT value FROM meta WHERE name = 'bdseq'").fetchone()
            return int(value)

    # -- commands ------------------------------------------------------------------------

    def last_seq(self, stream: str) -> int:
        with self._lock:
            row = self._db.conn.execute("SELECT last_seq FROM streams WHERE stream = ?",
                                        [stream]).fetchone()
            return int(row[0]) if row else 0

    def command(self, command_id: str) -> StoredCommand | None:
        with self._lock:
            row = self._db.conn.execute(
                "SELECT id, stream, seq, type, received_at, payload, status, reason, result, "
                "executed_at FROM commands WHERE id = ?", [command_id]).fetchone()
        if row is None:
            return None
        result = json.loads(row[8]) if row[8] is not None else None
        return StoredCommand(*row[:8], result, row[9])  # type: ignore[call-arg]

    def accept(self, command_id: str, stream: str, seq: int, type_: str,
               payload: bytes) -> bool:
        """Stores a command to be executed and raises its stream's last seq, in one
        transaction; False (nothing changed) if the id is already stored."""
        with self._lock, self._db.atomic():
            if not self._insert(command_id, stream, seq, type_, payload, None, None, None):
                return False
            self._db.conn.execute(
                "INSERT INTO streams VALUES (?, ?) ON CONFLICT (stream) DO UPDATE "
                "SET last_seq = max(last_seq, excluded.last_seq)", [stream, seq])
            return True

    def refuse(self, command_id: str, stream: str, seq: int, type_: str, payload: bytes,
               reason: str, result: dict[str, Any] | None = None) -> bool:
        """Stores an authenticated command with its refusal (its stream's seq unchanged);
        False if the id is already stored."""
        with self._lock, self._db.atomic():
            return self._insert(command_id, stream, seq, type_, payload, REFUSED, reason,
                                result)

    def record_result(self, command_id: str, status: str, reason: str | None,
                      result: dict[str, Any] | None) -> bool:
        """The outcome of an accepted command, recorded once: False if it already has one
        (or is unknown), and then nothing changes."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {sorted(STATUSES)}")
        text = json.dumps(result, allow_nan=False) if result is not None else None
        with self._lock, self._db.atomic():
            cur = self._db.conn.execute(
                "UPDATE commands SET status = ?, reason = ?, result = ?, executed_at = ? "
                "WHERE id = ? AND status IS NULL",
                [status, reason, text, self._clock(), command_id])
            return cur.rowcount == 1

    def unfinished(self) -> list[StoredCommand]:
        """Commands stored but never given an outcome (the process stopped between storing
        and executing), oldest first: run at start."""
        with self._lock:
            ids = [r[0] for r in self._db.conn.execute(
                "SELECT id FROM commands WHERE status IS NULL ORDER BY received_at")]
        return [c for c in map(self.command, ids) if c is not None]

    def prune(self, before: float) -> int:
        """Forgets finished commands received before `before`. Safe once they are past
        expiry: a redelivery is then refused (expired, replay), not run again."""
        with self._lock, self._db.atomic():
            cur = self._db.conn.execute(
                "DELETE FROM commands WHERE received_at < ? AND status IS NOT NULL", [before])
            return int(cur.rowcount)

    def _insert(self, command_id: str, stream: str, seq: int, type_: str, payload: bytes,
                status: str | None, reason: str | None,
                result: dict[str, Any] | None) -> bool:
        now = self._clock()
        cur = self._db.conn.execute(
            "INSERT OR IGNORE INTO commands VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [command_id, stream, seq, type_, now, bytes(payload), status, reason,
             json.dumps(result, allow_nan=False) if result is not None else None,
             now if status is not None else None])
        return cur.rowcount == 1
