"""The durable outbox: every message a device sends (but `status`) is committed here before
it is published, and deleted only when the controller's ingest acknowledgement covers it —
a broker PUBACK proves nothing (stock Mosquitto drops acknowledged QoS 1 messages on the
way to a slow subscriber).

`<state_dir>/outbox.db`, SQLite in WAL mode, schema as sqlite-utils migrations:

- `outbox`: one row per message — (boot_id, seq) unique, kind, class, ts, the envelope's
  bytes and their size, `sent_at` (NULL: to publish). `id` (AUTOINCREMENT, never reused)
  is the commit order, so "oldest first" is `ORDER BY id` across boots.
- `boots`: the last seq committed per boot_id, so a seq is never given twice even after
  its rows were acknowledged and deleted.
- `counters`: metrics rows and bytes dropped over the budget, all time.

Seqs: `append` assigns the next seq of this boot and buffers the row in memory; `flush`
commits the buffer in one transaction, in seq order. A crash loses only rows never
committed — never published either — so what a boot committed is a gap-free prefix
1..n, and a seq missing in the middle at the controller is a loss (or a reported drop).

Budget: past `max_bytes` the flush that crossed it deletes the oldest `metrics` rows (any
boot, sent or not) down to 90% of the budget and, in the same transaction, appends an
`outbox.dropped` audit event naming the dropped seq ranges per boot — a drop is never
silent. `audit` rows are never dropped, even past the budget.

Corruption: a file that is not SQLite or fails `PRAGMA integrity_check` at open is moved
aside as `outbox.db.corrupt-<UTC time>` (with its -wal/-shm), never deleted; a fresh
outbox starts and its first row is an `outbox.corrupt` audit event; `corrupt_moved` says
where the old file went.

Threads: every method takes the instance lock, so producers on any thread may `append`
(memory only, unless `commit=True`). Everything that touches the file (`flush`, `ack`,
`pending`, `mark_sent`, `resend_all`) belongs to the link's own thread, which owns the
MQTT connection. Never call them from paho callbacks: those run under paho's lock and
may fire before `publish()` returns; a callback only hands message ids or an ack payload
to the owner thread through a queue (measured: committing inside `on_publish` halves
throughput).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.fleet.device.durable import open_durable
from edge_agent.fleet.protocol.envelope import (
    AUDIT,
    METRICS,
    build,
    check_acks,
    check_boot_id,
    encode,
)
from edge_agent.fleet.protocol.ids import check_id

log = logging.getLogger(__name__)
MIGRATIONS = Migrations("edge-agent-outbox")
# An outbox.dropped event lists at most this many ranges (a few dozen bytes each), so it
# stays far below the envelope's 256 KiB; a larger drop is reported in several events.
MAX_RANGES_PER_EVENT = 4000
_CORRUPT_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
_VARS = 500  # ids per statement, below SQLite's host-parameter limit


@MIGRATIONS()
def m001_outbox(db: Database) -> None:
    db.execute("""CREATE TABLE outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        boot_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
        class TEXT NOT NULL, ts REAL NOT NULL, payload BLOB NOT NULL,
        size INTEGER NOT NULL, sent_at REAL, UNIQUE (boot_id, seq))""")
    db.execute("CREATE INDEX outbox_class ON outbox (class, id)")
    db.execute("CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL")
    db.execute("CREATE TABLE boots (boot_id TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, "
               "started REAL NOT NULL)")
    db.execute("CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")


class Row(NamedTuple):
    """A committed message: `payload` is the envelope's bytes, published as they are."""

    id: int
    boot_id: str
    seq: int
    kind: str
    cls: str
    ts: float
    payload: bytes
    size: int


class OutboxStats(NamedTuple):
    depth: int  # committed rows not yet acknowledged
    bytes: int  # their payload bytes
    oldest_age_s: float  # age of the oldest row, committed or buffered (0: none)
    buffered: int  # appended, not yet committed
    dropped_rows: int  # metrics rows dropped over the budget, all time
    dropped_bytes: int
    refused: int  # metrics appends refused while the buffer was full (flushes failing)


