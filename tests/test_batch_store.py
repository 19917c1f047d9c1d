"""The batch queue's store (`ledger.batches`) without a server: owner-only files, a line
finished once, reopening where it was, finalizing and retention."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

from edge_agent.ledger.batches import BatchStore


def _batch(store: BatchStore, batch_id: str = "batch_1", n: int = 5,
           created: int | None = None) -> None:
    created = int(time.time()) if created is None else created
    store.add_batch({"id": batch_id, "tenant": "shop", "key_prefix": "", "endpoint":
                     "/v1/chat/completions", "input_file_id": "file-1",
                     "completion_window": "24h", "status": "in_progress",
                     "created_at": created, "expires_at": created + 86400, "total": n,
                     "completed": 0, "failed": 0},
                    [(f"batch_req_{i}", f"c{i}", json.dumps({"i": i})) for i in range(n)])


def test_files_and_database_are_owner_only(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.add_file({"id": "file-1", "tenant": "shop", "filename": "in.jsonl",
                    "purpose": "batch", "bytes": 3, "created_at": 1, "expires_at": 2,
                    "lines": 1}, b"{}\n")
    store.close()
    for path in (tmp_path / "batches.db", tmp_path / "batches" / "file-1.jsonl"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((tmp_path / "batches").stat().st_mode) == 0o700


def test_a_line_is_finished_once_and_a_reopened_store_goes_on_where_it_was(
        tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    _batch(store)
    assert [r["idx"] for r in store.pending("batch_1", skip={0, 1}, limit=2)] == [2, 3]
    assert store.finish_line("batch_1", 0, "done", {"custom_id": "c0"})
    assert not store.finish_line("batch_1", 0, "done", {"custom_id": "c0"})
    assert store.finish_line("batch_1", 1, "error", {"custom_id": "c1"})
    store.close()
    store = BatchStore(tmp_path)  # as after a kill: what was committed is there
    row = store.batch("batch_1")
    assert row is not None and (row["completed"], row["failed"]) == (1, 1)
    assert [r["idx"] for r in store.pending("batch_1", skip=set(), limit=10)] == [2, 3, 4]
    assert [b["id"] for b in store.open_batches()] == ["batch_1"]
    assert store.close_pending("batch_1", "cancelled") == 3
    assert store.count_pending("batch_1") == 0
    store.finalize("batch_1", "cancelled", [
        {"id": "file-out", "tenant": "shop", "filename": "o.jsonl", "purpose": "batch_output",
         "bytes": 2, "created_at": 1, "expires_at": 2, "lines": 1, "purpose_kind": "output"}],
        {"file-out": b"x\n"})
    row = store.batch("batch_1")
    assert row is not None and row["status"] == "cancelled" and row["cancelled_at"]
    assert row["output_file_id"] == "file-out" and row["error_file_id"] is None
    assert store.content("file-out") == b"x\n" and store.open_batches() == []
    store.close()


def test_retention_removes_old_files_and_ended_batches_but_not_open_ones(
        tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    old = int(time.time()) - 40 * 86400
    store.add_file({"id": "file-old", "tenant": "shop", "filename": "a", "purpose": "batch",
                    "bytes": 1, "created_at": old, "expires_at": old, "lines": 1}, b"x")
    _batch(store, "batch_old", created=old)
    _batch(store, "batch_open", created=old)
    store.set_status("batch_old", "completed")
    assert store.purge(older_than_s=30 * 86400) == 1
    assert store.file("file-old") is None
    assert not (tmp_path / "batches" / "file-old.jsonl").exists()
    assert store.batch("batch_old") is None and store.batch("batch_open") is not None
    assert store.pending("batch_open", skip=set(), limit=1)
    store.close()


def test_a_ledger_from_before_gains_the_batch_id_column(tmp_path: Path) -> None:
    import sqlite3

    from edge_agent.ledger.store import open_ledger, pending_migrations

    path = tmp_path / "ledger.db"
    open_ledger(path).close()
    db = sqlite3.connect(path)  # as the ledger was before the column's migration
    db.execute("DROP INDEX IF EXISTS idx_requests_batch_id")
    db.execute("ALTER TABLE requests DROP COLUMN batch_id")
    db.execute("DELETE FROM _sqlite_migrations WHERE name = 'm008_batch_lines'")
    db.commit()
    db.close()
    assert pending_migrations(path) == ["m008_batch_lines"]
    assert "batch_id" in open_ledger(path)["requests"].columns_dict
