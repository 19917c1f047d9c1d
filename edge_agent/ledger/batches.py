"""The batch queue's durable state: uploaded files, batches and each line's state, in
`batches.db` (sqlite-utils migrations, WAL), the files' bytes beside it in
`batches/<file id>.jsonl`, all owner-only like the rest of the state dir.

Why a database of its own: the ledger is written off the request path, a window at a
time, and may lose its last window in a crash; a batch line's result must be committed
with its state in one transaction, so that a kill -9 loses no finished line and redoes
none (lines running at the kill are still `pending`, and run again). What the store keeps
is content (prompts and answers): retention (`retention.batch_days`) purges it.

Thread-safe: one connection, one lock; every method is one short transaction.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.files import inside
from edge_agent.owner_only import FILE_MODE, private_dir, private_file

MIGRATIONS = Migrations("edge-agent-batches")
FILES, BATCHES, LINES = "files", "batches", "lines"
# A batch's life, as OpenAI names it; the last four end it.
OPEN_STATES = ("validating", "in_progress", "finalizing", "cancelling")
DONE_STATES = ("completed", "failed", "expired", "cancelled")
# A line's: `pending` (also while it runs: a crash runs it again), `done` (its output line
# stored), `error` (its error line stored), `cancelled` (never ran: the batch was cancelled).
LINE_STATES = ("pending", "done", "error", "cancelled")


@MIGRATIONS()
def m001_files_batches_lines(db: Database) -> None:
    db[FILES].create({  # type: ignore[union-attr]
        "id": str, "tenant": str, "filename": str, "purpose": str, "bytes": int,
        "created_at": int, "expires_at": int, "lines": int}, pk="id")
    db[FILES].create_index(["tenant", "created_at"])  # type: ignore[union-attr]
    db[BATCHES].create({  # type: ignore[union-attr]
        "id": str, "tenant": str, "key_prefix": str, "endpoint": str,
        "input_file_id": str, "completion_window": str, "status": str,
        "created_at": int, "expires_at": int, "in_progress_at": int, "finalizing_at": int,
        "completed_at": int, "failed_at": int, "expired_at": int, "cancelling_at": int,
        "cancelled_at": int, "output_file_id": str, "error_file_id": str,
        "metadata": str, "errors": str, "total": int, "completed": int, "failed": int},
        pk="id")
    db[BATCHES].create_index(["tenant", "created_at"])  # type: ignore[union-attr]
    db[BATCHES].create_index(["status"])  # type: ignore[union-attr]
    db[LINES].create({  # type: ignore[union-attr]
        "batch_id": str, "idx": int, "line_id": str, "custom_id": str, "body": str,
        "state": str, "result": str, "finished_at": float}, pk=("batch_id", "idx"))
    db[LINES].create_index(["batch_id", "state", "idx"])  # type: ignore[union-attr]


class BatchStore:
    """`batches.db` and the file blobs under `state_dir`."""

    def __init__(self, state_dir: Path) -> None:
        self.blobs = private_dir(state_dir / "batches")
        path = private_file(state_dir / "batches.db")
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db = Database(self._conn)
        self.db.enable_wal()
        self.db.execute("PRAGMA synchronous = NORMAL")  # WAL: a process kill loses nothing
        MIGRATIONS.apply(self.db)
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[Database]:
        with self._lock, self.db.atomic():
            yield self.db

    def _one(self, sql: str, params: list[Any]) -> dict[str, Any] | None:
        with self._lock:
            cur = self.db.execute(sql, params)
            row = cur.fetchone()
            if row is None:
                return None
            return dict(zip([c[0] for c in cur.description], row, strict=True))

    def _all(self, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        with self._lock:
            cur = self.db.execute(sql, params)
            names = [c[0] for c in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    # -- files ---------------------------------------------------------------------------
    def blob(self, file_id: str) -> Path:
        return inside(self.blobs, f"{file_id}.jsonl")

    def write_blob(self, file_id: str, data: bytes) -> None:
        """The file's bytes, 0600 from the start, fsynced before its row is committed."""
        path = self.blob(file_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def add_file(self, row: dict[str, Any], data: bytes) -> None:
        self.write_blob(row["id"], data)
        with self._tx() as db:
            db[FILES].insert(row)  # type: ignore[union-attr]

    def file(self, file_id: str) -> dict[str, Any] | None:
        return self._one(f"SELECT * FROM {FILES} WHERE id = ?", [file_id])

    def files(self, tenant: str, *, purpose: str | None = None) -> list[dict[str, Any]]:
        sql, params = f"SELECT * FROM {FILES} WHERE tenant = ?", [tenant]
        if purpose is not None:
            sql, params = sql + " AND purpose = ?", [tenant, purpose]
        return self._all(sql + " ORDER BY created_at DESC, id DESC", params)

    def content(self, file_id: str) -> bytes:
        return self.blob(file_id).read_bytes()

    def delete_file(self, file_id: str) -> None:
        with self._tx() as db:
            db.execute(f"DELETE FROM {FILES} WHERE id = ?", [file_id])
        self.blob(file_id).unlink(missing_ok=True)

    # -- batches -------------------------------------------------------------------------
    def add_batch(self, row: dict[str, Any], lines: list[tuple[str, str, str]]) -> None:
        """The batch and its lines (line id, custom_id, body as JSON text), together."""
        with self._tx() as db:
            db[BATCHES].insert(row)  # type: ignore[union-attr]
            db[LINES].insert_all(  # type: ignore[union-attr]
                ({"batch_id": row["id"], "idx": i, "line_id": line_id, "custom_id": cid,
                  "body": body, "state": "pending"}
                 for i, (line_id, cid, body) in enumerate(lines)), batch_size=500)

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        return self._one(f"SELECT * FROM {BATCHES} WHERE id = ?", [batch_id])

    def batches(self, tenant: str) -> list[dict[str, Any]]:
        return self._all(f"SELECT * FROM {BATCHES} WHERE tenant = ? "
                         "ORDER BY created_at DESC, rowid DESC", [tenant])

    def open_batches(self) -> list[dict[str, Any]]:
        """Every batch not ended, oldest first: the runner's work, after a restart too."""
        marks = ",".join("?" * len(OPEN_STATES))
        return self._all(f"SELECT * FROM {BATCHES} WHERE status IN ({marks}) "
                         "ORDER BY created_at, rowid", list(OPEN_STATES))

    def set_status(self, batch_id: str, status: str, **fields: Any) -> None:
        with self._tx() as db:
            db[BATCHES].update(batch_id, {"status": status,  # type: ignore[union-attr]
                                          f"{status}_at": int(time.time()), **fields})

    def pending(self, batch_id: str, *, skip: set[int], limit: int) -> list[dict[str, Any]]:
        """The next pending lines in file order, those in `skip` (running now) left out."""
        rows = self._all(f"SELECT idx, line_id, custom_id, body FROM {LINES} "
                         "WHERE batch_id = ? AND state = 'pending' ORDER BY idx LIMIT ?",
                         [batch_id, limit + len(skip)])
        return [r for r in rows if r["idx"] not in skip][:limit]

    def finish_line(self, batch_id: str, idx: int, state: str, result: dict[str, Any]
                    ) -> bool:
        """A line's result and state, and its batch's counts, in one transaction; False
        when the line was no longer pending (cancelled or expired meanwhile)."""
        column = "completed" if state == "done" else "failed"
        with self._tx() as db:
            cur = db.execute(f"UPDATE {LINES} SET state = ?, result = ?, finished_at = ? "
                             "WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                             [state, json.dumps(result, ensure_ascii=False), time.time(),
                              batch_id, idx])
            if cur.rowcount != 1:
                return False
            db.execute(f"UPDATE {BATCHES} SET {column} = {column} + 1 WHERE id = ?",
                       [batch_id])
        return True

    def close_pending(self, batch_id: str, state: str,
                      result: dict[str, Any] | None = None) -> int:
        """Every line still pending ends as `state` (cancelled, or error with `result`:
        its line id and custom_id are filled in per line)."""
        with self._tx() as db:
            rows = db.execute(f"SELECT idx, line_id, custom_id FROM {LINES} "
                              "WHERE batch_id = ? AND state = 'pending'",
                              [batch_id]).fetchall()
            for idx, line_id, custom_id in rows:
                text = None if result is None else json.dumps(
                    {**result, "id": line_id, "custom_id": custom_id}, ensure_ascii=False)
                db.execute(f"UPDATE {LINES} SET state = ?, result = ?, finished_at = ? "
                           "WHERE batch_id = ? AND idx = ?",
                           [state, text, time.time(), batch_id, idx])
            if state == "error" and rows:
                db.execute(f"UPDATE {BATCHES} SET failed = failed + ? WHERE id = ?",
                           [len(rows), batch_id])
        return len(rows)

    def count_pending(self, batch_id: str) -> int:
        row = self._one(f"SELECT count(*) AS n FROM {LINES} WHERE batch_id = ? "
                        "AND state = 'pending'", [batch_id])
        return int(row["n"]) if row else 0

    def results(self, batch_id: str, state: str) -> list[str]:
        with self._lock:
            return [r[0] for r in self.db.execute(
                f"SELECT result FROM {LINES} WHERE batch_id = ? AND state = ? "
                "ORDER BY idx", [batch_id, state]).fetchall()]

    def finalize(self, batch_id: str, status: str, outputs: list[dict[str, Any]],
                 blobs: dict[str, bytes]) -> None:
        """The batch's output and error files (rows in `outputs`, bytes in `blobs`) and its
        final status, together: the blobs are written first, so a crash before the commit
        leaves at most unreferenced bytes, and the batch is finalized again."""
        for row in outputs:
            self.write_blob(row["id"], blobs[row["id"]])
        ids = {row["purpose_kind"]: row["id"] for row in outputs}
        with self._tx() as db:
            for row in outputs:
                db[FILES].insert({k: v for k, v in row.items()  # type: ignore[union-attr]
                                  if k != "purpose_kind"})
            db[BATCHES].update(batch_id, {  # type: ignore[union-attr]
                "status": status, f"{status}_at": int(time.time()),
                "output_file_id": ids.get("output"), "error_file_id": ids.get("error")})

    # -- retention -----------------------------------------------------------------------
    def purge(self, *, older_than_s: float) -> int:
        """Files and ended batches (their lines with them) created before the window;
        returns the files removed. Open batches are kept whatever their age."""
        cutoff = int(time.time() - older_than_s)
        marks = ",".join("?" * len(DONE_STATES))
        with self._tx() as db:
            old = [r[0] for r in db.execute(
                f"SELECT id FROM {FILES} WHERE created_at < ?", [cutoff]).fetchall()]
            db.execute(f"DELETE FROM {FILES} WHERE created_at < ?", [cutoff])
            db.execute(f"DELETE FROM {LINES} WHERE batch_id IN (SELECT id FROM {BATCHES} "
                       f"WHERE created_at < ? AND status IN ({marks}))",
                       [cutoff, *DONE_STATES])
            db.execute(f"DELETE FROM {BATCHES} WHERE created_at < ? AND status IN ({marks})",
                       [cutoff, *DONE_STATES])
        for file_id in old:
            self.blob(file_id).unlink(missing_ok=True)
        return len(old)
