"""Scheduling seen through the API: concurrency, admission, deadlines, residency."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from edge_agent.config import load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.names import ModelName
from tests.conftest import (
    DEFAULT_MODEL,
    NO_EOS,
    LiveServer,
    clone_state,
    free_port,
    start_server,
)
from tests.support.fleetkit import wait_until
from tests.support.pace import Pace, measure

pytestmark = pytest.mark.integration


def _schema(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {
        f"field_{i}": {"type": "integer", "minimum": i, "maximum": i + 100},
        "note": {"type": "string", "maxLength": 10 + i}},
        "required": [f"field_{i}", "note"], "additionalProperties": False}


def test_eight_concurrent_requests_each_get_output_valid_for_their_own_constraints(
        live_server: LiveServer) -> None:
    oa = openai.OpenAI(base_url=live_server.openai_url, api_key="x", max_retries=0)
    ol = ollama.Client(host=live_server.ollama_url)

    def schema_job(i: int) -> tuple[str, Any]:
        r = oa.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=150, temperature=0.2 * i, seed=i,
            messages=[{"role": "user", "content": f"Describe item {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": _schema(i)}})
        return "schema", (i, r.choices[0].message.content)

    def stop_job(i: int) -> tuple[str, Any]:
        stream = oa.completions.create(model=DEFAULT_MODEL, prompt="1, 2, 3, 4, 5,",
                                       max_tokens=40, temperature=0, stop=[str(8 + i)],
                                       stream=True)
        return "stop", (i, "".join(c.choices[0].text for c in stream))

    def cjk_job(i: int) -> tuple[str, Any]:
        chunks = list(ol.generate(model=DEFAULT_MODEL, prompt="日本の首都は東京です。中国の首都は",
                                  raw=True, stream=True,
                                  options={"temperature": 0, "num_predict": 30}))
        return "cjk", "".join(c.response for c in chunks)

    jobs = [lambda: schema_job(0), lambda: schema_job(1), lambda: schema_job(2),
            lambda: stop_job(0), lambda: stop_job(1), lambda: stop_job(2),
            lambda: cjk_job(0), lambda: cjk_job(1)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda f: f(), jobs))
    for kind, value in results:
        if kind == "schema":
            i, text = value
            jsonschema.validate(json.loads(text), _schema(i))
        elif kind == "stop":
            i, text = value
            assert str(8 + i) not in text and str(7 + i) in text
        else:
            assert "\ufffd" not in value and any(ord(ch) > 0x2FFF for ch in value)
    cjk = [v for k, v in results if k == "cjk"]
    assert cjk[0] == cjk[1]  # greedy, same prompt: same text, whatever ran beside it


def test_a_shared_system_prompt_is_reused_and_reported(live_server: LiveServer) -> None:
    oa = openai.OpenAI(base_url=live_server.openai_url, api_key="x", max_retries=0)
    system = {"role": "system", "content": "You answer questions about the store. " * 20}
    first = oa.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2, messages=[
        system, {"role": "user", "content": "Opening hours?"}])
    second = oa.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2, messages=[
        system, {"role": "user", "content": "Where is the bakery?"}])
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert 100 < cached >= second.usage.prompt_tokens - 12  # all but the new user turn
    ol = ollama.Client(host=live_server.ollama_url)
    r = ol.chat(model=DEFAULT_MODEL, options={"num_predict": 2}, messages=[
        system, {"role": "user", "content": "Is there parking?"}])
    # Ollama counts the whole prompt, reused or not.
    assert r.prompt_eval_count is not None and r.prompt_eval_count > 100


def _metric(live: LiveServer, line: str) -> float | None:
    """A sample's value on the box's /metrics, None where it is not there."""
    text = httpx.get(f"{live.base_url}/metrics", timeout=10).text
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return None


def test_a_system_prompt_two_requests_sent_is_warm_after_a_restart(
        model_cache: Path, tmp_path: Path) -> None:
    """The disk tier through the API: the second request with a system prompt keeps its
    state on disk; after a restart the first request restores it (usage says so), and
    /metrics counts it as a disk hit. Removing the model removes its states."""
    state = clone_state(model_cache, tmp_path / "state")
    system = {"role": "system", "content": "You take orders at the bakery counter of the "
              "store on Main Street. Rye, spelt and sourdough loaves are baked at six. " * 6}

    def serve() -> LiveServer:
        return start_server(load_settings(None, state_dir=state, **{
            "server.port": free_port(), "runtime.context_length": 2048}))

    def ask(live: LiveServer, question: str) -> int:
        oa = openai.OpenAI(base_url=live.openai_url, api_key="x", max_retries=0)
        r = oa.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2, messages=[
            system, {"role": "user", "content": question}])
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    live = serve()
    try:
        ask(live, "Do you have rye bread?")
        assert ask(live, "When is the spelt ready?") > 100  # from the first's sequence
        assert wait_until(lambda: _metric(
            live, "edge_agent_prompt_cache_disk_writes_total") == 1, timeout=30)
    finally:
        live.stop()
    [kept] = list((state / "prompt-cache").glob("*/*.kv"))
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    live = serve()
    try:
        assert ask(live, "Is there sourdough today?") > 100
        assert _metric(live, 'edge_agent_prompt_cache_hits_total{tier="disk"}') == 1
        assert (_metric(live, 'edge_agent_prompt_cache_bytes{tier="ram"}') or 0) > 0
    finally:
        live.stop()
    ModelStore(state).remove(ModelName.parse(DEFAULT_MODEL))
    assert not kept.parent.exists()


@pytest.fixture(scope="module")
def narrow_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[LiveServer]:
    """One sequence, one waiting place: easy to fill."""
    state = clone_state(model_cache, tmp_path_factory.mktemp("narrow") / "state")
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512, "runtime.parallel": 1,
        "runtime.max_queue": 1, "runtime.max_loaded_models": 1})
    live = start_server(settings)
    yield live
    live.stop()


def _long_stream(live: LiveServer, started: threading.Event, stop: threading.Event,
                 **headers: str) -> None:
    body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": 400, "temperature": 1.0,
            "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.stream("POST", f"{live.openai_url}/chat/completions", json=body, timeout=120,
                      headers=headers) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def _worker(live: LiveServer) -> Any:
    return live.app.state.parts.registry.loaded()[0].worker


def _idle(live: LiveServer, pace: Pace) -> None:
    """Waits until no sequence runs and nobody waits: an earlier request (this test's or
    the one before) may still be ending, and a deadline or a queue measured behind it is
    not the one asked about."""
    worker = _worker(live)
    assert wait_until(lambda: worker.running == 0 and worker.queued == 0,
                      pace.bound(5, tokens=400)), (worker.running, worker.queued)


def test_full_queue_gives_503_with_retry_after_in_both_dialects(narrow_server: LiveServer
                                                                ) -> None:
    pace = measure(narrow_server.base_url)
    _idle(narrow_server, pace)
    started, stop = threading.Event(), threading.Event()
    runner = threading.Thread(target=_long_stream, args=(narrow_server, started, stop))
    runner.start()
    waiting: threading.Thread | None = None
    try:
        assert started.wait(pace.bound(30))
        waiting = threading.Thread(target=lambda: httpx.post(
            f"{narrow_server.openai_url}/completions", timeout=pace.bound(120, tokens=402),
            json={"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2}))
        waiting.start()
        # The one waiting place taken (the long stream still holds the one sequence: 400
        # tokens outlast this wait at any pace), the next request finds the queue full.
        worker = _worker(narrow_server)
        assert wait_until(lambda: worker.queued >= 1, pace.bound(10))
        r = httpx.post(f"{narrow_server.openai_url}/completions", timeout=pace.bound(30),
                       json={"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "server_error" and "queue" in r.json()["error"][
            "message"]
        r = httpx.post(f"{narrow_server.base_url}/api/generate", timeout=pace.bound(30),
                       json={"model": DEFAULT_MODEL, "prompt": "hi", "stream": False})
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert set(r.json()) == {"error"}
    finally:
        stop.set()
        runner.join()
        if waiting is not None:
            waiting.join()


def _cut_stream(live: LiveServer, pace: Pace, url: str, body: dict[str, Any]
                ) -> list[str]:
    """The lines of a stream cut by its deadline. The deadline starts at 300 ms and
    doubles while it passes before the stream could start (a 504 in place of a stream:
    on a loaded box the request's own preparation can take that long); a count of 400
    tokens outlasts any of them."""
    timeout_ms = 300
    while True:
        _idle(live, pace)
        with httpx.stream("POST", url, timeout=pace.bound(60, tokens=400), json=body,
                          headers={"X-Timeout-Ms": str(timeout_ms)}) as s:
            lines = [line for line in s.iter_lines() if line]
        if s.status_code == 200:
            return lines
        assert s.status_code == 504 and timeout_ms < pace.bound(10) * 1000, lines
        timeout_ms *= 2


def test_deadlines_give_504_or_an_error_event(narrow_server: LiveServer) -> None:
    pace = measure(narrow_server.base_url)
    body = {"model": DEFAULT_MODEL, "max_tokens": 400, "temperature": 1.0, "timeout_ms": 300,
            "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    _idle(narrow_server, pace)
    t0 = time.monotonic()
    r = httpx.post(f"{narrow_server.openai_url}/chat/completions", json=body,
                   timeout=pace.bound(60, tokens=400))
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    assert time.monotonic() - t0 < pace.bound(5)  # the deadline's, not the 400 tokens'
    _idle(narrow_server, pace)
    r = httpx.post(f"{narrow_server.base_url}/api/generate", timeout=pace.bound(60, tokens=400),
                   headers={"X-Timeout-Ms": "300"},
                   json={"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5,", "raw": True,
                         "stream": False, "options": {"num_predict": 400, "temperature": 0}})
    assert r.status_code == 504 and set(r.json()) == {"error"}
    # A greedy count runs far past the deadline; a sampled chat may end early on EOS.
    lines = [json.loads(line) for line in _cut_stream(
        narrow_server, pace, f"{narrow_server.base_url}/api/generate",
        {"model": DEFAULT_MODEL, "prompt": "1, 2, 3, 4, 5,", "raw": True,
         "options": {"num_predict": 400, "temperature": 0}})]
    assert "error" in lines[-1] and "deadline" in lines[-1]["error"]
    data = [line for line in _cut_stream(
        narrow_server, pace, f"{narrow_server.openai_url}/chat/completions",
        {**body, "stream": True, "timeout_ms": None}) if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"  # the error event, then the stream's end
    assert json.loads(data[-2][6:])["error"]["code"] == "timeout"
    bad = httpx.post(f"{narrow_server.base_url}/api/generate", headers={"X-Timeout-Ms": "soon"},
                     json={"model": DEFAULT_MODEL, "prompt": "hi"})
    assert bad.status_code == 400 and "X-Timeout-Ms" in bad.json()["error"]
    # The sequence was freed: the next request runs at once.
    worker = _worker(narrow_server)
    assert wait_until(lambda: worker.running == 0, pace.bound(5))


def test_batch_class_completes_while_interactive_load_continues(live_server: LiveServer
                                                                ) -> None:
    oa = openai.OpenAI(base_url=live_server.openai_url, api_key="x", max_retries=0)
    stop = threading.Event()

    def interactive_load() -> int:
        n = 0
        while not stop.is_set():
            oa.completions.create(model=DEFAULT_MODEL, prompt="Hello", max_tokens=16)
            n += 1
        return n

    with ThreadPoolExecutor(max_workers=6) as pool:
        loaders = [pool.submit(interactive_load) for _ in range(5)]
        time.sleep(0.5)
        batch = oa.with_options(default_headers={"X-Priority": "batch"}).completions.create(
            model=DEFAULT_MODEL, prompt="Summarise: the store opens at nine.", max_tokens=16)
        stop.set()
        done = sum(f.result() for f in loaders)
    assert batch.choices[0].text is not None and batch.usage
    assert done > 0
    bad = httpx.post(f"{live_server.openai_url}/completions", headers={"X-Priority": "urgent"},
                     json={"model": DEFAULT_MODEL, "prompt": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Priority"


def test_least_recently_used_model_is_evicted(narrow_server: LiveServer) -> None:
    ModelStore(narrow_server.settings.state_dir).pull("gemma3:270m")
    client = ollama.Client(host=narrow_server.ollama_url)
    client.generate(model="gemma3:270m", prompt="Hi", options={"num_predict": 2})
    assert [m.model for m in client.ps().models] == ["gemma3:270m"]
    client.generate(model=DEFAULT_MODEL, prompt="Hi", options={"num_predict": 2})
    assert [m.model for m in client.ps().models] == [DEFAULT_MODEL]


def test_the_default_model_comes_back_once_the_model_that_displaced_it_is_gone(
        narrow_server: LiveServer) -> None:
    """One model at a time: gemma's load evicts the default, and the box is not ready.
    Once gemma's keep_alive runs out, the reaper unloads it and loads the default again,
    so the next assistant request finds it warm (not at that request's expense)."""
    store = ModelStore(narrow_server.settings.state_dir)
    if not store.is_installed("gemma3:270m"):
        store.pull("gemma3:270m")
    store.close()
    client = ollama.Client(host=narrow_server.ollama_url)
    client.generate(model="gemma3:270m", prompt="Hi", keep_alive="1s",
                    options={"num_predict": 2})
    assert [m.model for m in client.ps().models] == ["gemma3:270m"]
    ready = httpx.get(f"{narrow_server.base_url}/ready")
    assert ready.status_code == 503 and ready.json()["reasons"] == [
        f"default model {DEFAULT_MODEL} is not loaded"]
    # 1 s of keep_alive, a 5 s reaper pass, a load
    assert wait_until(lambda: httpx.get(f"{narrow_server.base_url}/ready").status_code == 200,
                      30, 0.2), f"still loaded: {client.ps().models}"
    assert [m.model for m in client.ps().models] == [DEFAULT_MODEL]
