"""The second catalog model: a base model whose chat template comes from the catalog."""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest

from edge_agent.engine.models.catalog import ModelStore
from tests.conftest import DEFAULT_MODEL, LiveServer

pytestmark = pytest.mark.integration
GEMMA = "gemma3:270m"


def test_gemma_uses_the_catalog_template_then_unloads_and_deletes(
        live_server: LiveServer) -> None:
    store = ModelStore(live_server.settings.state_dir)
    model = store.pull(GEMMA)
    assert model.template_source == "catalog"
    client = ollama.Client(host=live_server.ollama_url)
    show = client.show(GEMMA)
    assert show.template and "<start_of_turn>" in show.template

    oa = openai.OpenAI(base_url=live_server.openai_url, api_key="x", max_retries=0)
    r = oa.chat.completions.create(model=GEMMA, temperature=0, max_tokens=24,
                                   messages=[{"role": "user", "content": "Name a colour."}])
    text = r.choices[0].message.content or ""
    assert text.strip()
    # The turn marker is a stop string from the catalog entry: it never leaks into text.
    assert "<end_of_turn>" not in text and "<start_of_turn>" not in text
    assert r.usage and r.usage.prompt_tokens > 5

    # keep_alive 0: unloaded right after the request, as Ollama does.
    client.chat(model=GEMMA, keep_alive=0, options={"num_predict": 4},
                messages=[{"role": "user", "content": "Hi"}])
    names = [m.model for m in client.ps().models]
    assert GEMMA not in names and DEFAULT_MODEL in names

    httpx.request("DELETE", f"{live_server.base_url}/api/delete",
                  json={"model": GEMMA}).raise_for_status()
    assert GEMMA not in [m.model for m in client.list().models]
    assert not model.blob_path(live_server.settings.state_dir).exists()
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=GEMMA, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 404


def test_empty_chat_loads_and_keep_alive_zero_unloads(live_server: LiveServer) -> None:
    client = ollama.Client(host=live_server.ollama_url)
    r = client.chat(model=DEFAULT_MODEL, messages=[])
    assert r.done and r.done_reason == "load"
    assert DEFAULT_MODEL in [m.model for m in client.ps().models]
