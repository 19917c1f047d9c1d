"""The ledger writer: requests hand rows to a queue and return at once; one thread
commits them in batches (one transaction per `window_s`), so a crash loses at most the
last window and the file is never left half-written (WAL). Work whose only product is
rows (redacting text that is kept) is handed over the same way, as a job (`later`), and
runs there.

One row never costs another: every value is first made storable (text valid UTF-8 — a
lone surrogate becomes U+FFFD —, numbers finite and within SQLite's range, anything else
as text or NULL). If a batch still fails, its rows are written one by one, and a row that
fails alone is replaced by a marker in `rejected_rows` (table, request id, kind of error,
never the row's values). Only when the marker cannot be written either is the row lost,
and then the ledger itself is reported unhealthy.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.ledger.store import REJECTED, REQUESTS, TABLE_COLUMNS, open_ledger

log = logging.getLogger(__name__)
_STOP = object()
_SURROGATE = re.compile("[\ud800-\udfff]")
_INT64 = (-(2**63), 2**63 - 1)
_MARKER_KEY_CHARS = 128


def clean_text(value: str) -> str:
    """Text SQLite can store: UTF-8 cannot encode a lone surrogate, so it becomes U+FFFD."""
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


def _clean_number(value: Any, kind: type) -> int | float | None:
    if isinstance(value, int):  # bool included: stored as 0/1
        if _INT64[0] <= value <= _INT64[1]:
            return value
        return float(value) if kind is float else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None  # text or an object where a number belongs: NULL, not a guess


def _clean_text_value(value: Any) -> str | None:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    try:
        if isinstance(value, dict | list | tuple):
            return clean_text(json.dumps(value, ensure_ascii=False, default=str))
        return clean_text(str(value))
    except Exception:  # a circular structure, a __str__ that raises
        return None


def clean_value(value: Any, kind: type) -> Any:
    """`value` as a column of type `kind` can hold it (None stays None)."""
    if value is None:
        return None
    if kind is int or kind is float:
        return _clean_number(value, kind)
    return _clean_text_value(value)


def clean_row(table: str, row: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The row restricted to the table's columns with every value storable, and whether any
    value had to change (unknown keys are dropped silently: callers pass extra fields)."""
    columns = TABLE_COLUMNS[table]
    out: dict[str, Any] = {}
    changed = False
    for key, value in row.items():
        kind = columns.get(key) if isinstance(key, str) else None
        if kind is None:
            continue
        cleaned = clean_value(value, kind)
        if type(cleaned) is not type(value) or cleaned != value:
            changed = True
        out[key] = cleaned
    return out, changed


def _marker(table: str, row: Any, reason: str) -> dict[str, Any]:
    """A rejected-row marker: enough to count and trace the row, none of its values."""
    key: Any = None
    if isinstance(row, Mapping):
        key = row.get("id") if table == REQUESTS else row.get("request_id")
    key = _clean_text_value(key) if key is not None else None
    return {"ts": time.time(), "table_name": clean_text(str(table))[:64],
            "request_id": key[:_MARKER_KEY_CHARS] if key else None, "reason": reason}


# Work whose only product is ledger rows, (table, row) each, run on the writer thread.
DeferredJob = Callable[[], list[tuple[str, dict[str, Any]]]]


@dataclass(frozen=True)
class _Job:
    run: DeferredJob
    request_id: str | None  # for the marker when it fails


