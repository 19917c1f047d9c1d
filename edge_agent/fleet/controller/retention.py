"""How long the controller keeps what boxes sent: `messages` older than the retention of
their class (`[retention] metrics_days`, `audit_days`) go, in batches, once an hour.

A fleet's metrics arrive every minute from every box; kept for ever they fill the
controller's disk, and a full disk stops the ingest, so nothing more is acknowledged and
every box's outbox grows. Prometheus (`/metrics`) is where history lives long; the store
keeps what status, evidence and loss accounting need.

    retired    one row per (device, boot): the highest seq removed by retention. Loss
               accounting (`gaps`) counts seqs up to it as accounted for: a purge is not
               a loss, and losses older than the retention are not reported any more.

`RetentionQueries` is what `sql.SQLStore.retention` holds (SQLite and PostgreSQL alike); `Retention`
is the thread `fleet serve` runs. A batch is one transaction (never one long lock over
the whole table); a failed pass is logged and tried again at the next. The service levels
over time (`slo_intervals`, `slo_errors`, `slo_minutes`, `slo_degradations`) go with the
metrics: those that ended before the metrics' cutoff. Must never delete a message younger
than its class's retention, or anything but `messages` and those four.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from edge_agent.fleet.controller.transaction import Exec
from edge_agent.fleet.protocol.envelope import AUDIT, METRICS

if TYPE_CHECKING:
    from edge_agent.config.controller import RetentionSettings

log = logging.getLogger(__name__)

DAY_S = 86400.0

# The watermark only moves up (GREATEST is PostgreSQL's, max() SQLite's: CASE is both's).
_HIGHER = ("CASE WHEN excluded.last_seq > retired.last_seq THEN excluded.last_seq "
           "ELSE retired.last_seq END")


class RetentionQueries:
    """The purge, each call in a transaction of the store that holds this object
    (`sql.SQLStore.retention`): `tx` opens a write, `read` a read."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Exec]],
                 read: Callable[[], AbstractContextManager[Exec]]) -> None:
        self._tx = tx
        self._read = read

    def purge_messages(self, before: Mapping[str, float], batch: int = 5000) -> int:
        """Removes the messages of each class received before its cutoff (controller
        time), `batch` per transaction, oldest first; how many went."""
        removed = 0
        for cls, cutoff in sorted(before.items()):
            while True:
                with self._tx() as db:
                    rows = db.rows("SELECT device, boot_id, seq FROM messages WHERE class = ? "
                                   "AND received < ? ORDER BY received LIMIT ?",
                                   [cls, cutoff, batch])
                    if not rows:
                        break
                    db.many("DELETE FROM messages WHERE device = ? AND boot_id = ? AND seq = ?",
                            rows)
                    highest: dict[tuple[str, str], int] = {}
                    for device, boot_id, seq in rows:
                        key = (device, boot_id)
                        highest[key] = max(highest.get(key, 0), int(seq))
                    db.many("INSERT INTO retired (device, boot_id, last_seq) VALUES (?, ?, ?) "
                            f"ON CONFLICT (device, boot_id) DO UPDATE SET last_seq = {_HIGHER}",
                            [(d, b, s) for (d, b), s in highest.items()])
                removed += len(rows)
                if len(rows) < batch:
                    break
        if METRICS in before:
            removed += self._purge_slo(before[METRICS], batch)
        return removed

    def _purge_slo(self, cutoff: float, batch: int) -> int:
        """The service levels (`slo`) go with the metrics they came from: intervals, error
        counts and minutes that ended (the box's time) before the metrics' cutoff."""
        removed = 0
        for table in ("slo_intervals", "slo_errors"):
            while True:
                with self._tx() as db:
                    gone = db.run(
                        f"DELETE FROM {table} WHERE (device, boot_id, seq) IN (SELECT device, "
                        f"boot_id, seq FROM {table} WHERE end_ts < ? ORDER BY end_ts "
                        f"LIMIT ?)", [cutoff, batch])
                removed += gone
                if gone < batch:
                    break
        with self._tx() as db:  # one row per minute, fleet and model: few
            # Minute m holds the intervals that ended in (60m, 60m + 60].
            for table in ("slo_minutes", "slo_degradations"):
                removed += db.run(f"DELETE FROM {table} WHERE minute * 60 + 60 < ?", [cutoff])
        return removed

    def retired(self, device: str, boot_id: str) -> int:
        """The highest seq of (device, boot) that retention removed; 0 when none."""
        with self._read() as db:
            found = db.rows("SELECT last_seq FROM retired WHERE device = ? AND boot_id = ?",
                            [device, boot_id])
        return int(found[0][0]) if found else 0


class Purger(Protocol):
    def purge_messages(self, before: Mapping[str, float], batch: int = 5000) -> int: ...


def cutoffs(settings: RetentionSettings, now: float) -> dict[str, float]:
    """Each class's cutoff (received before it: removed); a class kept for ever has none."""
    days = {METRICS: settings.metrics_days, AUDIT: settings.audit_days}
    return {cls: now - d * DAY_S for cls, d in days.items() if d is not None}


class Retention:
    """`start()` the thread, `stop()` it; `run_once()` is one pass (tests call it)."""

    def __init__(self, settings: RetentionSettings, store: Purger, *,
                 clock: Callable[[], float] = time.time,
                 leading: Callable[[], bool] = lambda: True) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.leading = leading  # beside other controllers: only the leader purges
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not cutoffs(self.settings, 0.0):
            return  # everything kept for ever: no thread
        self._thread = threading.Thread(target=self._run, name="fleet-retention", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.leading():
                    self.run_once()
            except Exception:  # the next pass tries again; the ingest goes on meanwhile
                log.exception("fleet retention: this pass failed; trying again in %.0f s",
                              self.settings.every_s)
            self._stop.wait(self.settings.every_s)

    def run_once(self) -> int:
        removed = self.store.purge_messages(cutoffs(self.settings, self.clock()),
                                            self.settings.batch)
        if removed:
            log.info("fleet retention: removed %d message(s) older than their retention",
                     removed)
        return removed
