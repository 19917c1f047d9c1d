"""Degradation by risk tier on a saturated box, through both dialects: a normal request
answered by the installed fallback model, a high one refused with its reason, a low one
refused unless it accepts a later answer; each in the ledger, `/metrics` and the CLI."""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.config import load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.governance.keys import KeyStore
from edge_agent.names import ModelName
from tests.conftest import DEFAULT_MODEL, NO_EOS, LiveServer, clone_state, free_port, start_server
from tests.support.fleetkit import wait_until

pytestmark = pytest.mark.integration

FALLBACK = "gemma3:270m"
CONFIG = f"""
[risk]
retry_after_s = 7

[models."{DEFAULT_MODEL}"]
fallback = "{FALLBACK}"

[tenants.shop]
models = ["smollm2:*", "gemma3:*"]
risk_may_lower = true

[tenants.kiosk]
models = ["smollm2:*"]

[tenants.pricing]
risk = "high"
"""


@pytest.fixture(scope="module")
def tiered(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    """One sequence and two waiting places for the default model (three streams saturate
    it), and room for the fallback model beside it."""
    root = tmp_path_factory.mktemp("tiers")
    state = clone_state(model_cache, root / "state")
    store = ModelStore(state)
    store.pull(FALLBACK)
    store.close()
    cfg = root / "config.toml"
    cfg.write_text(CONFIG)
    keys = {t: KeyStore(state).create(t)[0] for t in ("shop", "kiosk", "pricing")}
    settings = load_settings(cfg, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 2048, "runtime.parallel": 1,
        "runtime.max_queue": 2, "runtime.max_loaded_models": 2})
    live = start_server(settings)
    yield live, keys
    live.stop()


def _auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def _chat(live: LiveServer, key: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{live.openai_url}/chat/completions", timeout=120,
                      headers=_auth(key, **headers),
                      json={"model": DEFAULT_MODEL, "max_tokens": 4, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name a colour."}]})


def _generate(live: LiveServer, key: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{live.base_url}/api/generate", timeout=120,
                      headers=_auth(key, **headers),
                      json={"model": DEFAULT_MODEL, "prompt": "Name a colour.",
                            "stream": False, "options": {"num_predict": 4}})


def _worker(live: LiveServer) -> Any:
    """The default model's scheduler (the fallback may be loaded beside it)."""
    loaded = live.app.state.parts.registry.loaded()
    return next(m.worker for m in loaded if m.info.name == DEFAULT_MODEL)


@contextmanager
def _streams(live: LiveServer, key: str, waiting: int) -> Iterator[Any]:
    """Long normal-tier streams: one holds the only sequence, `waiting` more wait for it;
    all are cut when the block ends. Yields the model's scheduler."""
    stop = threading.Event()

    def stream(i: int) -> None:
        body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": 1800,
                "temperature": 1.0, "logit_bias": NO_EOS,
                "messages": [{"role": "user", "content": f"Write a long story, part {i}."}]}
        with httpx.stream("POST", f"{live.openai_url}/chat/completions", json=body,
                          timeout=300, headers=_auth(key)) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    worker = _worker(live)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(1 + waiting)]
    try:
        threads[0].start()
        assert wait_until(lambda: worker.running == 1, 60)
        for t in threads[1:]:
            t.start()
        assert wait_until(lambda: worker.queued == waiting, 60)
        yield worker
        # Still so at the end: what the block saw was the box in this state.
        assert worker.running == 1 and worker.queued == waiting
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def _ledger(live: LiveServer, *answered: httpx.Response) -> list[dict[str, Any]]:
    return [live.ledger_row(r.headers["x-request-id"]) for r in answered]