class LedgerWriter:
    def __init__(self, path: Path, *, window_s: float = 0.2) -> None:
        self.path = path
        self.window_s = window_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._oldest_pending: float | None = None
        self.rows_written = 0  # stored rows, sanitised ones included
        self.rows_sanitised = 0  # stored with at least one value changed
        self.rows_rejected = 0  # replaced by a marker in `rejected_rows`
        self.rows_lost = 0  # neither row nor marker could be written
        self.healthy = True
        self.last_error = ""
        self._flushed = threading.Condition()
        self._submitted = 0
        self._committed = 0
        open_ledger(path).close()  # create and migrate before serving
        self._thread = threading.Thread(target=self._run, name="ledger", daemon=True)
        self._thread.start()

    def record(self, row: dict[str, Any], table: str = REQUESTS) -> None:
        """Never blocks, never raises: the request path must not wait on disk. The row is
        copied here and checked on the writer thread."""
        try:
            item = (table, dict(row))
        except Exception:  # not a mapping: the writer thread turns it into a marker
            item = (table, row)
        self._put(item)

    def later(self, job: DeferredJob, *, request_id: str | None = None) -> None:
        """Never blocks, never raises: `job` runs on the writer thread and its rows
        (table, row) are committed with the batch it runs in. For work a request's answer
        need not wait for (redacting text only to keep it); `flush` waits for it too. A job
        that raises is logged and leaves a marker in `rejected_rows`, as a row that could
        not be stored does."""
        self._put(_Job(job, request_id))

    def _put(self, item: object) -> None:
        if self._oldest_pending is None:
            self._oldest_pending = time.monotonic()
        self._submitted += 1
        self._queue.put(item)

    @property
    def lag_s(self) -> float:
        """Age of the oldest row not yet committed (0 when all are)."""
        oldest = self._oldest_pending
        return time.monotonic() - oldest if oldest is not None else 0.0

    def flush(self, timeout: float = 10.0) -> bool:
        target = self._submitted
        with self._flushed:
            return self._flushed.wait_for(lambda: self._committed >= target, timeout)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        db = open_ledger(self.path)
        stopping = False
        while not stopping:
            batch: list[tuple[str, Any]] = []
            items = 0  # taken from the queue (a job may add several rows, or none)
            item = self._queue.get()
            deadline = time.monotonic() + self.window_s
            while True:
                if item is _STOP:
                    stopping = True
                    break
                items += 1
                if isinstance(item, _Job):
                    batch.extend(self._run_job(db, item))
                else:
                    batch.append(item)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if batch:
                try:
                    self._commit(db, batch)
                except Exception:  # a bug here must not end the thread: rows would pile up
                    log.exception("ledger writer failed on a batch of %d rows", len(batch))
                    self.rows_lost += len(batch)
            if items:
                self._done(items)
        db.close()

    def _run_job(self, db: Any, job: _Job) -> list[tuple[str, Any]]:
        try:
            return list(job.run())
        except Exception as exc:
            log.exception("ledger: a deferred job failed; its rows are not stored")
            self._reject(db, "deferred", {"request_id": job.request_id},
                         type(exc).__name__)
            return []

    def _done(self, n: int) -> None:
        with self._flushed:
            self._committed += n
            self._flushed.notify_all()
        self._oldest_pending = None if self._queue.empty() else time.monotonic()

    def _commit(self, db: Any, batch: list[tuple[str, Any]]) -> None:
        """One transaction for the batch; if it fails, one per row."""
        rows: list[tuple[str, dict[str, Any]]] = []
        sanitised = 0
        for table, row in batch:
            if table not in TABLE_COLUMNS or not isinstance(row, Mapping):
                self._reject(db, table, row, "unknown table" if table not in TABLE_COLUMNS
                             else "not a row")
                continue
            cleaned, changed = clean_row(table, row)
            rows.append((table, cleaned))
            sanitised += changed
        if sanitised:
            log.warning("ledger: %d of %d rows had values that could not be stored as given "
                        "(replaced)", sanitised, len(batch))
        self.rows_sanitised += sanitised
        by_table: dict[str, list[dict[str, Any]]] = {}
        for table, row in rows:
            by_table.setdefault(table, []).append(row)
        try:
            with db.atomic():
                for table, table_rows in by_table.items():
                    db[table].insert_all(table_rows, replace=table == REQUESTS)
        except Exception as exc:
            log.warning("ledger batch of %d rows failed (%s); writing row by row", len(rows),
                        type(exc).__name__)
            for i, (table, row) in enumerate(rows):
                if not self._insert_one(db, table, row):  # the file itself is not writable
                    self.rows_lost += len(rows) - i - 1
                    log.error("ledger: %d more rows of the batch lost", len(rows) - i - 1)
                    break
            return
        self.rows_written += len(rows)
        self.healthy = True

    def _insert_one(self, db: Any, table: str, row: dict[str, Any]) -> bool:
        """False when neither the row nor its marker could be written."""
        try:
            with db.atomic():
                db[table].insert(row, replace=table == REQUESTS)
        except Exception as exc:
            return self._reject(db, table, row, type(exc).__name__)
        self.rows_written += 1
        self.healthy = True
        return True

    def _reject(self, db: Any, table: Any, row: Any, reason: str) -> bool:
        """The row is replaced by a marker; the error's text is not kept (it may quote a
        value), only its kind. False when the marker could not be written either."""
        try:
            with db.atomic():
                db[REJECTED].insert(_marker(table, row, reason))
        except Exception as exc:  # disk full, file gone: report, keep the process alive
            self.rows_lost += 1
            self.healthy = False
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("ledger write failed, a %s row is lost: %s", clean_text(str(table))[:64],
                      self.last_error)
            return False
        self.rows_rejected += 1
        log.error("ledger: a %s row could not be written (%s); a marker was stored instead",
                  clean_text(str(table))[:64], reason)
        return True
