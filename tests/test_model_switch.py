"""Switching the default model's active digest on a live server: requests already running
finish on the old weights, the next one gets the new, nothing fails; rollback; the pointer
across a restart; Ollama's /api/copy. The second digest is the default model's own GGUF
with one letter of its `general.name` changed, so both versions load in the same time."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from edge_agent.bench.fleet.rollout import variant
from edge_agent.config import load_settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.rollout.store import RolloutStore
from edge_agent.fleet.protocol.rollout_states import CANCELLED, STAGED
from edge_agent.governance.keys import KeyStore
from tests.conftest import (
    DEFAULT_MODEL,
    NO_EOS,
    LiveServer,
    clone_state,
    free_port,
    start_server,
)
from tests.support.pace import measure

pytestmark = pytest.mark.integration


def _second_digest(state: Path, tmp: Path) -> tuple[str, str]:
    """(old, new): the installed default model and a copy differing in one metadata byte,
    installed beside it, inactive."""
    store = ModelStore(state)
    old = store.get(DEFAULT_MODEL)
    copy = variant(old.blob_path(state), tmp / "variant.gguf", b"T")
    new = store.import_file(copy, DEFAULT_MODEL, by="test", activate=False)
    store.close()
    return old.digest, new.digest


@pytest.fixture(scope="module")
def box(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[LiveServer, str, str]]:
    root = tmp_path_factory.mktemp("switch")
    state = clone_state(model_cache, root / "state")
    old, new = _second_digest(state, root)
    live = start_server(_settings(state))
    yield live, old, new
    live.stop()


def _settings(state: Path) -> Any:
    return load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512, "runtime.threads": 1,
        "runtime.parallel": 4, "telemetry.hardware": False})


def _ops(live: LiveServer) -> ModelOps:
    """The CLI's view: its own store on the same state dir, as another process has."""
    return ModelOps(ModelStore(live.settings.state_dir))


def _fingerprint(live: LiveServer) -> str:
    client = openai.OpenAI(base_url=live.openai_url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}])
    return r.system_fingerprint or ""


def _stream(live: LiveServer, started: threading.Event, out: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=live.openai_url, api_key="x", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=48, stream=True, logit_bias=NO_EOS,
            messages=[{"role": "user", "content": "Count to one hundred."}])
        for chunk in stream:
            out.setdefault("fingerprints", set()).add(chunk.system_fingerprint)
            out.setdefault("times", []).append(time.monotonic())
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish"] = chunk.choices[0].finish_reason
            started.set()
    except Exception as exc:  # reported by the asserts
        out["error"] = exc
        started.set()


def test_a_switch_while_four_streams_run(box: tuple[LiveServer, str, str]) -> None:
    live, old, new = box
    assert _fingerprint(live) == f"fp_{old[:12]}"
    pace = measure(live.base_url)  # the waits below, at this box's present speed
    results: list[dict[str, Any]] = [{} for _ in range(4)]
    started = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(live, started[i], results[i]))
               for i in range(4)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(pace.bound(60, requests=4))
    _ops(live).activate(DEFAULT_MODEL, new[:12], by="cli:test")
    switched = time.monotonic()
    for t in threads:
        t.join(pace.bound(120, tokens=4 * 48, requests=4))
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["fingerprints"] == {f"fp_{old[:12]}"} and r["finish"] == "length"
    assert any(t > switched for r in results for t in r["times"])  # they ran across it
    assert _fingerprint(live) == f"fp_{new[:12]}"  # the next request: the new digest
    tags = httpx.get(f"{live.base_url}/api/tags").json()["models"]
    assert [m["digest"] for m in tags if m["name"] == DEFAULT_MODEL] == [new]
    show = ollama.Client(host=live.ollama_url).show(DEFAULT_MODEL)
    assert show.modelinfo and show.modelinfo["edge.digest"] == new
    models = openai.OpenAI(base_url=live.openai_url, api_key="x").models.list()
    assert [m.model_extra and m.model_extra["digest"] for m in models.data] == [new]
    deadline = time.monotonic() + 30  # the old version goes once its last stream ended
    while {m["digest"] for m in httpx.get(f"{live.base_url}/api/ps").json()["models"]} \
            != {new}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    history = _ops(live).history(DEFAULT_MODEL)
    assert (history[0].action, history[0].previous, history[0].by) == (
        "activate", old, "cli:test")


