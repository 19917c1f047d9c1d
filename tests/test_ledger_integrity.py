"""The ledger writer under bad rows: one row that cannot be stored never costs another."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from edge_agent.ledger.store import CONTENTS, REDACTIONS, REJECTED, REQUESTS, open_ledger
from edge_agent.ledger.writer import LedgerWriter, clean_value
from edge_agent.logs import RequestContext, note


def _row(i: int, **extra: object) -> dict[str, Any]:
    return {"id": f"r{i}", "trace_id": f"t{i}", "ts": 1_700_000_000.0 + i, "tenant": "local",
            "dialect": "openai", "endpoint": "/v1/chat/completions", "model": "m:1",
            "status": 200, "ttft_ms": 10.0 + i, "total_ms": 50.0, **extra}


def _rows(path: Path, table: str = REQUESTS) -> list[dict[str, Any]]:
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        return [{k: v for k, v in dict(r).items() if v is not None}
                for r in db.execute(f"SELECT * FROM {table}")]
    finally:
        db.close()


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


BAD = {  # one row per kind of value SQLite cannot take as given
    "surrogate-model": {"model": "m\ud800x"},
    "surrogate-trace": {"trace_id": "\udfff"},
    "nan": {"ttft_ms": math.nan},
    "inf": {"total_ms": math.inf},
    "huge-int": {"prompt_tokens": 2**70},
    "object": {"endpoint": object()},
    "unprintable": {"error_type": _Unprintable()},
    "nested": {"done_reason": {"why": "\ud800", "n": [1, 2]}},
    "text-for-number": {"status": "two hundred"},
}


def test_a_mixed_batch_keeps_every_good_row_exact_and_every_bad_row_sanitised(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    writer = LedgerWriter(path, window_s=0.5)  # one batch: the case that lost whole batches
    good = [_row(i) for i in range(6)]
    bad = {name: _row(100 + n, **fields) for n, (name, fields) in enumerate(BAD.items())}
    for i, row in enumerate(good):
        writer.record(row)
        writer.record(list(bad.values())[i])
    for row in list(bad.values())[len(good):]:
        writer.record(row)
    writer.record({"request_id": "r0", "entity_type": "EMAIL", "detector": "e\ud800"},
                  REDACTIONS)
    writer.record({"request_id": "r1", "direction": "response", "text": "a\ud83d b",
                   "ts": time.time()}, CONTENTS)
    assert writer.flush(timeout=10)
    writer.close()

    stored = {r["id"]: r for r in _rows(path)}
    assert len(stored) == len(good) + len(bad)
    for row in good:
        assert stored[row["id"]] == row  # exact, not sanitised
    sanitised = {name: stored[row["id"]] for name, row in bad.items()}
    assert sanitised["surrogate-model"]["model"] == "m\ufffdx"
    assert sanitised["surrogate-trace"]["trace_id"] == "\ufffd"
    assert "ttft_ms" not in sanitised["nan"] and "total_ms" not in sanitised["inf"]
    assert "prompt_tokens" not in sanitised["huge-int"]
    assert sanitised["object"]["endpoint"].startswith("<object object")
    assert "error_type" not in sanitised["unprintable"]
    assert sanitised["nested"]["done_reason"] == '{"why": "\ufffd", "n": [1, 2]}'
    assert "status" not in sanitised["text-for-number"]
    for name, row in sanitised.items():  # the rest of each bad row is intact
        assert row["ts"] == bad[name]["ts"] and row["tenant"] == "local", name
    assert _rows(path, REDACTIONS)[0]["detector"] == "e\ufffd"
    assert _rows(path, CONTENTS)[0]["text"] == "a\ufffd b"
    assert (writer.rows_written, writer.rows_sanitised) == (len(good) + len(bad) + 2,
                                                            len(bad) + 2)
    assert (writer.rows_rejected, writer.rows_lost, writer.healthy) == (0, 0, True)


def test_a_row_the_database_refuses_becomes_a_marker_and_the_rest_land(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    db = open_ledger(path)
    db.execute(f"CREATE TRIGGER refuse BEFORE INSERT ON {REQUESTS} WHEN NEW.model = 'boom' "
               "BEGIN SELECT RAISE(ABORT, 'refused boom'); END")
    db.close()
    writer = LedgerWriter(path, window_s=0.5)
    for i in range(5):
        writer.record(_row(i))
    writer.record(_row(99, model="boom", tenant="secret-value"))
    writer.record({"request_id": "r1", "entity_type": "EMAIL"}, REDACTIONS)
    writer.record({"x": 1}, "no_such_table")
    writer.record(None, REDACTIONS)  # type: ignore[arg-type]
    assert writer.flush(timeout=10)
    writer.close()

    assert sorted(r["id"] for r in _rows(path)) == [f"r{i}" for i in range(5)]
    assert len(_rows(path, REDACTIONS)) == 1
    markers = _rows(path, REJECTED)
    assert [(m["table_name"], m.get("request_id"), m["reason"]) for m in markers] == [
        ("no_such_table", None, "unknown table"), (REDACTIONS, None, "not a row"),
        (REQUESTS, "r99", "IntegrityError")]
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("ledger.db*"))
    assert b"secret-value" not in raw  # a marker keeps no value (and no error text: above)
    assert (writer.rows_written, writer.rows_rejected, writer.rows_lost) == (6, 3, 0)
    assert writer.healthy


def test_an_unwritable_ledger_counts_its_losses_and_the_thread_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    db = open_ledger(path)
    for table in (REQUESTS, REJECTED):
        db.execute(f"CREATE TRIGGER full_{table} BEFORE INSERT ON {table} "
                   "BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    db.close()
    writer = LedgerWriter(path, window_s=0.5)
    for i in range(4):
        writer.record(_row(i))
    assert writer.flush(timeout=10)
    assert (writer.rows_written, writer.rows_lost, writer.healthy) == (0, 4, False)
    assert "disk full" in writer.last_error
    db = open_ledger(path)
    for table in (REQUESTS, REJECTED):
        db.execute(f"DROP TRIGGER full_{table}")
    db.close()
    writer.record(_row(10))
    assert writer.flush(timeout=10)
    writer.close()
    assert [r["id"] for r in _rows(path)] == ["r10"] and writer.healthy


def test_values_are_cleaned_per_column_type() -> None:
    assert clean_value(True, int) is True and clean_value(3, float) == 3
    assert clean_value(2**64, float) == float(2**64) and clean_value(2**64, int) is None
    assert clean_value(b"\xff", str) == "\ufffd" and clean_value("12", int) is None


class _Ledger:
    """The app's `record` seam, onto a real writer."""

    def __init__(self, writer: LedgerWriter) -> None:
        self.writer = writer

    def __call__(self, row: dict[str, Any]) -> None:
        self.writer.record(row, REQUESTS)


