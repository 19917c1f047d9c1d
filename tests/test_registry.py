from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from edge_agent.config import load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.registry import FOREVER, parse_keep_alive
from edge_agent.errors import InvalidRequest
from tests.conftest import DEFAULT_MODEL, clone_state, free_port, start_server


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), ("", None), (0, 0.0), ("0", 0.0), (30, 30.0), ("30", 30.0), ("5m", 300.0),
    ("1h30m", 5400.0), ("1.5s", 1.5), ("500ms", 0.5), (-1, FOREVER), ("-1m", FOREVER),
    ("-1", FOREVER),
])
def test_keep_alive_follows_ollama(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "5x", True, [1]])
def test_bad_keep_alive_is_a_client_error(value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_keep_alive(value)
    assert err.value.param == "keep_alive"


@pytest.mark.integration
def test_a_corrupted_blob_is_an_error_not_a_crash(model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    good = ModelStore(state).get(DEFAULT_MODEL)
    # A second name whose blob has rotted on disk after it was installed.
    broken = good.model_copy(update={"name": "broken:1", "digest": "0" * 64})
    (state / "manifests" / "broken%3A1.json").write_text(broken.model_dump_json())
    blob = broken.blob_path(state)
    shutil.copyfile(good.blob_path(state), blob)
    with blob.open("r+b") as fh:
        fh.seek(good.size // 2)
        fh.write(b"\xff" * 64)
    settings = load_settings(None, state_dir=state, **{"server.port": free_port(),
                                                       "runtime.context_length": 512})
    live = start_server(settings)
    try:
        r = httpx.post(f"{live.base_url}/api/generate", timeout=60,
                       json={"model": "broken:1", "prompt": "hi", "stream": False})
        assert r.status_code == 500
        assert "broken:1" in r.json()["error"] and "digest" in r.json()["error"]
        r = httpx.post(f"{live.openai_url}/completions", timeout=60,
                       json={"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    finally:
        live.stop()


@pytest.mark.integration
def test_a_loading_model_answers_503_when_configured_not_to_wait(model_cache: Path,
                                                                 tmp_path: Path) -> None:
    import asyncio

    from edge_agent.engine.registry import ModelRegistry
    from edge_agent.errors import ServiceUnavailable

    state = clone_state(model_cache, tmp_path / "state")
    settings = load_settings(None, state_dir=state, **{
        "runtime.context_length": 256, "runtime.load_wait": False})
    registry = ModelRegistry(settings, ModelStore(state))

    async def scenario() -> None:
        first = asyncio.create_task(registry.acquire(DEFAULT_MODEL))
        await asyncio.sleep(0.05)  # the load is under way (digest check, then llama.cpp)
        with pytest.raises(ServiceUnavailable) as err:
            await registry.acquire(DEFAULT_MODEL)
        assert err.value.retry_after and err.value.status_code == 503
        model, load_ns = await first
        assert load_ns > 0 and model.worker.n_ctx == 256
        await registry.release(model)
        again, waited = await registry.acquire(DEFAULT_MODEL)  # loaded now: no wait
        assert again is model and waited < load_ns
        await registry.release(again)
        await registry.close()

    asyncio.run(scenario())


def test_keep_alive_past_a_century_is_forever_and_nan_is_refused() -> None:
    from edge_agent.engine.registry import FOREVER, parse_keep_alive
    from edge_agent.errors import InvalidRequest

    assert parse_keep_alive(1e12) == FOREVER and parse_keep_alive(float("inf")) == FOREVER
    assert parse_keep_alive("1e12") == FOREVER and parse_keep_alive(300) == 300.0
    with pytest.raises(InvalidRequest):
        parse_keep_alive(float("nan"))


def test_a_quantized_kv_cache_holds_the_same_sequences_in_less_memory(
        model_cache: Path, tmp_path: Path) -> None:
    """`kv_cache_type = "q8_0"`: llama.cpp's cells at 34 bytes per 32 values, counted so in
    the memory the model is charged, and answers served from them."""
    from edge_agent.engine.models.gguf_probe import probe
    from edge_agent.names import ModelName

    state = clone_state(model_cache, tmp_path / "state")
    info = ModelStore(state).get(ModelName.parse(DEFAULT_MODEL))
    f16_kv = probe(info.blob_path(state)).kv_bytes_per_token() * 2 * 512
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512, "runtime.parallel": 2,
        "runtime.kv_cache_type": "q8_0"})
    live = start_server(settings)
    try:
        r = httpx.post(f"{live.openai_url}/chat/completions", timeout=60, json={
            "model": DEFAULT_MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        loaded = live.app.state.parts.registry.loaded()[0]
        assert loaded.memory - info.size == int(f16_kv / 2 * 34 / 32) // (2 * 512) * 2 * 512
    finally:
        live.stop()
