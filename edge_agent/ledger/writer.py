"""The ledger writer: requests hand rows to a queue and return at once; one thread
commits them in batches (one transaction per `window_s`), so a crash loses at most the
last window and the file is never left half-written (WAL)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

from edge_agent.ledger.store import COLUMNS, REQUESTS, open_ledger

log = logging.getLogger(__name__)
_STOP = object()


class LedgerWriter:
    def __init__(self, path: Path, *, window_s: float = 0.2) -> None:
        self.path = path
        self.window_s = window_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._oldest_pending: float | None = None
        self.rows_written = 0
        self.healthy = True
        self.last_error = ""
        self._flushed = threading.Condition()
        self._submitted = 0
        self._committed = 0
        open_ledger(path).close()  # create and migrate before serving
        self._thread = threading.Thread(target=self._run, name="ledger", daemon=True)
        self._thread.start()

    def record(self, row: dict[str, Any], table: str = REQUESTS) -> None:
        """Never blocks, never raises: the request path must not wait on disk."""
        if table == REQUESTS:
            row = {k: v for k, v in row.items() if k in COLUMNS}
        if self._oldest_pending is None:
            self._oldest_pending = time.monotonic()
        self._submitted += 1
        self._queue.put((table, row))

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
            batch: list[tuple[str, dict[str, Any]]] = []
            item = self._queue.get()
            deadline = time.monotonic() + self.window_s
            while True:
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if batch:
                self._commit(db, batch)
        db.close()

    def _commit(self, db: Any, batch: list[tuple[str, dict[str, Any]]]) -> None:
        by_table: dict[str, list[dict[str, Any]]] = {}
        for table, row in batch:
            by_table.setdefault(table, []).append(row)
        try:
            with db.atomic():
                for table, rows in by_table.items():
                    db[table].insert_all(rows, replace=table == REQUESTS)
            self.rows_written += len(batch)
            self.healthy = True
        except Exception as exc:  # disk full, file gone: report, keep the process alive
            self.healthy = False
            self.last_error = str(exc)
            log.error("ledger write of %d rows failed: %s", len(batch), exc)
        with self._flushed:
            self._committed += len(batch)
            self._flushed.notify_all()
        self._oldest_pending = None if self._queue.empty() else time.monotonic()
