"""Embeddings never hold generation up, stop when their client leaves, and are bounded per
request; on the real model."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from edge_agent.engine.request import EmbeddingResult
from edge_agent.engine.runtime.llama import EmbeddingContext, LlamaModel
from edge_agent.engine.scheduling.scheduler import EmbeddingJob, ModelScheduler
from edge_agent.errors import EdgeAgentError, ServiceUnavailable
from tests.conftest import DEFAULT_MODEL, LiveServer

pytestmark = pytest.mark.integration

# One llama.cpp thread: the behaviour tested does not depend on it, and on a box whose cores
# are shared, two barrier-synchronised threads can make each decode many times slower.
THREADS = 1


@pytest.fixture
def scheduler(model_path: Path) -> Iterator[ModelScheduler]:
    sched = ModelScheduler(LlamaModel(model_path, n_gpu_layers=0), parallel=2, n_ctx_seq=256,
                           n_batch=128, n_threads=THREADS, embed_ctx=256, max_queue=4,
                           prefill_chunk=64, aging_s=10.0)
    yield sched
    sched.close()


def _tokens(model: LlamaModel, n: int, seed: int = 0) -> list[int]:
    text = " ".join(f"Shelf {i + seed} holds {i * 7 % 13} boxes of nails." for i in range(n))
    tokens = model.tokenize(text, add_special=True, parse_special=False)
    assert len(tokens) >= n
    return tokens[:n]


def test_an_input_fed_in_chunks_embeds_as_it_does_whole(model_path: Path) -> None:
    """The scheduler feeds inputs in chunks sized by the load; on a CPU, without flash
    attention (as the scheduler makes it), the vector is the same bit for bit."""
    model = LlamaModel(model_path, n_gpu_layers=0)
    small = EmbeddingContext(model, n_ctx=128, n_threads=THREADS, n_batch=24, flash_attn=0)
    whole = EmbeddingContext(model, n_ctx=128, n_threads=THREADS, flash_attn=0)
    try:
        assert small.causal and small.n_batch == 24
        tokens = _tokens(model, 80)
        vector = small.embed(tokens)
        assert vector == whole.embed(tokens)
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-9
    finally:
        small.close()
        whole.close()
        model.close()


def test_a_cancelled_embedding_stops_at_its_next_chunk(scheduler: ModelScheduler) -> None:
    results: list[EmbeddingResult | Exception] = []
    finished = threading.Event()

    def done(result: EmbeddingResult | Exception) -> None:
        results.append(result)
        finished.set()

    inputs = [_tokens(scheduler.model, 100, seed=i) for i in range(12)]
    job = EmbeddingJob(inputs=inputs, done=done)
    scheduler.submit(job)
    deadline = time.monotonic() + 120
    while scheduler.stats.embedded_inputs < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    # Waiting embedding requests are bounded like generation's queue (max_queue = 4).
    others: list[EmbeddingResult | Exception] = []
    for _ in range(3):
        scheduler.submit(EmbeddingJob(inputs=[inputs[0][:20]], done=others.append))
    with pytest.raises(ServiceUnavailable):
        scheduler.submit(EmbeddingJob(inputs=[inputs[0][:20]], done=others.append))
    job.cancelled.set()
    assert finished.wait(60)
    assert isinstance(results[0], EdgeAgentError)
    assert scheduler.stats.embedded_inputs <= 4  # of 12 (and 3 short ones): it stopped
    # The lane serves the next requests, each input from a fresh sequence.
    deadline = time.monotonic() + 60
    while len(others) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(isinstance(r, EmbeddingResult) and len(r.vectors) == 1 for r in others)
    assert scheduler.stats.embedding_jobs == 0


def _worker(live: LiveServer) -> ModelScheduler:
    return live.app.state.parts.registry.loaded()[0].worker  # type: ignore[no-any-return]


def _raw_post(live: LiveServer, path: str, body: dict[str, object]) -> socket.socket:
    """A request on a socket of our own, so that the test can walk away from it."""
    data = json.dumps(body).encode()
    host, port = live.settings.server.host, live.settings.server.port
    sock = socket.create_connection((host, port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_chat_finishes_while_a_big_embedding_request_runs_and_leaving_stops_it(
        live_server: LiveServer) -> None:
    """Embeddings used to run whole inside the scheduler thread: a chat waited for all of
    them, and they went on after their client had gone."""
    worker = _worker(live_server)
    text = " ".join(f"Aisle {i} stocks {i * 3} kinds of screws and {i} of bolts."
                    for i in range(60))
    total = 24
    before, tokens_before = worker.stats.embedded_inputs, worker.stats.embedded_tokens
    sock = _raw_post(live_server, "/api/embed", {"model": DEFAULT_MODEL,
                                                  "input": [f"{i} {text}" for i in range(total)]})
    try:
        deadline = time.monotonic() + 120
        while worker.stats.embedded_tokens == tokens_before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stats.embedding_jobs == 1
        chat = openai.OpenAI(base_url=live_server.openai_url, api_key="x", max_retries=0)
        r = chat.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "Name a colour."}])
        assert r.choices[0].message.content
        assert worker.stats.embedding_jobs == 1  # the chat was served first
        done_so_far = worker.stats.embedded_inputs - before
        assert done_so_far < total
    finally:
        sock.close()  # the client leaves
    deadline = time.monotonic() + 30
    while worker.stats.embedding_jobs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.stats.embedding_jobs == 0
    assert worker.stats.embedded_inputs - before <= done_so_far + 3  # stopped, not finished


def test_too_many_inputs_or_tokens_are_refused_in_both_dialects(
        live_server: LiveServer) -> None:
    runtime = live_server.app.state.parts.registry.settings.runtime
    many = ["a"] * (runtime.max_embedding_inputs + 1)
    r = httpx.post(f"{live_server.openai_url}/embeddings",
                   json={"model": DEFAULT_MODEL, "input": many})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input" and error["type"] == "invalid_request_error"
    assert str(runtime.max_embedding_inputs) in error["message"]
    r = httpx.post(f"{live_server.base_url}/api/embed", json={"model": DEFAULT_MODEL,
                                                            "input": many})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    saved = runtime.max_embedding_tokens
    runtime.max_embedding_tokens = 40
    try:
        two = ["one two three four five six seven eight nine ten " * 3] * 2  # > 40 tokens
        r = httpx.post(f"{live_server.openai_url}/embeddings",
                       json={"model": DEFAULT_MODEL, "input": two})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = httpx.post(f"{live_server.base_url}/api/embed",
                       json={"model": DEFAULT_MODEL, "input": two})
        assert r.status_code == 400 and "40 tokens" in r.json()["error"]
        ok = httpx.post(f"{live_server.base_url}/api/embed",
                        json={"model": DEFAULT_MODEL, "input": two[0][:20]})
        assert ok.status_code == 200 and len(ok.json()["embeddings"]) == 1
    finally:
        runtime.max_embedding_tokens = saved
