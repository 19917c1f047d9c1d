"""Ledger summaries for the fleet: what `ledger.db` recorded since the last summary, as
counts — and the watermark that makes each row counted exactly once across restarts.

Reads `ledger.db` through its own read-only SQLite connection (`mode=ro`; WAL, so it
never blocks the writer), one read transaction per summary (every count from one
snapshot). Selects only these columns: requests (`tenant`, `model`, `model_digest`,
`status`, `error_type`, the token counts, `ttft_ms`, `tpot_ms`, `ts`), redactions
(`entity_type`, `direction`, joined on the request id) and rejected-row markers
(`table_name`, `reason`). Must never read the `contents` table, a span's offsets, the
end-user digest or the client's trace id, and never writes the ledger.

Which rows: by `rowid`, not by time. A request's row carries its *start* time and is
committed at its end (plus the writer's batch window), so a time window would miss a
long request that started before the watermark and ended after it. Rowids grow in commit
order (the ledger never updates a row in place, and retention deletes the oldest), so
"rowid above the watermark" is exactly "committed since the last summary".

Watermark (`<state_dir>/fleet-sync.json`, replaced atomically, fsync'd): the last rowid
summarised and that row's id, the rejected-markers' rowid, and the end of the last
interval. Each summary goes through an intent: the range is written to the file
(`pending`) before the message is emitted and cleared after, so a crash at any point
repeats *the same range* at the next start — never a different one (no row skipped, none
counted in two different summaries). The one duplicate possible (a crash between the
outbox commit and clearing the intent) carries the same `rows.after`/`rows.through`, so
the controller can recognise it.

A ledger whose rowids went back (the file replaced, or every row purged so SQLite counts
from 1 again) is noticed — the watermark row is gone and the highest rowid is below it,
or the row at the watermark's rowid is another request — and summarised from its start.

Model names: a row keeps its model name when it was served (`model_digest` set) or the
name is installed now; any other name is a client's string and is counted as `(other)`.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_agent.files import atomic_write

log = logging.getLogger(__name__)
STATE_FILE = "fleet-sync.json"
OTHER_MODEL = "(other)"
NO_MODEL = "(none)"
_VERSION = 1


@contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read transaction on `path`, never a write: FileNotFoundError when it is absent."""
    if not path.exists():
        raise FileNotFoundError(path)
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True,
                           isolation_level=None)
    with closing(conn):
        conn.execute("BEGIN")  # one snapshot for every query of the caller
        try:
            yield conn
        finally:
            conn.execute("ROLLBACK")


def max_rowid(path: Path) -> int:
    with read_only(path) as conn:
        return int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM requests").fetchone()[0])


