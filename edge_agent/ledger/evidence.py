"""Release evidence in the ledger database: one row per activation attempt of a rollout —
which release (name, version, digest) replaced which digest, on what (agent and llama.cpp
versions, hardware), with which effective parameters, every gate check with its figure,
the seconds spent in each state, and the outcome.

Written by the rollout runner (a handful of rows a month: its own short connection,
beside the request writer's; WAL lets both be), read by `edge-agent models history`.
Also holds the one read the gate's soak needs: the real requests a version served since
its switch. Never holds prompt or completion text.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge_agent.ledger.store import EVIDENCE, EVIDENCE_COLUMNS, REQUESTS, open_ledger

JSON_COLUMNS = ("hardware", "parameters", "checks", "timings")


def record_evidence(path: Path, row: Mapping[str, Any]) -> None:
    """Inserts (or, for the same id, replaces) one evidence row; JSON columns may be given
    as objects."""
    unknown = set(row) - set(EVIDENCE_COLUMNS)
    if unknown:
        raise ValueError(f"evidence: unknown column(s) {sorted(unknown)}")
    values = {k: (json.dumps(v, allow_nan=False, sort_keys=True)
                  if k in JSON_COLUMNS and not isinstance(v, str) else v)
              for k, v in row.items()}
    db = open_ledger(path)
    try:
        with db.conn:
            db[EVIDENCE].insert(values, replace=True)  # type: ignore[union-attr]
    finally:
        db.close()


def evidence_for(path: Path, name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The evidence rows of `name`, newest first, JSON columns decoded; [] when the ledger
    or its evidence table does not exist (nothing is created by reading)."""
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                        [EVIDENCE]).fetchone() is None:
            return []
        sql = f"SELECT * FROM {EVIDENCE} WHERE name = ? ORDER BY ts DESC"
        rows = conn.execute(sql + (" LIMIT ?" if limit else ""),
                            [name, limit] if limit else [name]).fetchall()
    finally:
        conn.close()
    out = []
    for r in rows:
        d = dict(r)
        for key in JSON_COLUMNS:
            d[key] = json.loads(d[key]) if d.get(key) else None
        out.append(d)
    return out


def served_since(path: Path, model: str, digest: str, since: float,
                 limit: int) -> list[dict[str, Any]]:
    """The first `limit` request rows `digest` of `model` answered since `since` (status
    and error type only), oldest first; [] without a ledger."""
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                        [REQUESTS]).fetchone() is None:
            return []
        rows = conn.execute(
            f"SELECT ts, status, error_type FROM {REQUESTS} WHERE model = ? AND "
            "model_digest = ? AND ts >= ? ORDER BY ts LIMIT ?",
            [model, digest, since, limit]).fetchall()
    finally:
        conn.close()
    return [{"ts": r[0], "status": r[1], "error_type": r[2]} for r in rows]
