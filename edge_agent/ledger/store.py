"""The ledger database: schema as sqlite-utils migrations, WAL, and the queries the CLI
and the retention purge need. Rows hold metadata only — never prompt or completion text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.owner_only import private_file

REQUESTS = "requests"
MIGRATIONS = Migrations("edge-agent-ledger")

# The columns of a request row, in order; everything a row may carry.
COLUMNS: dict[str, type] = {
    "id": str, "trace_id": str, "ts": float, "tenant": str, "key_prefix": str,
    "dialect": str, "endpoint": str, "model": str, "model_digest": str, "status": int,
    "error_type": str, "prompt_tokens": int, "cached_tokens": int, "completion_tokens": int,
    "queue_ms": float, "ttft_ms": float, "tpot_ms": float, "total_ms": float,
    "done_reason": str, "truncated_tokens": int, "clamped": int, "structured_failure": int,
    "end_user": str, "ignored_fields": str, "risk_tier": str, "degradation": str,
    "degradation_reason": str, "requested_model": str, "batch_id": str,
    "quota_requests": int, "quota_tokens": int,
    "route": str, "upstream": str, "route_reason": str, "egress": str, "egress_entities": int,
    "egress_bytes": int, "upstream_ms": float,
    "feedback": str, "feedback_reason": str, "feedback_at": float,
}


@MIGRATIONS()
def m001_requests(db: Database) -> None:
    db[REQUESTS].create(COLUMNS, pk="id")  # type: ignore[union-attr]
    db[REQUESTS].create_index(["ts"])  # type: ignore[union-attr]
    db[REQUESTS].create_index(["model", "ts"])  # type: ignore[union-attr]
    db[REQUESTS].create_index(["tenant", "ts"])  # type: ignore[union-attr]


REDACTIONS = "redactions"
CONTENTS = "contents"


REDACTION_COLUMNS: dict[str, type] = {
    "request_id": str, "direction": str, "message_index": int, "entity_type": str,
    "detector": str, "detector_version": str, "operator": str, "start": int, "end": int,
    "policy_version": str}
CONTENT_COLUMNS: dict[str, type] = {"request_id": str, "direction": str, "message_index": int,
                                    "role": str, "text": str, "ts": float}


@MIGRATIONS()
def m002_redactions_and_contents(db: Database) -> None:
    """The redaction log (spans, never values) and short-lived redacted content."""
    db[REDACTIONS].create(REDACTION_COLUMNS)  # type: ignore[union-attr]
    db[REDACTIONS].create_index(["request_id"])  # type: ignore[union-attr]
    db[CONTENTS].create(CONTENT_COLUMNS)  # type: ignore[union-attr]
    db[CONTENTS].create_index(["ts"])  # type: ignore[union-attr]


REJECTED = "rejected_rows"
REJECTED_COLUMNS: dict[str, type] = {"ts": float, "table_name": str, "request_id": str,
                                     "reason": str}


@MIGRATIONS()
def m003_rejected_rows(db: Database) -> None:
    """A marker for each row that could not be written even after sanitising: which table,
    which request, and the kind of error (never the row's values)."""
    db[REJECTED].create(REJECTED_COLUMNS)  # type: ignore[union-attr]
    db[REJECTED].create_index(["ts"])  # type: ignore[union-attr]


@MIGRATIONS()
def m004_end_user(db: Database) -> None:
    """A client's end-user id (OpenAI `user`, `safety_identifier`), as a keyed digest."""
    if "end_user" not in db[REQUESTS].columns_dict:
        db[REQUESTS].add_column("end_user", str)  # type: ignore[union-attr]


EVIDENCE = "release_evidence"
# One row per activation attempt of a fleet rollout (`ledger.evidence` writes and reads
# them); the JSON columns hold what the gate measured, never a prompt or a client's text.
EVIDENCE_COLUMNS: dict[str, type] = {
    "id": str, "ts": float, "rollout_id": str, "attempt": int, "name": str,
    "version": str, "digest": str, "previous_digest": str, "outcome": str, "reason": str,
    "agent_version": str, "llama_cpp_version": str, "hardware": str, "parameters": str,
    "checks": str, "timings": str}


@MIGRATIONS()
def m005_release_evidence(db: Database) -> None:
    """Release evidence: kept like the model history, not purged with the request rows."""
    db[EVIDENCE].create(EVIDENCE_COLUMNS, pk="id")  # type: ignore[union-attr]
    db[EVIDENCE].create_index(["name", "ts"])  # type: ignore[union-attr]


@MIGRATIONS()
def m006_ignored_fields(db: Database) -> None:
    """The top-level fields an Ollama-dialect request sent that changed nothing (Ollama
    ignores unknown fields; the box does too, and says so): their names, comma-separated."""
    if "ignored_fields" not in db[REQUESTS].columns_dict:
        db[REQUESTS].add_column("ignored_fields", str)  # type: ignore[union-attr]


RISK_COLUMNS = ("risk_tier", "degradation", "degradation_reason", "requested_model")


@MIGRATIONS()
def m007_risk_tiers(db: Database) -> None:
    """Each request's risk tier, and where a saturated box served it otherwise than asked,
    how (fallback, queued, refused), why (queue_full, memory, deadline) and the model asked
    (`model` is the one that answered)."""
    for column in RISK_COLUMNS:
        if column not in db[REQUESTS].columns_dict:
            db[REQUESTS].add_column(column, str)  # type: ignore[union-attr]
    db[REQUESTS].create_index(["degradation", "ts"], if_not_exists=True)  # type: ignore[union-attr]


@MIGRATIONS()
def m008_batch_lines(db: Database) -> None:
    """A batch line's row names its batch (`/v1/batches`); interactive rows leave it NULL.
    The row's id is the line's `request_id` in the batch's output file."""
    if "batch_id" not in db[REQUESTS].columns_dict:
        db[REQUESTS].add_column("batch_id", str)  # type: ignore[union-attr]
    db[REQUESTS].create_index(["batch_id"], if_not_exists=True)  # type: ignore[union-attr]


QUOTA_COLUMNS = ("quota_requests", "quota_tokens")


@MIGRATIONS()
def m009_quota_charges(db: Database) -> None:
    """What each request counted against its tenant's windows: 1 in `quota_requests` once
    admitted (`requests_per_minute`), the tokens charged at its end in `quota_tokens`
    (`tokens_per_minute`, `tokens_per_day`), so that a restart reads the windows back
    (`quota_usage`) instead of handing every tenant a fresh quota."""
    for column in QUOTA_COLUMNS:
        if column not in db[REQUESTS].columns_dict:
            db[REQUESTS].add_column(column, int)  # type: ignore[union-attr]


ROUTE_COLUMNS = ("route", "upstream", "route_reason", "egress", "egress_entities",
                 "egress_bytes", "upstream_ms")


@MIGRATIONS()
def m010_routes(db: Database) -> None:
    """Where a request ran when not here (`route` "upstream", which `upstream`), why
    (`route_reason`: not_installed, context, saturated, asked, route, batch), what left the box
    (`egress`: redacted or allowed; the personal data replaced, `egress_entities`; the body's
    size, `egress_bytes`) and how long the upstream took (`upstream_ms`). NULL: answered
    here."""
    for column in ROUTE_COLUMNS:
        if column not in db[REQUESTS].columns_dict:
            db[REQUESTS].add_column(column, COLUMNS[column])  # type: ignore[union-attr]
    db[REQUESTS].create_index(["route", "ts"], if_not_exists=True)  # type: ignore[union-attr]


FEEDBACK_COLUMNS = ("feedback", "feedback_reason", "feedback_at")


@MIGRATIONS()
def m011_feedback(db: Database) -> None:
    """The verdict an app sent back on the answer (`POST /edge/v1/feedback`,
    `ledger.feedback`): `feedback` good or bad, `feedback_reason` from a closed set (never
    the app's own words), `feedback_at` when the latest verdict came. NULL: none came. On
    the request's own row, so an export, a purge and a report treat it as the request's."""
    for column in FEEDBACK_COLUMNS:
        if column not in db[REQUESTS].columns_dict:
            db[REQUESTS].add_column(column, COLUMNS[column])  # type: ignore[union-attr]


def quota_usage(db: Database, since: float) -> list[tuple[str, float, int, int]]:
    """(tenant, ts, requests, tokens) of each request since `since` that counted against
    its tenant's windows, oldest first."""
    cursor = db.execute(
        f"SELECT tenant, ts, COALESCE(quota_requests, 0), COALESCE(quota_tokens, 0) "
        f"FROM {REQUESTS} WHERE ts >= ? AND (quota_requests > 0 OR quota_tokens > 0) "
        "ORDER BY ts", [since])
    return [(str(t), float(ts), int(r), int(k)) for t, ts, r, k in cursor.fetchall()]


# Every table the writer may write, with its columns; rows for other tables are refused.
TABLE_COLUMNS: dict[str, dict[str, type]] = {
    REQUESTS: COLUMNS, REDACTIONS: REDACTION_COLUMNS, CONTENTS: CONTENT_COLUMNS,
    REJECTED: REJECTED_COLUMNS}


def open_ledger(path: Path) -> Database:
    """Opens (creating and migrating) the ledger; WAL so readers never block the writer."""
    db = Database(private_file(path))  # 0600, and so its -wal and -shm: tenants' metadata
    db.enable_wal()
    db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable at each checkpoint,
    # consistent always; a crash can lose only the last commits, never corrupt the file.
    MIGRATIONS.apply(db)
    return db


def pending_migrations(path: Path) -> list[str]:
    db = Database(path)
    try:
        return [m.name for m in MIGRATIONS.pending(db)]
    finally:
        db.close()


def rows_since(db: Database, since: float, *, order: str = "ts") -> Iterator[dict[str, Any]]:
    yield from db[REQUESTS].rows_where("ts >= ?", [since], order_by=order)  # type: ignore[union-attr]


def degraded_since(db: Database, since: float, *, tier: str | None = None,
                   action: str | None = None) -> list[dict[str, Any]]:
    """The requests a saturated box served otherwise than asked, oldest first."""
    args: list[Any]
    where, args = ["ts >= ?", "degradation IS NOT NULL"], [since]
    for column, value in (("risk_tier", tier), ("degradation", action)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    return list(db[REQUESTS].rows_where(" AND ".join(where), args, order_by="ts"))  # type: ignore[union-attr]


def tail(db: Database, n: int, after_ts: float | None = None) -> list[dict[str, Any]]:
    if after_ts is None:
        rows = list(db[REQUESTS].rows_where(order_by="ts desc", limit=n))  # type: ignore[union-attr]
        return rows[::-1]
    return list(db[REQUESTS].rows_where("ts > ?", [after_ts], order_by="ts"))  # type: ignore[union-attr]


def purge(db: Database, *, older_than_s: float, content_older_than_s: float = 0.0) -> int:
    """Retention: request rows (and their redaction spans and rejected-row markers) past the
    metadata window, and stored content past its (much shorter) window."""
    cutoff = time.time() - older_than_s
    with db.atomic():
        db.execute(f"DELETE FROM {REDACTIONS} WHERE request_id IN "
                   f"(SELECT id FROM {REQUESTS} WHERE ts < ?)", [cutoff])
        cursor = db.execute(f"DELETE FROM {REQUESTS} WHERE ts < ?", [cutoff])
        db.execute(f"DELETE FROM {REJECTED} WHERE ts < ?", [cutoff])
        db.execute(f"DELETE FROM {CONTENTS} WHERE ts < ?",
                   [time.time() - content_older_than_s])
    return int(cursor.rowcount)