class OutboxFull(ValueError):
    """A metrics append refused: the uncommitted buffer already holds `max_bytes` (the
    file is not taking commits). No seq was used, so the refusal leaves no gap."""


class Outbox:
    def __init__(self, path: Path, *, device: str, boot_id: str, max_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        check_id("device", device)
        check_boot_id(boot_id)
        if max_bytes <= 0:
            raise ValueError(f"max_bytes {max_bytes} is not positive")
        self.path = path
        self.device = device
        self.boot_id = boot_id
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.RLock()
        self._buffer: list[tuple[str, int, str, str, float, bytes, int]] = []
        self._buffer_bytes = 0
        self._refused = 0
        self._over_budget_logged = False
        self.corrupt_moved: Path | None = None
        reason = self._move_aside_if_corrupt()
        self._db = _open(path)
        conn = self._db.conn
        depth, size = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM outbox").fetchone()
        self._depth, self._bytes = int(depth), int(size)
        with self._db.atomic():
            # Boots with nothing left to send are history; this boot's row survives a reopen
            # with the same boot_id, so its seqs continue.
            conn.execute("DELETE FROM boots WHERE boot_id != ? AND boot_id NOT IN "
                         "(SELECT DISTINCT boot_id FROM outbox)", [boot_id])
            conn.execute("INSERT OR IGNORE INTO boots VALUES (?, 0, ?)", [boot_id, clock()])
            # Nothing is in flight in a new process: every row is to be sent again.
            conn.execute("UPDATE outbox SET sent_at = NULL WHERE sent_at IS NOT NULL")
        (last,) = conn.execute("SELECT last_seq FROM boots WHERE boot_id = ?",
                               [boot_id]).fetchone()
        self._next_seq = int(last) + 1
        if self.corrupt_moved is not None:
            self.append("events", AUDIT, {"event": "outbox.corrupt",
                                          "moved_to": str(self.corrupt_moved),
                                          "reason": reason}, commit=True)

    # -- producing ---------------------------------------------------------------------

    def append(self, kind: str, cls: str, body: Mapping[str, Any], *,
               commit: bool = False) -> int:
        """Buffers one message and returns its seq. ValueError (no seq used) for a bad
        kind/class/body or one over 256 KiB; OutboxFull for metrics while the buffer is
        full. `commit=True` flushes before returning (an audit row that must be durable
        before its action) — disk I/O, so only on the owner thread."""
        with self._lock:
            seq = self._next_seq
            ts = self._clock()
            data = encode(build(self.device, self.boot_id, seq, kind, cls, body, ts))
            if cls == METRICS and self._buffer_bytes + len(data) > self.max_bytes:
                self._refused += 1
                raise OutboxFull(f"outbox buffer holds {self._buffer_bytes} uncommitted bytes")
            self._next_seq = seq + 1
            self._buffer.append((self.boot_id, seq, kind, cls, ts, data, len(data)))
            self._buffer_bytes += len(data)
            if commit:
                self.flush()
            return seq

    def flush(self) -> int:
        """Commits the buffer in one transaction (and drops metrics past the budget in the
        same one); the number of rows committed. On a database error the buffer is kept,
        to be committed by a later flush, and the error raised."""
        with self._lock:
            if not self._buffer:
                return 0
            batch, next_seq = self._buffer, self._next_seq
            added = sum(r[6] for r in batch)
            conn = self._db.conn
            try:
                with self._db.atomic():
                    conn.executemany(
                        "INSERT INTO outbox (boot_id, seq, kind, class, ts, payload, size) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)", batch)
                    depth, size = self._depth + len(batch), self._bytes + added
                    if size > self.max_bytes:
                        depth, size = self._drop(depth, size)
                    conn.execute("UPDATE boots SET last_seq = ? WHERE boot_id = ?",
                                 [self._next_seq - 1, self.boot_id])
            except BaseException:
                self._next_seq = next_seq  # the drop events' seqs were not committed
                raise
            self._buffer, self._buffer_bytes = [], 0
            self._depth, self._bytes = depth, size
            return len(batch)

    # -- sending -----------------------------------------------------------------------

    def pending(self, limit: int = 100) -> list[Row]:
        """Committed rows not yet marked sent, oldest first, every boot."""
        with self._lock:
            cur = self._db.conn.execute(
                "SELECT id, boot_id, seq, kind, class, ts, payload, size FROM outbox "
                "WHERE sent_at IS NULL ORDER BY id LIMIT ?", [limit])
            return [Row(*r) for r in cur]

    def mark_sent(self, ids: Iterable[int]) -> None:
        """Rows handed to the broker: not offered by `pending` again until `resend_all`."""
        ids = list(ids)
        with self._lock, self._db.atomic():
            now = self._clock()
            for i in range(0, len(ids), _VARS):
                chunk = ids[i:i + _VARS]
                self._db.conn.execute(
                    f"UPDATE outbox SET sent_at = ? WHERE id IN ({','.join('?' * len(chunk))})",
                    [now, *chunk])

    def now(self) -> float:
        """This outbox's clock (its rows' `sent_at`)."""
        return self._clock()

    def resend_all(self, older_than_s: float | None = None, *,
                   sent_before: float | None = None) -> int:
        """Offers sent-but-unacknowledged rows again (all, or those sent more than
        `older_than_s` ago, and before `sent_before` on `now()`'s clock): after a
        reconnect, and when an ack is overdue — the broker may have acknowledged a message
        it never delivered. Done at open by itself."""
        with self._lock, self._db.atomic():
            if older_than_s is None and sent_before is None:
                cur = self._db.conn.execute(
                    "UPDATE outbox SET sent_at = NULL WHERE sent_at IS NOT NULL")
            else:
                cutoff = min(self._clock() - (older_than_s or 0.0),
                             math.inf if sent_before is None else sent_before)
                cur = self._db.conn.execute(
                    "UPDATE outbox SET sent_at = NULL WHERE sent_at < ?", [cutoff])
            return int(cur.rowcount)

    def ack(self, acks: Mapping[str, Sequence[Sequence[int]]]) -> int:
        """Deletes exactly the rows the controller says it stored (`{boot_id: [[a, b]]}`,
        inclusive), in one transaction; the number deleted. Overlapping or repeated ranges
        and seqs already gone are harmless. ValueError for a malformed ack (nothing
        deleted)."""
        checked = check_acks(acks)
        deleted = freed = 0
        with self._lock:
            conn = self._db.conn
            with self._db.atomic():
                for boot_id, runs in checked.items():
                    for a, b in runs:
                        n, size = conn.execute(
                            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM outbox "
                            "WHERE boot_id = ? AND seq BETWEEN ? AND ?", [boot_id, a, b]).fetchone()
                        if n:
                            conn.execute("DELETE FROM outbox WHERE boot_id = ? AND seq BETWEEN "
                                         "? AND ?", [boot_id, a, b])
                            deleted, freed = deleted + int(n), freed + int(size)
            self._depth -= deleted
            self._bytes -= freed
            return deleted

    # -- reporting ---------------------------------------------------------------------

    def stats(self) -> OutboxStats:
        with self._lock:
            conn = self._db.conn
            oldest = conn.execute("SELECT ts FROM outbox ORDER BY id LIMIT 1").fetchone()
            first = oldest[0] if oldest else (self._buffer[0][4] if self._buffer else None)
            counters = dict(conn.execute("SELECT name, value FROM counters").fetchall())
            return OutboxStats(
                self._depth, self._bytes,
                max(0.0, self._clock() - first) if first is not None else 0.0,
                len(self._buffer), int(counters.get("dropped_rows", 0)),
                int(counters.get("dropped_bytes", 0)), self._refused)

    def close(self) -> None:
        """Commits what is buffered, then closes the file (closed even if the commit fails)."""
        with self._lock:
            try:
                self.flush()
            finally:
                self._db.close()

    # -- inside -------------------------------------------------------------------------

    def _drop(self, depth: int, size: int) -> tuple[int, int]:
        """Inside the flush's transaction: deletes the oldest metrics rows until the outbox
        is at 90% of its budget (so a full outbox does not drop and report at every flush),
        appends the report; the new (depth, bytes)."""
        conn = self._db.conn
        need = size - (self.max_bytes - self.max_bytes // 10)
        chosen: list[tuple[int, str, int, int]] = []
        freed = 0
        for row in conn.execute("SELECT id, boot_id, seq, size FROM outbox "
                                "WHERE class = ? ORDER BY id", [METRICS]):
            chosen.append(row)
            freed += row[3]
            if freed >= need:
                break
        if not chosen:
            if not self._over_budget_logged:
                log.warning("outbox holds %d bytes of audit rows, over its budget of %d; "
                            "audit rows are never dropped", size, self.max_bytes)
                self._over_budget_logged = True
            return depth, size
        self._over_budget_logged = False
        conn.execute("DELETE FROM outbox WHERE class = ? AND id <= ?", [METRICS, chosen[-1][0]])
        depth, size = depth - len(chosen), size - freed
        for body in _drop_reports(chosen):
            seq, ts = self._next_seq, self._clock()
            data = encode(build(self.device, self.boot_id, seq, "events", AUDIT, body, ts))
            conn.execute("INSERT INTO outbox (boot_id, seq, kind, class, ts, payload, size) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         [self.boot_id, seq, "events", AUDIT, ts, data, len(data)])
            self._next_seq = seq + 1
            depth, size = depth + 1, size + len(data)
        for name, value in (("dropped_rows", len(chosen)), ("dropped_bytes", freed)):
            conn.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
                         "SET value = value + excluded.value", [name, value])
        log.warning("outbox over its budget of %d bytes: dropped %d metrics rows (%d bytes), "
                    "reported", self.max_bytes, len(chosen), freed)
        return depth, size

    def _move_aside_if_corrupt(self) -> str | None:
        """Moves a corrupt file aside (never deletes it); the reason, or None if sound."""
        reason = _corruption(self.path)
        if reason is None:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.replace(self.path, target)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                os.replace(side, target.with_name(target.name + suffix))
        log.error("outbox %s is corrupt (%s): moved to %s, starting a new one", self.path,
                  reason, target)
        self.corrupt_moved = target
        return reason


def _drop_reports(chosen: list[tuple[int, str, int, int]]) -> list[dict[str, Any]]:
    """`outbox.dropped` bodies for rows in id order (seqs rise within a boot): runs of
    consecutive seqs per boot, at most MAX_RANGES_PER_EVENT runs per body."""
    reports: list[dict[str, Any]] = []
    runs: dict[str, list[list[int]]] = {}
    count = size = n_runs = 0
    for _, boot_id, seq, row_size in chosen:
        boot_runs = runs.setdefault(boot_id, [])
        if boot_runs and boot_runs[-1][1] + 1 == seq:
            boot_runs[-1][1] = seq
        else:
            if n_runs == MAX_RANGES_PER_EVENT:
                reports.append(_report(count, size, runs))
                runs, count, size, n_runs = {boot_id: []}, 0, 0, 0
                boot_runs = runs[boot_id]
            boot_runs.append([seq, seq])
            n_runs += 1
        count, size = count + 1, size + row_size
    if count:
        reports.append(_report(count, size, runs))
    return reports


def _report(count: int, size: int, runs: dict[str, list[list[int]]]) -> dict[str, Any]:
    return {"event": "outbox.dropped", "class": METRICS, "count": count, "bytes": size,
            "ranges": {b: r for b, r in runs.items() if r}}


def _corruption(path: Path) -> str | None:
    """Why `path` is not a sound SQLite database, or None (also when it does not exist).
    Errors that are not corruption (locked, unreadable) are raised, not reported: the file
    may be fine and must stay where it is."""
    if not path.exists():
        return None
    try:
        # Read-only: a read-write connection would checkpoint (or delete) the -wal on close
        # and so change the evidence that is to be moved aside.
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
        try:
            rows = conn.execute("PRAGMA integrity_check").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _CORRUPT_CODES:
            return f"{type(exc).__name__}: {exc}"
        raise
    if rows != [("ok",)]:
        return "integrity_check: " + "; ".join(str(r[0]) for r in rows[:3])
    return None


def _open(path: Path) -> Database:
    return open_durable(path, MIGRATIONS)  # used only under the outbox's lock