def test_a_live_rollout_holds_its_name_against_delete_and_copy(
        box: tuple[LiveServer, str, str]) -> None:
    """/api/delete and /api/copy onto a name a fleet rollout is changing on this box: 409
    in Ollama's shape, naming the rollout, and nothing changed; free again once it ends."""
    live, _, _ = box
    url, held = live.base_url, "held:1"
    client = ollama.Client(host=live.ollama_url)
    assert client.copy(DEFAULT_MODEL, held).status == "success"
    rollouts = RolloutStore(live.settings.state_dir / "rollouts.db")
    try:
        rollouts.create("ro-h", held, "2")
        rollouts.transition("ro-h", STAGED)
        for method, path, body in (
                ("DELETE", "/api/delete", {"model": held}),
                ("POST", "/api/copy", {"source": DEFAULT_MODEL, "destination": held})):
            r = httpx.request(method, f"{url}{path}", json=body)
            assert r.status_code == 409 and set(r.json()) == {"error"}, r.text
            assert f"{held} is being changed on this box by rollout ro-h (STAGED)" in \
                r.json()["error"]
        assert held in {m.model for m in client.list().models}
        rollouts.transition("ro-h", CANCELLED, live=False)
    finally:
        rollouts.close()
    assert httpx.request("DELETE", f"{url}/api/delete", json={"model": held}).status_code \
        == 200


def test_rollback_restores_the_previous_digest_and_survives_a_restart(
        box: tuple[LiveServer, str, str]) -> None:
    live, old, new = box
    assert _ops(live).rollback(DEFAULT_MODEL, by="cli:test").digest == old
    assert _fingerprint(live) == f"fp_{old[:12]}"
    live.stop()
    again = start_server(_settings(live.settings.state_dir))
    try:
        tags = httpx.get(f"{again.base_url}/api/tags").json()["models"]
        assert [m["digest"] for m in tags if m["name"] == DEFAULT_MODEL] == [old]
        assert {v.digest for v in _ops(again).versions(DEFAULT_MODEL)} == {old, new}
        assert _fingerprint(again) == f"fp_{old[:12]}"
        _copy_checks(again, old)
    finally:
        again.stop()


def _copy_checks(live: LiveServer, digest: str) -> None:
    """/api/copy: a second name for the same digest, with Ollama's client and shapes."""
    client = ollama.Client(host=live.ollama_url)
    assert client.copy(DEFAULT_MODEL, "copy:one").status == "success"
    tags = {m.model: m.digest for m in client.list().models}
    assert tags["copy:one"] == tags[DEFAULT_MODEL] == digest
    assert client.show("copy:one").modelinfo["edge.digest"] == digest  # type: ignore[index]
    url = f"{live.base_url}/api/copy"
    missing = httpx.post(url, json={"source": "nope:1", "destination": "x:1"})
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    bad = httpx.post(url, json={"source": DEFAULT_MODEL, "destination": "bad name"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    keys = KeyStore(live.settings.state_dir)
    plain, _ = keys.create("local")
    admin, _ = keys.create("local", admin=True)
    deadline = time.monotonic() + 20  # the server reads new keys within seconds
    while httpx.get(f"{live.base_url}/api/tags").status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    body = {"source": DEFAULT_MODEL, "destination": "copy:two"}
    refused = httpx.post(url, json=body, headers={"Authorization": f"Bearer {plain}"})
    assert refused.status_code == 403 and "operator key" in refused.json()["error"]
    done = httpx.post(url, json=body, headers={"Authorization": f"Bearer {admin}"})
    assert done.status_code == 200 and done.content == b""
    assert _ops(live).history("copy:two")[1].by == "operator:local"


def test_with_no_room_for_the_new_version_new_requests_wait_for_the_old_one(
        model_cache: Path, tmp_path: Path) -> None:
    """Memory for one version only: while the old version serves, the new one cannot load
    (503, Retry-After); once the old one's last user is done it is unloaded and the new one
    loads. (Two versions of a name take one of `max_loaded_models`' slots: memory is what
    stops them here.)"""
    import asyncio

    from edge_agent.engine.registry import ModelRegistry
    from edge_agent.errors import ServiceUnavailable

    state = clone_state(model_cache, tmp_path / "state")
    old, new = _second_digest(state, tmp_path)
    settings = load_settings(None, state_dir=state, **{
        "runtime.context_length": 256, "runtime.threads": 1})
    store = ModelStore(state)
    registry = ModelRegistry(settings, store)
    ops = ModelOps(ModelStore(state))  # the CLI's, beside the server's

    async def scenario() -> None:
        serving, _ = await registry.acquire(DEFAULT_MODEL)
        assert serving.info.digest == old
        registry.memory_budget = int(serving.memory * 1.5)  # one version, not two
        ops.activate(DEFAULT_MODEL, new, by="cli:test")
        with pytest.raises(ServiceUnavailable) as err:
            await registry.acquire(DEFAULT_MODEL)
        assert err.value.retry_after and "serving requests" in err.value.message
        await registry.release(serving)  # superseded: unloaded at once
        assert [m.info.digest for m in registry.loaded()] in ([], [new])
        fresh, _ = await registry.acquire(DEFAULT_MODEL)
        assert fresh.info.digest == new and registry.is_loaded(DEFAULT_MODEL)
        await registry.release(fresh)
        await registry.close()

    asyncio.run(scenario())
    store.close()
    ops.close()