def latencies(path: Path, after: int) -> tuple[dict[str, tuple[list[float], list[float]]], int]:
    """TTFT and TPOT (ms) of the successful requests committed after rowid `after`, by
    model, and the highest rowid read (`after` again when none). A TPOT needs two output
    tokens, as in the Prometheus histogram. Rowids gone back (see module) count from 0."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    with read_only(path) as conn:
        top = int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM requests").fetchone()[0])
        if top < after:
            after = 0
        for model, ttft, tpot, completion in conn.execute(
                "SELECT model, ttft_ms, tpot_ms, completion_tokens FROM requests "
                "WHERE rowid > ? AND rowid <= ? AND status = 200 AND ttft_ms IS NOT NULL",
                [after, top]):
            ttfts, tpots = out.setdefault(str(model or NO_MODEL), ([], []))
            ttfts.append(float(ttft))
            if tpot is not None and (completion or 0) > 1:
                tpots.append(float(tpot))
    return out, max(top, after)


@dataclass(frozen=True)
class Range:
    """Rows (after, through] of `requests` and of `rejected_rows`, and the interval."""

    after: int
    through: int
    through_id: str | None  # the request id at `through`: tells a reused rowid apart
    rejected_after: int
    rejected_through: int
    start: float | None  # end of the previous summary; None: the first one
    end: float


@dataclass
class Watermark:
    rowid: int = 0
    row_id: str | None = None
    rejected_rowid: int = 0
    end: float | None = None
    pending: Range | None = None


class LedgerSummaries:
    """Computes the next summary and keeps the watermark. Not thread-safe: one caller
    (`Sync`'s ledger tick) at a time."""

    def __init__(self, ledger_path: Path, state_path: Path,
                 known_model: Callable[[str], bool] | None = None) -> None:
        self.ledger_path = ledger_path
        self.state_path = state_path
        self.known_model = known_model
        self.mark = load(state_path)

    def prepare(self, now: float) -> tuple[Range, dict[str, Any]] | None:
        """The next range and its body, its intent persisted; None when nothing was
        committed since the last summary (or the ledger does not exist yet). A pending
        range (a summary that may not have been emitted) is repeated as it was."""
        mark = self.mark
        try:
            with read_only(self.ledger_path) as conn:
                rng = mark.pending or self._next_range(conn, now)
                if rng is None:
                    return None
                body = self._summarise(conn, rng)
        except FileNotFoundError:
            return None
        if mark.pending is None:
            mark.pending = rng
            save(self.state_path, mark)
        return rng, body

    def commit(self, rng: Range) -> None:
        """The summary of `rng` is in the outbox: the watermark moves past it."""
        self.mark = Watermark(rng.through, rng.through_id, rng.rejected_through, rng.end, None)
        save(self.state_path, self.mark)

    def _next_range(self, conn: sqlite3.Connection, now: float) -> Range | None:
        mark = self.mark
        top = int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM requests").fetchone()[0])
        after = mark.rowid
        if after:
            at = conn.execute("SELECT id FROM requests WHERE rowid = ?", [after]).fetchone()
            if (at is None and top < after) or (at is not None and at[0] != mark.row_id):
                log.warning("ledger rowids went back (file replaced or emptied): summarising "
                            "it from its first row")
                after = 0
        rejected_top = int(conn.execute(
            "SELECT COALESCE(MAX(rowid), 0) FROM rejected_rows").fetchone()[0])
        rejected_after = mark.rejected_rowid if mark.rejected_rowid <= rejected_top else 0
        if top == after and rejected_top == rejected_after:
            return None
        through_id = None
        if top > after:
            through_id = str(conn.execute("SELECT id FROM requests WHERE rowid = ?",
                                          [top]).fetchone()[0])
        elif top == after:
            through_id = mark.row_id
        return Range(after, max(top, after), through_id, rejected_after, rejected_top,
                     mark.end, now)

    def _summarise(self, conn: sqlite3.Connection, rng: Range) -> dict[str, Any]:
        window = [rng.after, rng.through]
        known: dict[str, bool] = {}
        by: dict[tuple[str, str, int, str], list[int]] = {}
        first_ts: float | None = None
        for tenant, model, served, status, error_type, n, prompt, cached, completion, ts0 in (
                conn.execute(
                    "SELECT tenant, model, COALESCE(model_digest, '') != '', status, "
                    "COALESCE(error_type, ''), COUNT(*), COALESCE(SUM(prompt_tokens), 0), "
                    "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
                    "MIN(ts) FROM requests WHERE rowid > ? AND rowid <= ? "
                    "GROUP BY 1, 2, 3, 4, 5", window)):
            key = (str(tenant or ""), self._model(model, bool(served), known),
                   int(status or 0), str(error_type))
            sums = by.setdefault(key, [0, 0, 0, 0])
            for i, v in enumerate((n, prompt, cached, completion)):
                sums[i] += int(v)
            if ts0 is not None and (first_ts is None or ts0 < first_ts):
                first_ts = float(ts0)
        redactions: dict[tuple[str, str, str], int] = {}
        for tenant, entity, direction, n in conn.execute(
                "SELECT r.tenant, x.entity_type, x.direction, COUNT(*) FROM redactions x "
                "JOIN requests r ON r.id = x.request_id WHERE r.rowid > ? AND r.rowid <= ? "
                "GROUP BY 1, 2, 3", window):
            key3 = (str(tenant or ""), str(entity or ""), str(direction or ""))
            redactions[key3] = redactions.get(key3, 0) + int(n)
        rejected = [{"table": str(t), "reason": str(r), "count": int(n)} for t, r, n in
                    conn.execute("SELECT table_name, reason, COUNT(*) FROM rejected_rows "
                                 "WHERE rowid > ? AND rowid <= ? GROUP BY 1, 2 ORDER BY 1, 2",
                                 [rng.rejected_after, rng.rejected_through])]
        return {
            "interval": {"start": rng.start if rng.start is not None else first_ts,
                         "end": rng.end},
            "rows": {"after": rng.after, "through": rng.through},
            "requests": sum(v[0] for v in by.values()),
            "by": [{"tenant": t, "model": m, "status": s, "error_type": e, "requests": v[0],
                    "prompt_tokens": v[1], "cached_tokens": v[2], "completion_tokens": v[3]}
                   for (t, m, s, e), v in sorted(by.items())],
            "redactions": [{"tenant": t, "entity_type": e, "direction": d, "count": n}
                           for (t, e, d), n in sorted(redactions.items())],
            "rejected_rows": rejected,
        }

    def _model(self, model: Any, served: bool, known: dict[str, bool]) -> str:
        """The name as sent: the row's own when the box served it or has it installed."""
        if not model:
            return NO_MODEL
        name = str(model)
        if served:
            return name
        if name not in known:
            try:
                known[name] = bool(self.known_model(name)) if self.known_model else False
            except Exception:  # an invalid name is not installed
                known[name] = False
        return name if known[name] else OTHER_MODEL


def load(path: Path) -> Watermark:
    """The persisted watermark; a fresh one when there is none (every row is new). A file
    that cannot be read is moved aside, not deleted, and counting starts over."""
    try:
        data = json.loads(path.read_text())
        if data.get("v") != _VERSION:
            raise ValueError(f"version {data.get('v')!r}")
        pending = data.get("pending")
        return Watermark(int(data["rowid"]), data.get("row_id"), int(data["rejected_rowid"]),
                         data.get("end"), Range(**pending) if pending else None)
    except FileNotFoundError:
        return Watermark()
    except (OSError, ValueError, TypeError, KeyError) as exc:
        aside = path.with_name(path.name + ".unreadable")
        log.error("fleet sync watermark %s unreadable (%s): moved to %s; the ledger is "
                  "summarised from its first row", path, exc, aside)
        os.replace(path, aside)
        return Watermark()


def save(path: Path, mark: Watermark) -> None:
    """Atomically, the rename fsynced too."""
    data = {"v": _VERSION, "rowid": mark.rowid, "row_id": mark.row_id,
            "rejected_rowid": mark.rejected_rowid, "end": mark.end,
            "pending": asdict(mark.pending) if mark.pending else None}
    atomic_write(path, json.dumps(data).encode(), sync_dir=True)
