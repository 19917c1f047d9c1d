"""The OpenAI Batch API (/v1/files, /v1/batches) through the official `openai` client,
against a live server with the real default model: batches beside interactive streams,
cancel, tenants, hostile input, and a kill -9 halfway through a batch."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from edge_agent.config import load_settings
from edge_agent.governance.keys import KeyStore
from tests.conftest import (
    DEFAULT_MODEL,
    NO_EOS,
    LiveServer,
    clone_state,
    free_port,
    start_server,
)
from tests.support.pace import Pace, measure

pytestmark = pytest.mark.integration

CONFIG = """
[tenants.shop]
models = ["smollm2:*"]

[tenants.other]
models = ["smollm2:*"]

[tenants.tight]
models = ["smollm2:*"]
tokens_per_day = 40

[batches]
max_lines = 500
max_line_bytes = 4096
"""


@pytest.fixture(scope="module")
def box(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[LiveServer, dict[str, openai.OpenAI]]]:
    root = tmp_path_factory.mktemp("batches")
    state = clone_state(model_cache, root / "state")
    cfg = root / "config.toml"
    cfg.write_text(CONFIG)
    store = KeyStore(state)
    keys = {t: store.create(t)[0] for t in ("shop", "other", "tight")}
    settings = load_settings(cfg, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512})
    live = start_server(settings)
    clients = {t: openai.OpenAI(base_url=live.openai_url, api_key=k, max_retries=0,
                                timeout=120) for t, k in keys.items()}
    yield live, clients
    live.stop()


def _line(i: int, *, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    payload = {"model": DEFAULT_MODEL, "max_tokens": 4, "temperature": 0,
               "messages": [{"role": "user", "content": f"Say the number {i}."}], **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": payload}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _upload(client: openai.OpenAI, data: bytes, name: str = "in.jsonl") -> Any:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _ended(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> Any:
    """The batch, once it has ended; `timeout` for one of a few lines (a batch of many,
    on a loaded box, takes `_lines_s`)."""
    def done() -> Any:
        b = client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None
    return _wait(done, timeout, f"batch {batch_id} to end")


def _lines_s(pace: Pace, lines: int, max_tokens: int, floor: float = 300) -> float:
    """A wait for `lines` lines of `max_tokens` tokens each, one after another at the pace
    measured on the box (an idle box runs them in parallel well within `floor`; a loaded
    one is tens of times slower)."""
    return pace.bound(floor, tokens=lines * max_tokens, requests=lines)


def _key(client: openai.OpenAI) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.api_key}"}


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _ledger(state: Path, batch_id: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(state / "ledger.db")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM requests WHERE batch_id = ?",
                                            [batch_id])]
    finally:
        db.close()


def test_a_chat_batch_completes_beside_interactive_streams_that_all_get_answers(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    live, clients = box
    client = clients["shop"]
    pace = measure(live.base_url, headers=_key(client))
    n = 200
    source = _upload(client, _jsonl([_line(i) for i in range(n)]))
    assert (source.object, source.purpose, source.status) == ("file", "batch", "processed")
    assert client.files.retrieve(source.id).bytes == source.bytes
    answered: list[str] = []
    failures: list[BaseException] = []

    def interactive(k: int) -> None:
        for _ in range(4):  # lines start in the pauses: the batch ends after these
            try:
                stream = client.chat.completions.create(
                    model=DEFAULT_MODEL, max_tokens=12, stream=True,
                    messages=[{"role": "user", "content": f"Tell me about stores {k}."}])
                text = "".join(c.choices[0].delta.content or "" for c in stream
                               if c.choices)
                answered.append(text)
            except BaseException as exc:  # a 503 or any error fails the test
                failures.append(exc)
                return

    streams = [threading.Thread(target=interactive, args=(k,)) for k in range(4)]
    for t in streams:
        t.start()
    try:
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"job": "numbers"})
        assert batch.object == "batch" and batch.status in ("validating", "in_progress")
        assert batch.request_counts is not None and batch.request_counts.total == n
    finally:
        for t in streams:
            t.join()
    done = _ended(client, batch.id, _lines_s(pace, n, 4))
    assert not failures, failures
    assert len(answered) == 16 and all(answered)
    assert done.status == "completed" and done.metadata == {"job": "numbers"}
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert done.error_file_id is None and done.completed_at is not None
    out = _lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    for x in out:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        assert x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]
    # One ledger row per line, its id the line's request_id.
    assert live.app.state.parts.ledger.flush()
    rows = _ledger(live.settings.state_dir, batch.id)
    assert sorted(r["trace_id"] for r in rows) == sorted(x["id"] for x in out)
    assert {r["id"] for r in rows} == {x["response"]["request_id"] for x in out}
    assert {(r["tenant"], r["status"], r["endpoint"]) for r in rows} == \
        {("shop", 200, "/v1/chat/completions")}
    assert all(r["completion_tokens"] and r["model"] == DEFAULT_MODEL for r in rows)
    listed = client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]


def test_completions_and_embeddings_batches(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    client = box[1]["shop"]
    comp = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": DEFAULT_MODEL, "prompt": f"{i}, {i + 1},", "max_tokens": 3}}
            for i in range(3)]
    emb = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": DEFAULT_MODEL, "input": f"item {i}"}} for i in range(3)]
    ids = []
    for lines, endpoint in ((comp, "/v1/completions"), (emb, "/v1/embeddings")):
        f = _upload(client, _jsonl(lines))
        ids.append(client.batches.create(input_file_id=f.id, endpoint=endpoint,  # type: ignore[arg-type]
                                         completion_window="24h").id)
    c, e = (_ended(client, i) for i in ids)
    assert c.status == e.status == "completed"
    assert {x["response"]["body"]["object"] for x in _lines(client, c.output_file_id)} == \
        {"text_completion"}
    vectors = _lines(client, e.output_file_id)
    assert len(vectors) == 3 and all(
        len(x["response"]["body"]["data"][0]["embedding"]) > 10 for x in vectors)


def test_bad_lines_are_error_lines_and_the_rest_of_the_queue_goes_on(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    client = box[1]["shop"]
    lines = [_line(0), _line(1, model="smollm2:nope"), _line(2, max_tokens=-3),
             _line(3, model="gemma3:270m"), _line(4, stream=True), _line(5)]
    lines[1]["custom_id"], lines[2]["custom_id"] = "unknown-model", "bad-param"
    lines[3]["custom_id"], lines[4]["custom_id"] = "not-allowed", "streamed"
    bad = client.batches.create(input_file_id=_upload(client, _jsonl(lines)).id,
                                endpoint="/v1/chat/completions", completion_window="24h")
    good = client.batches.create(input_file_id=_upload(client, _jsonl([_line(9)])).id,
                                 endpoint="/v1/chat/completions", completion_window="24h")
    done = _ended(client, bad.id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 4)
    errors = {x["custom_id"]: x["response"] for x in _lines(client, done.error_file_id)}
    assert {k: v["status_code"] for k, v in errors.items()} == {
        "unknown-model": 404, "bad-param": 400, "not-allowed": 403, "streamed": 400}
    assert errors["bad-param"]["body"]["error"]["param"] == "max_tokens"
    assert errors["streamed"]["body"]["error"]["param"] == "stream"
    assert sorted(x["custom_id"] for x in _lines(client, done.output_file_id)) == \
        ["req-0", "req-5"]
    assert _ended(client, good.id).status == "completed"
    live = box[0]
    assert live.app.state.parts.ledger.flush()
    rows = {r["id"]: r for r in _ledger(live.settings.state_dir, bad.id)}
    assert len(rows) == 6  # every line, refused or answered, is a row
    for answer in errors.values():
        row = rows[answer["request_id"]]
        assert row["status"] == answer["status_code"]
        assert row["error_type"] == answer["body"]["error"]["type"]


@pytest.mark.parametrize(("name", "data", "where"), [
    ("not-jsonl", b"this is not json\n", "not JSON"),
    ("a-list", b"[1, 2]\n", "not a JSON object"),
    ("long-line", _jsonl([_line(0, messages=[{"role": "user", "content": "x" * 5000}])]),
     "at most 4096"),
    ("duplicate", _jsonl([_line(0), _line(0)]), "repeats custom_id"),
    ("too-many", _jsonl([_line(i) for i in range(10_000)]), "more than 500 lines"),
    ("no-method", b'{"custom_id": "a", "url": "/v1/completions", "body": {}}\n', "POST"),
    ("empty", b"\n\n", "no request"),
    ("nan", b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            b'"body": {"x": NaN}}\n', "not JSON"),
])
def test_hostile_files_are_a_clear_400(
        box: tuple[LiveServer, dict[str, openai.OpenAI]], name: str, data: bytes,
        where: str) -> None:
    client = box[1]["shop"]
    with pytest.raises(openai.BadRequestError) as err:
        _upload(client, data, f"{name}.jsonl")
    assert err.value.status_code == 400 and where in err.value.message
    assert err.value.body["param"] == "file"  # type: ignore[index]


def test_other_refusals_are_clear(box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    live, clients = box
    client = clients["shop"]
    mixed = _upload(client, _jsonl([_line(0), _line(1, url="/v1/embeddings")]))
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert "is for /v1/embeddings" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions",
                              completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", io.BytesIO(_jsonl([_line(0)]))),
                            purpose="fine-tune")
    assert err.value.body["param"] == "purpose"  # type: ignore[index]
    headers = {"Authorization": f"Bearer {client.api_key}"}
    for content in (b"", b"--x\r\nno end", b'{"purpose": "batch"}'):
        r = httpx.post(f"{live.openai_url}/files", content=content, headers={
            **headers, "Content-Type": "multipart/form-data; boundary=x"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{live.openai_url}/files", json={"purpose": "batch"}, headers=headers)
    assert r.status_code == 400


def test_a_tenant_sees_only_its_own_files_and_batches(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    shop, other = box[1]["shop"], box[1]["other"]
    f = _upload(shop, _jsonl([_line(0)]))
    b = shop.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                            completion_window="24h")
    for call in (lambda: other.files.retrieve(f.id), lambda: other.files.content(f.id),
                 lambda: other.files.delete(f.id), lambda: other.batches.retrieve(b.id),
                 lambda: other.batches.cancel(b.id),
                 lambda: other.batches.create(input_file_id=f.id,
                                              endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.id not in [x.id for x in other.batches.list().data]
    assert f.id not in [x.id for x in other.files.list().data]
    assert f.id in [x.id for x in shop.files.list().data]
    assert _ended(shop, b.id).status == "completed"
    assert shop.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        shop.files.retrieve(f.id)


def test_a_line_over_the_tenants_daily_quota_is_an_error_line(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    client = box[1]["tight"]
    f = _upload(client, _jsonl([_line(i) for i in range(12)]))
    done = _ended(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed >= 1 and done.request_counts.failed >= 1
    errors = _lines(client, done.error_file_id)
    assert {x["response"]["status_code"] for x in errors} == {429}
    assert "tokens per day" in errors[0]["response"]["body"]["error"]["message"]


def test_cancel_stops_a_batch_and_keeps_what_finished(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    client = box[1]["shop"]
    f = _upload(client, _jsonl([_line(i, max_tokens=24) for i in range(40)]))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _ended(client, b.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts is not None and done.request_counts.completed < 40
    kept = _lines(client, done.output_file_id)
    assert len(kept) == done.request_counts.completed
    assert client.batches.cancel(b.id).status == "cancelled"  # an ended batch stays so


def test_submit_one_is_a_batch_of_one_line(
        box: tuple[LiveServer, dict[str, openai.OpenAI]]) -> None:
    live, clients = box
    from edge_agent.config import TenantPolicy
    from edge_agent.governance.tenants import TenantContext

    service = live.app.state.parts.batches
    assert service is not None and service.runner._task is not None
    tenant = TenantContext("shop", TenantPolicy.model_validate({"models": ["smollm2:*"]}))
    future = asyncio.run_coroutine_threadsafe(
        service.submit_one(tenant, "/v1/chat/completions", _line(7)["body"]),
        service.runner._task.get_loop())
    batch = future.result(timeout=30)
    assert batch["object"] == "batch" and batch["request_counts"]["total"] == 1
    done = _ended(clients["shop"], batch["id"])
    [answer] = _lines(clients["shop"], done.output_file_id)
    assert answer["custom_id"] == "request-1" and answer["response"]["status_code"] == 200


def test_kill_9_halfway_resumes_without_losing_or_redoing_a_line(
        model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    port = free_port()
    env = {**os.environ, "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "256",
           "EDGE_AGENT_TELEMETRY__HARDWARE": "false"}
    url = f"http://127.0.0.1:{port}"

    def serve() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--state-dir",
                                 str(state), "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def ready() -> bool:
            assert proc.poll() is None, "the server ended"
            try:
                return httpx.get(f"{url}/ready").status_code == 200
            except httpx.HTTPError:
                return False
        _wait(ready, 120, "the server to be ready")
        return proc

    n = 40
    proc = serve()
    try:
        pace = measure(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        f = _upload(client, _jsonl([_line(i, max_tokens=8) for i in range(n)]))
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")

        def halfway() -> bool:
            counts = client.batches.retrieve(b.id).request_counts
            return counts is not None and counts.completed >= n // 3
        _wait(halfway, _lines_s(pace, n // 3, 8), "a third of the lines")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        db = sqlite3.connect(state / "batches.db")
        left = db.execute("SELECT count(*) FROM lines WHERE batch_id = ? AND state = "
                          "'pending'", [b.id]).fetchone()[0]
        db.close()
        assert 0 < left < n  # killed halfway: the restart has lines to resume
        proc = serve()
        done = _ended(client, b.id, _lines_s(pace, n, 8))
        out = _lines(client, done.output_file_id)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    rows = _ledger(state, b.id)
    per_line: dict[str, int] = {}
    for r in rows:
        per_line[r["trace_id"]] = per_line.get(r["trace_id"], 0) + 1
    assert per_line == {x["id"]: 1 for x in out}, "a line lost or done twice"
    assert {r["id"] for r in rows} == {x["response"]["request_id"] for x in out}


def test_an_interactive_request_meeting_every_sequence_taken_by_lines_gets_one_back(
        model_cache: Path, tmp_path: Path) -> None:
    """Two sequences, both lines' (no reserve): an interactive request puts the newest line
    back, is answered, and the line runs again later; the batch still completes whole."""
    state = clone_state(model_cache, tmp_path / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512, "runtime.parallel": 2,
        "batches.reserve_slots": 0, "batches.max_in_flight": 2}))
    try:
        client = openai.OpenAI(base_url=live.openai_url, api_key="x", max_retries=0,
                               timeout=120)
        n = 4
        f = _upload(client, _jsonl([_line(i, max_tokens=48, logit_bias=NO_EOS)
                                    for i in range(n)]))
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        [model] = live.app.state.parts.registry.loaded()
        stats = model.worker.stats
        _wait(lambda: stats.running == 2 and stats.yielding == 2, 300,
              "both sequences taken by lines")
        answer = client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=4,
            messages=[{"role": "user", "content": "Is the shop open?"}])
        assert answer.choices[0].message.content is not None
        assert stats.put_back >= 1
        metrics = httpx.get(f"{live.base_url}/metrics").text
        [line] = [x for x in metrics.splitlines() if x.startswith(
            f'edge_agent_batch_lines_put_back_total{{model="{DEFAULT_MODEL}"}}')]
        assert float(line.split()[-1]) >= 1
        done = _ended(client, b.id)
        assert done.request_counts is not None
        assert (done.status, done.request_counts.completed) == ("completed", n)
        out = _lines(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 48 for x in out)
        assert live.app.state.parts.ledger.flush()
        assert len(_ledger(state, b.id)) == n  # a line put back leaves no row of its own
    finally:
        live.stop()