def test_each_tier_under_saturation_gets_its_policy_and_the_ledger_says_so(
        tiered: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = tiered
    fallback_digest = ModelStore(live.settings.state_dir).get(ModelName.parse(FALLBACK)).digest
    oa = openai.OpenAI(base_url=live.openai_url, api_key=keys["shop"], max_retries=0)
    ol = ollama.Client(host=live.base_url, headers=_auth(keys["shop"]))
    with _streams(live, keys["shop"], waiting=2):  # the queue is full
        # normal: the fallback model answers, and says so, in both dialects.
        raw = oa.chat.completions.with_raw_response.create(
            model=DEFAULT_MODEL, max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": "Name a colour."}])
        answer = raw.parse()
        assert answer.model == FALLBACK and answer.choices[0].message.content
        assert answer.system_fingerprint == "fp_" + fallback_digest[:12]
        assert raw.headers["x-edge-degraded"] == (
            f"fallback; tier=normal; reason=queue_full; requested={DEFAULT_MODEL}")
        chunks = list(oa.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=4, stream=True,
            messages=[{"role": "user", "content": "Hi"}]))
        assert {c.model for c in chunks} == {FALLBACK}
        generated = ol.generate(model=DEFAULT_MODEL, prompt="Name a colour.",
                                options={"num_predict": 4})
        assert generated.model == FALLBACK
        normal = _generate(live, keys["shop"])
        assert normal.status_code == 200 and normal.json()["model"] == FALLBACK

        # high: refused with the reason and Retry-After, never another model.
        high = _chat(live, keys["pricing"])
        assert high.status_code == 503 and int(high.headers["retry-after"]) >= 7
        error = high.json()["error"]
        assert error["message"].startswith("risk tier high: not degraded")
        assert error["code"] == "risk_not_degraded" and error["type"] == "server_error"
        high_ollama = _generate(live, keys["pricing"])
        assert high_ollama.status_code == 503 and set(high_ollama.json()) == {"error"}
        assert high_ollama.json()["error"].startswith("risk tier high: not degraded")
        # A tenant may raise its own request's tier, and that request is not degraded.
        raised = _chat(live, keys["shop"], **{"X-Edge-Risk": "high"})
        assert raised.status_code == 503 and "risk tier high" in raised.text

        # normal, but the tenant may not use the fallback: refused, not served by it.
        kiosk = _chat(live, keys["kiosk"])
        assert kiosk.status_code == 503
        assert "tenant 'kiosk' may not use the fallback model" in kiosk.json()["error"][
            "message"]

        # low: refused unless it accepts a later answer; then queued as a one-line batch.
        low = _chat(live, keys["shop"], **{"X-Edge-Risk": "low"})
        assert low.status_code == 503 and "X-Edge-Defer: batch" in low.json()["error"][
            "message"]
        deferred = _chat(live, keys["shop"], **{"X-Edge-Risk": "low", "X-Edge-Defer": "batch"})
        assert deferred.status_code == 202, deferred.text
        batch = deferred.json()
        assert batch["object"] == "batch" and batch["endpoint"] == "/v1/chat/completions"
        assert deferred.headers["location"] == f"/v1/batches/{batch['id']}"
        assert deferred.headers["x-edge-degraded"].startswith("queued; tier=low")
        # Only a chat completion may wait as a batch; elsewhere the header is refused.
        elsewhere = _generate(live, keys["shop"], **{"X-Edge-Risk": "low",
                                                     "X-Edge-Defer": "batch"})
        assert elsewhere.status_code == 400 and "X-Edge-Defer" in elsewhere.json()["error"]
        # kiosk may not lower its tier; nothing it sends reaches another tenant's.
        lowered = _chat(live, keys["kiosk"], **{"X-Edge-Risk": "low"})
        assert lowered.status_code == 403
        assert lowered.json()["error"]["code"] == "risk_tier_not_allowed"
        after = _chat(live, keys["shop"])
        assert after.status_code == 200 and after.json()["model"] == FALLBACK

    # The deferred request is answered once the box has room, by the model it asked.
    assert wait_until(lambda: oa.batches.retrieve(batch["id"]).status == "completed", 180)
    done = oa.batches.retrieve(batch["id"])
    assert done.request_counts is not None and done.request_counts.completed == 1
    assert done.output_file_id is not None
    [answer] = [json.loads(line) for line in
                oa.files.content(done.output_file_id).text.splitlines()]
    assert answer["response"]["status_code"] == 200
    assert answer["response"]["body"]["model"] == DEFAULT_MODEL

    rows = _ledger(live, normal, high, high_ollama, raised, kiosk, low, lowered, after,
                   deferred)
    by = {r["trace_id"]: r for r in rows}
    row = by[normal.headers["x-request-id"]]
    assert (row["risk_tier"], row["degradation"], row["degradation_reason"],
            row["requested_model"], row["model"], row["status"]) == (
        "normal", "fallback", "queue_full", DEFAULT_MODEL, FALLBACK, 200)
    for refused, tier in ((high, "high"), (high_ollama, "high"), (raised, "high"),
                          (kiosk, "normal"), (low, "low")):
        row = by[refused.headers["x-request-id"]]
        assert (row["risk_tier"], row["degradation"], row["degradation_reason"],
                row["requested_model"], row["status"]) == (
            tier, "refused", "queue_full", DEFAULT_MODEL, 503)
    row = by[lowered.headers["x-request-id"]]
    assert row["status"] == 403 and row["degradation"] is None
    row = by[deferred.headers["x-request-id"]]
    assert (row["risk_tier"], row["degradation"], row["batch_id"], row["status"]) == (
        "low", "queued", batch["id"], 202)

    metrics = httpx.get(f"{live.base_url}/metrics").text
    counted = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
               if line.startswith("edge_agent_degradations_total{")}
    assert counted['edge_agent_degradations_total{action="fallback",reason="queue_full",'
                   'tier="normal"}'] == 5
    assert counted['edge_agent_degradations_total{action="refused",reason="queue_full",'
                   'tier="high"}'] == 3
    assert counted['edge_agent_degradations_total{action="refused",reason="queue_full",'
                   'tier="low"}'] == 1
    assert counted['edge_agent_degradations_total{action="queued",reason="queue_full",'
                   'tier="low"}'] == 1

    result = CliRunner().invoke(main, [
        "ledger", "degraded", "--json", "--tier", "high", "--state-dir",
        str(live.settings.state_dir)])
    assert result.exit_code == 0, result.output
    listed = [json.loads(line) for line in result.output.splitlines()]
    assert {r["trace_id"] for r in listed} == {
        r.headers["x-request-id"] for r in (high, high_ollama, raised)}
    table = CliRunner().invoke(main, ["ledger", "degraded", "--action", "fallback",
                                      "--state-dir", str(live.settings.state_dir)])
    assert table.exit_code == 0 and f"{DEFAULT_MODEL} → {FALLBACK}" in table.output


