"""Retention: the purge the server runs every hour and `edge-agent ledger purge` on demand."""

from __future__ import annotations

import time
from pathlib import Path

from edge_agent.config import RetentionSettings
from edge_agent.ledger.store import open_ledger, purge


def purge_expired(path: Path, retention: RetentionSettings) -> int:
    """Deletes request rows older than `retention.ledger_days` and stored content older than
    `retention.content_hours` from the ledger at `path`; returns the request rows removed."""
    db = open_ledger(path)
    try:
        return purge(db, older_than_s=retention.ledger_days * 86400,
                     content_older_than_s=retention.content_hours * 3600)
    finally:
        db.close()


def purge_before(path: Path, before: float, retention: RetentionSettings) -> int:
    """Deletes request rows older than `before` (unix time) as well as what retention says
    (the fleet's `ledger.purge` with a date); returns the request rows removed."""
    now = time.time()
    db = open_ledger(path)
    try:
        return purge(db, older_than_s=min(retention.ledger_days * 86400, max(0.0, now - before)),
                     content_older_than_s=min(retention.content_hours * 3600,
                                              max(0.0, now - before)))
    finally:
        db.close()
