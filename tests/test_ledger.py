"""The request ledger: rows for every request, batching, crash safety, retention, CLI."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.ledger.store import REQUESTS, open_ledger, pending_migrations, purge
from edge_agent.ledger.writer import LedgerWriter
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port


def _row(i: int, ts: float | None = None, **extra: object) -> dict[str, object]:
    return {"id": f"r{i}", "trace_id": f"t{i}", "ts": ts or time.time(), "tenant": "local",
            "dialect": "openai", "endpoint": "/v1/chat/completions", "model": "m:1",
            "status": 200, "ttft_ms": 10.0 + i, "tpot_ms": 5.0, "total_ms": 50.0, **extra}


def test_writer_commits_in_batches_and_flushes_on_close(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    writer = LedgerWriter(path, window_s=0.05)
    for i in range(500):
        writer.record(_row(i, prompt="never stored"))  # unknown keys are dropped
    assert writer.flush(timeout=10)
    writer.close()
    db = open_ledger(path)
    assert db[REQUESTS].count == 500
    assert "prompt" not in db[REQUESTS].columns_dict
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert pending_migrations(path) == []
    assert writer.rows_written == 500 and writer.lag_s == 0.0


def test_purge_removes_only_expired_rows(tmp_path: Path) -> None:
    db = open_ledger(tmp_path / "ledger.db")
    old = time.time() - 91 * 86400
    db[REQUESTS].insert_all([_row(1, ts=old), _row(2, ts=old), _row(3)])
    db["redactions"].insert_all([{"request_id": "r1", "entity_type": "EMAIL"},
                                 {"request_id": "r3", "entity_type": "EMAIL"}])
    db["contents"].insert_all([{"request_id": "r3", "text": "<EMAIL> hi",
                                "ts": time.time() - 3 * 3600},
                               {"request_id": "r3", "text": "fresh", "ts": time.time()}])
    assert purge(db, older_than_s=90 * 86400, content_older_than_s=2 * 3600) == 2
    assert [r["id"] for r in db[REQUESTS].rows] == ["r3"]
    assert [r["request_id"] for r in db["redactions"].rows] == ["r3"]
    assert [r["text"] for r in db["contents"].rows] == ["fresh"]


def test_cli_stats_tail_export_and_purge(tmp_path: Path) -> None:
    db = open_ledger(tmp_path / "ledger.db")
    db[REQUESTS].insert_all([_row(i) for i in range(10)] + [
        _row(99, status=503, error_type="server_error", model="m:2"),
        _row(100, ts=time.time() - 100 * 86400)])
    db.close()
    runner = CliRunner()
    state = ["--state-dir", str(tmp_path)]
    stats = json.loads(runner.invoke(main, ["ledger", "stats", "--json", *state]).output)
    by = {r["model"]: r for r in stats}
    assert by["m:1"]["requests"] == 10 and by["m:1"]["errors"] == 0
    assert by["m:1"]["ttft_p50_ms"] == 14.0 and by["m:1"]["ttft_p95_ms"] == 19.0
    assert by["m:2"]["errors"] == 1
    tail = runner.invoke(main, ["ledger", "tail", "-n", "2", *state])
    assert tail.exit_code == 0 and len(tail.output.splitlines()) == 2 and "t99" in tail.output
    jsonl = runner.invoke(main, ["ledger", "export", "--since", "1h", *state]).output
    assert len(jsonl.splitlines()) == 11 and json.loads(jsonl.splitlines()[0])["id"]
    csv = runner.invoke(main, ["ledger", "export", "--format", "csv", "--since", "1h", *state])
    assert csv.output.splitlines()[0].startswith("id,trace_id,ts,")
    bad = runner.invoke(main, ["ledger", "stats", "--since", "soon", *state])
    assert bad.exit_code == 2
    purged = runner.invoke(main, ["ledger", "purge", *state])
    assert "removed 1 rows" in purged.output


@pytest.mark.integration
def test_every_request_gets_a_row_rejected_ones_included(live_server: LiveServer) -> None:
    base = live_server.base_url
    ok = httpx.post(f"{base}/v1/chat/completions", headers={"X-Request-Id": "ledger-ok-1"},
                    timeout=60, json={"model": DEFAULT_MODEL, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200
    httpx.post(f"{base}/api/generate", headers={"traceparent":
               "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
               json={"model": "nope:1", "prompt": "hi"})
    httpx.post(f"{base}/api/chat", headers={"X-Request-Id": "ledger-bad-1"}, content=b"{")
    assert live_server.app.state.parts.ledger.flush()
    db = sqlite3.connect(live_server.settings.state_dir / "ledger.db")
    db.row_factory = sqlite3.Row
    rows = {r["trace_id"]: dict(r) for r in db.execute("SELECT * FROM requests")}
    good = rows["ledger-ok-1"]
    usage = ok.json()["usage"]
    assert (good["status"], good["dialect"], good["model"]) == (200, "openai", DEFAULT_MODEL)
    assert good["model_digest"].startswith("b179c952")
    assert good["prompt_tokens"] == usage["prompt_tokens"]
    assert good["completion_tokens"] == usage["completion_tokens"]
    assert good["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert good["ttft_ms"] > 0 and good["total_ms"] >= good["ttft_ms"]
    assert good["done_reason"] in ("stop", "length") and good["tenant"] == "local"
    missing = rows["4bf92f3577b34da6a3ce929d0e0e4736"]
    assert (missing["status"], missing["model"], missing["dialect"]) == (404, "nope:1", "ollama")
    assert rows["ledger-bad-1"]["status"] == 400
    assert rows["ledger-bad-1"]["error_type"] == "invalid_request_error"


@pytest.mark.integration
def test_kill_9_during_traffic_keeps_every_row_acknowledged_before_the_window(
        model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    port = free_port()
    env = {**os.environ, "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "256",
           "EDGE_AGENT_TELEMETRY__HARDWARE": "false", "EDGE_AGENT_RUNTIME__THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--state-dir",
                             str(state), "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    acknowledged: list[tuple[str, float]] = []
    stop = threading.Event()

    def traffic(worker: int) -> None:
        i = 0
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                rid = f"w{worker}-{i}"
                try:
                    r = client.post(f"{url}/v1/completions", headers={"X-Request-Id": rid},
                                    json={"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 2})
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    acknowledged.append((rid, time.monotonic()))
                i += 1

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        workers = [threading.Thread(target=traffic, args=(w,)) for w in range(3)]
        for w in workers:
            w.start()
        busy_until = time.monotonic() + 60  # enough rows whatever the box's speed
        while len(acknowledged) < 15 and time.monotonic() < busy_until:
            time.sleep(0.1)
        time.sleep(0.5)
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        stop.set()
        for w in workers:
            w.join()
    finally:
        if proc.poll() is None:
            proc.kill()
    window = 0.2
    must_have = {rid for rid, t in acknowledged if t < killed_at - window - 0.05}
    assert len(must_have) > 10
    db = sqlite3.connect(state / "ledger.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    stored = {r[0] for r in db.execute("SELECT trace_id FROM requests")}
    assert must_have <= stored, sorted(must_have - stored)[:5]