def test_a_deadline_shorter_than_the_wait_is_saturation_too(
        tiered: tuple[LiveServer, dict[str, str]]) -> None:
    """One stream holds the only sequence and one waits: the queue is not full, but a
    request that must end before its turn would come (after ~128 tokens of the one
    ahead) is saturation all the same."""
    live, keys = tiered
    with _streams(live, keys["shop"], waiting=1) as worker:
        # Within the fallback's reach (a short answer), short of the wait's estimate.
        deadline_ms = str(int(worker.expected_wait_s() * 600))
        high = _chat(live, keys["pricing"], **{"X-Timeout-Ms": deadline_ms})
        normal = _chat(live, keys["shop"], **{"X-Timeout-Ms": deadline_ms})
    assert normal.status_code == 200 and normal.json()["model"] == FALLBACK
    assert "reason=deadline" in normal.headers["x-edge-degraded"]
    assert high.status_code == 503
    assert high.json()["error"]["message"].startswith(
        "risk tier high: not degraded (the request's deadline ends before model")
    row = live.ledger_row(high.headers["x-request-id"])
    assert (row["degradation"], row["degradation_reason"]) == ("refused", "deadline")


def test_a_box_that_is_not_saturated_serves_every_tier_as_asked(
        tiered: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = tiered
    for key in (keys["pricing"], keys["shop"]):
        r = _chat(live, key)
        assert r.status_code == 200 and r.json()["model"] == DEFAULT_MODEL
        assert "x-edge-degraded" not in r.headers
        row = live.ledger_row(r.headers["x-request-id"])
        assert row["degradation"] is None and row["risk_tier"] in ("high", "normal")
    bad = _chat(live, keys["shop"], **{"X-Edge-Risk": "urgent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Edge-Risk"
    db = sqlite3.connect(live.settings.state_dir / "ledger.db")
    assert db.execute("SELECT count(*) FROM requests WHERE risk_tier IS NULL AND "
                      "status = 200").fetchone()[0] == 0
    db.close()


# -- embeddings: the same controls, a tier recorded, never another model's vectors ----------

EMBED_ROUTES = ("/v1/embeddings", "/api/embed", "/api/embeddings")


def _embed(live: LiveServer, path: str, key: str, text: str | list[str] = "A red bicycle.",
           **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"model": DEFAULT_MODEL}
    body["prompt" if path == "/api/embeddings" else "input"] = text
    return httpx.post(f"{live.base_url}{path}", json=body, timeout=120,
                      headers=_auth(key, **headers))


def _error(path: str, r: httpx.Response) -> str:
    """The message of a refusal, checked to be in the dialect's error shape."""
    payload = r.json()
    assert set(payload) == {"error"}, payload
    if path.startswith("/v1/"):
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        return str(payload["error"]["message"])
    assert isinstance(payload["error"], str)
    return payload["error"]


def _degradations(live: LiveServer) -> dict[str, float]:
    metrics = httpx.get(f"{live.base_url}/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
            if line.startswith("edge_agent_degradations_total{")}


def _long_text(i: int, sentences: int = 150) -> str:
    """Some 20 tokens a sentence: by default more than the embedding context takes (2,048
    tokens here; Ollama's `truncate` cuts it to that)."""
    return f"{i} " + " ".join(f"Aisle {j} stocks {j * 3} kinds of screws and {j} of bolts."
                              for j in range(sentences))


@contextmanager
def _embedding_queue_full(live: LiveServer, key: str) -> Iterator[Any]:
    """As many embedding requests under way as the model takes (`max_queue`), each tens of
    thousands of tokens, on sockets of the test's own; they stop at their next chunk when
    the block ends and their clients leave. Yields the model's scheduler."""
    worker = _worker(live)
    limit = max(1, live.settings.runtime.max_queue)
    assert worker.stats.embedding_jobs == 0
    data = json.dumps({"model": DEFAULT_MODEL, "truncate": True,
                       "input": [_long_text(i) for i in range(30)]}).encode()
    host, port = live.settings.server.host, live.settings.server.port
    socks = []
    try:
        for _ in range(limit):
            sock = socket.create_connection((host, port))
            socks.append(sock)
            sock.sendall(f"POST /api/embed HTTP/1.1\r\nHost: {host}\r\n"
                         f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert wait_until(lambda: worker.stats.embedding_jobs == limit, 60)
        yield worker
        # Still so at the end: every refusal in the block met a full embedding queue.
        assert worker.stats.embedding_jobs == limit
    finally:
        for sock in socks:
            sock.close()
        assert wait_until(lambda: worker.stats.embedding_jobs == 0, 60)


def test_the_embedding_routes_read_the_request_controls(
        tiered: tuple[LiveServer, dict[str, str]]) -> None:
    live, keys = tiered
    for path in EMBED_ROUTES:
        bad = _embed(live, path, keys["shop"], **{"X-Edge-Risk": "banana"})
        assert bad.status_code == 400 and "X-Edge-Risk" in _error(path, bad)
        if path.startswith("/v1/"):
            assert bad.json()["error"]["param"] == "X-Edge-Risk"
        deferred = _embed(live, path, keys["shop"], **{"X-Edge-Risk": "low",
                                                      "X-Edge-Defer": "batch"})
        assert deferred.status_code == 400
        assert _error(path, deferred).startswith("X-Edge-Defer is for /v1/chat/completions")
        for header, value in (("X-Priority", "urgent"), ("X-Edge-Prompt-Lookup", "99"),
                              ("X-Timeout-Ms", "soon")):
            r = _embed(live, path, keys["shop"], **{header: value})
            assert r.status_code == 400 and header in _error(path, r), (path, header)
        # kiosk may not lower its tier, on an embedding as on a generation.
        lowered = _embed(live, path, keys["kiosk"], **{"X-Edge-Risk": "low"})
        assert lowered.status_code == 403 and "risk_may_lower" in _error(path, lowered)
        if path.startswith("/v1/"):
            assert lowered.json()["error"]["code"] == "risk_tier_not_allowed"
        # Nothing to embed is answered without the model, and the tier rule holds there too.
        empty = _embed(live, path, keys["kiosk"], text=[] if path == "/api/embed" else "",
                       **{"X-Edge-Risk": "low"})
        assert empty.status_code == (400 if path.startswith("/v1/") else 403)
        # Valid controls that change nothing for an embedding are taken.
        fine = _embed(live, path, keys["shop"], **{"X-Priority": "batch",
                                                  "X-Edge-Prompt-Lookup": "4"})
        assert fine.status_code == 200, fine.text

    # The tier is decided and recorded: the tenant's own, or a tier it may ask.
    oa = openai.OpenAI(base_url=live.openai_url, api_key=keys["pricing"], max_retries=0)
    high = oa.embeddings.with_raw_response.create(model=DEFAULT_MODEL, input="A red bicycle.")
    assert len(high.parse().data[0].embedding) > 0
    low = _embed(live, "/api/embed", keys["shop"], **{"X-Edge-Risk": "low"})
    assert low.status_code == 200 and len(low.json()["embeddings"]) == 1
    ol = ollama.Client(host=live.base_url, headers=_auth(keys["kiosk"]))
    assert len(ol.embed(model=DEFAULT_MODEL, input="A red bicycle.").embeddings) == 1
    rows = [live.ledger_row(r.headers["x-request-id"]) for r in (high, low, lowered, bad)]
    assert [(r["risk_tier"], r["status"], r["degradation"]) for r in rows[:2]] == [
        ("high", 200, None), ("low", 200, None)]
    assert rows[2]["status"] == 403 and rows[3]["status"] == 400


def test_an_embedding_deadline_is_honoured(tiered: tuple[LiveServer, dict[str, str]]
                                           ) -> None:
    """`X-Timeout-Ms` is an embedding's deadline: past it the work stops and the answer is
    504 in the dialect's shape; within it the answer is as usual."""
    live, keys = tiered
    worker = _worker(live)
    text = _long_text(0, 90)  # some 1,800 tokens: far longer to embed than 1 ms
    for path in EMBED_ROUTES:
        late = _embed(live, path, keys["shop"], text=text, **{"X-Timeout-Ms": "1"})
        assert late.status_code == 504, late.text
        assert "timed out" in _error(path, late) or "deadline" in _error(path, late)
        if path.startswith("/v1/"):
            assert late.json()["error"]["code"] == "timeout"
        assert live.ledger_row(late.headers["x-request-id"])["status"] == 504
        assert wait_until(lambda: worker.stats.embedding_jobs == 0, 30)  # stopped
        timely = _embed(live, path, keys["shop"], **{"X-Timeout-Ms": "60000"})
        assert timely.status_code == 200, timely.text


def test_a_saturated_embedding_is_refused_at_every_tier_never_answered_by_the_fallback(
        tiered: tuple[LiveServer, dict[str, str]]) -> None:
    """The default model has an installed fallback the tenant may use, and a normal-tier
    generation would get it; an embedding never does (its vectors would not compare), and
    a low one cannot wait as a batch: every tier is refused with 503 + Retry-After."""
    live, keys = tiered
    before = _degradations(live)
    oa = openai.OpenAI(base_url=live.openai_url, api_key=keys["shop"], max_retries=0)
    ol = ollama.Client(host=live.base_url, headers=_auth(keys["shop"]))
    with _embedding_queue_full(live, keys["shop"]):
        with pytest.raises(openai.APIStatusError) as caught:
            oa.embeddings.create(model=DEFAULT_MODEL, input="A red bicycle.")
        normal = caught.value.response
        assert normal.status_code == 503 and caught.value.code == "risk_not_degraded"
        with pytest.raises(ollama.ResponseError) as refused:
            ol.embed(model=DEFAULT_MODEL, input="A red bicycle.")
        assert refused.value.status_code == 503
        assert refused.value.error.startswith("risk tier normal: not degraded")
        low = _embed(live, "/api/embed", keys["shop"], **{"X-Edge-Risk": "low"})
        high = _embed(live, "/api/embeddings", keys["pricing"])
        low_openai = _embed(live, "/v1/embeddings", keys["shop"], **{"X-Edge-Risk": "low"})
    never = ("not degraded: an embedding is never answered by another model (its vectors "
             "would not compare) (the queue for model 'smollm2:135m' is full); retry later")
    for path, r, tier in (("/v1/embeddings", normal, "normal"), ("/api/embed", low, "low"),
                          ("/api/embeddings", high, "high"),
                          ("/v1/embeddings", low_openai, "low")):
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 7
        assert _error(path, r) == f"risk tier {tier}: {never}"
        if path.startswith("/v1/"):
            assert r.json()["error"]["code"] == "risk_not_degraded"
        row = live.ledger_row(r.headers["x-request-id"])
        assert (row["risk_tier"], row["degradation"], row["degradation_reason"],
                row["requested_model"], row["status"]) == (
            tier, "refused", "queue_full", DEFAULT_MODEL, 503)

    after = _degradations(live)
    for tier, more in (("normal", 2), ("low", 2), ("high", 1)):
        key = (f'edge_agent_degradations_total{{action="refused",reason="queue_full",'
               f'tier="{tier}"}}')
        assert after.get(key, 0) - before.get(key, 0) == more, tier
    fallback = 'edge_agent_degradations_total{action="fallback",reason="queue_full",' \
               'tier="normal"}'
    assert after.get(fallback, 0) == before.get(fallback, 0)
    # Room again: the model asked answers.
    ok = _embed(live, "/api/embed", keys["shop"])
    assert ok.status_code == 200 and ok.json()["model"] == DEFAULT_MODEL