async def _generate(scope: Scope, receive: Receive, send: Send) -> None:
    """A stand-in endpoint: notes the model the client asked for, as the service does (the
    HTTP layer may refuse a lone surrogate in JSON; the ledger must not depend on it)."""
    model = dict(scope["headers"]).get(b"x-model", b"m:1").decode()
    note(model=model.replace("<surrogate>", "\ud800"), dialect="ollama")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_a_request_whose_model_has_a_lone_surrogate_costs_no_other_row(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    writer = LedgerWriter(path, window_s=0.5)
    app = RequestContext(_generate, record=_Ledger(writer))

    async def requests() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for i in range(5):
                r = await client.post("/api/generate", headers={"X-Request-Id": f"ok-{i}"})
                assert r.status_code == 200
            r = await client.post("/api/generate", headers={"X-Request-Id": "bad-1",
                                                            "X-Model": "m<surrogate>x"})
            assert r.status_code == 200

    asyncio.run(requests())
    assert writer.flush(timeout=10)
    writer.close()
    rows = {r["trace_id"]: r for r in _rows(path)}
    assert sorted(rows) == ["bad-1", *(f"ok-{i}" for i in range(5))]
    assert rows["bad-1"]["model"] == "m\ufffdx" and rows["ok-0"]["model"] == "m:1"
    assert writer.rows_sanitised == 1 and writer.rows_lost == 0


def test_a_deferred_job_runs_on_the_writer_and_its_rows_are_kept_like_any_other(
        tmp_path: Path) -> None:
    """`later`: the job runs on the writer thread, not the caller's; `flush` waits for its
    rows; a bad value in them is sanitised; a job that raises leaves a marker with the
    request's id, and the rows around it stand."""
    path = tmp_path / "ledger.db"
    writer = LedgerWriter(path, window_s=0.05)
    threads: list[str] = []

    def job() -> list[tuple[str, dict[str, Any]]]:
        threads.append(threading.current_thread().name)
        return [(CONTENTS, {"request_id": "r1", "direction": "response", "message_index": 0,
                            "role": "assistant", "text": "a\ud800", "ts": time.time()}),
                (REDACTIONS, {"request_id": "r1", "direction": "response",
                              "message_index": 0, "entity_type": "EMAIL", "start": 0,
                              "end": 1})]

    def broken() -> list[tuple[str, dict[str, Any]]]:
        raise ValueError("a detector failed")

    try:
        writer.record(_row(1))
        writer.later(job, request_id="r1")
        writer.later(broken, request_id="r2")
        writer.record(_row(3))
        assert writer.flush()
        assert threads == ["ledger"]
        assert [r["id"] for r in _rows(path)] == ["r1", "r3"]
        assert _rows(path, CONTENTS)[0]["text"] == "a\ufffd"
        assert _rows(path, REDACTIONS)[0]["entity_type"] == "EMAIL"
        (marker,) = _rows(path, REJECTED)
        assert marker["request_id"] == "r2" and marker["reason"] == "ValueError"
        # The count of what was handed over matches what was done: a later flush waits.
        writer.later(job, request_id="r4")
        assert writer.flush() and len(_rows(path, CONTENTS)) == 2
    finally:
        writer.close()
