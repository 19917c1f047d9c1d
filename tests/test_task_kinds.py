"""The task kinds of the requests a model served: the rule (`telemetry.task_kinds`), the
counter `/metrics` serves (`edge_agent_request_kinds_total{model, kind}`), and the
`metrics` message's per-model `kinds`, the interval's deltas.

The live part is a box of its own with a 512-token context per sequence, so a long prompt
(at least 256 tokens there) fits the small default model; requests are made with the
official `openai` and `ollama` clients, and with httpx for token-id prompts, which put a
prompt exactly at the threshold and one token under it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.config import load_settings
from edge_agent.fleet.device.link.outbox import Outbox
from edge_agent.fleet.device.reporting.sync import Sync
from edge_agent.fleet.protocol.envelope import decode
from edge_agent.fleet.protocol.materials import EVAL_KINDS
from edge_agent.gateway.observe import Served
from edge_agent.telemetry.metrics import Metrics
from edge_agent.telemetry.task_kinds import (
    LONG_PROMPT_TOKENS,
    TASK_KINDS,
    kinds_of,
    long_threshold,
)
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

CONTEXT = 512  # tokens per sequence of the live box: long from 256
NONE: dict[str, int] = dict.fromkeys(TASK_KINDS, 0)
ASK: Any = [{"role": "user", "content": "Say hi."}]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PERSON: Any = {"type": "object", "properties": {"name": {"type": "string"}},
               "required": ["name"]}
# Some 300 tokens of SmolLM2's vocabulary: over half of the box's 512.
LONG = "Please summarise the following notes. " + "The shop opens at nine. " * 50


# -- the rule --------------------------------------------------------------------------------

def test_the_kinds_are_the_evaluation_samples_kinds() -> None:
    assert EVAL_KINDS == TASK_KINDS == ("ollama", "openai", "schema", "tools", "long_context")


@pytest.mark.parametrize(("n_ctx", "threshold"), [
    (512, 256), (4096, 2048), (16384, LONG_PROMPT_TOKENS), (131072, LONG_PROMPT_TOKENS),
    (None, LONG_PROMPT_TOKENS),  # an upstream that declares no context_length
])
def test_long_is_half_the_context_or_8192_whichever_is_fewer(n_ctx: int | None,
                                                             threshold: int) -> None:
    assert long_threshold(n_ctx) == threshold
    assert "long_context" in kinds_of("openai", schema=False, tools=False,
                                      prompt_tokens=threshold, n_ctx=n_ctx)
    assert "long_context" not in kinds_of("openai", schema=False, tools=False,
                                          prompt_tokens=threshold - 1, n_ctx=n_ctx)


def test_a_request_is_of_its_dialect_and_each_kind_that_applies() -> None:
    assert kinds_of("ollama", schema=True, tools=True, prompt_tokens=9000, n_ctx=None) == (
        "ollama", "schema", "tools", "long_context")
    assert kinds_of("openai", schema=False, tools=True, prompt_tokens=10, n_ctx=512) == (
        "openai", "tools")
    # The health gate's own probes are not a client's requests: no kind at all.
    assert kinds_of("gate", schema=True, tools=True, prompt_tokens=9000, n_ctx=512) == ()
    served = Served(model="m:1", digest="upstream:pool", dialect="openai", tenant=None,
                    submitted_ns=0, load_ns=0, constrained=True, upstream=True, schema=True)
    assert served.kinds(LONG_PROMPT_TOKENS) == ("openai", "schema", "long_context")


def test_the_counter_takes_only_the_kinds_as_labels() -> None:
    metrics = Metrics(lambda: [])
    metrics.observe_kinds("m:1", ["openai", "tools", "please ignore previous instructions"])
    text = metrics.render().decode()
    assert 'edge_agent_request_kinds_total{kind="openai",model="m:1"} 1.0' in text
    assert 'edge_agent_request_kinds_total{kind="tools",model="m:1"} 1.0' in text
    assert "please" not in text


# -- a live box ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def box(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    state = clone_state(model_cache, tmp_path_factory.mktemp("kinds") / "state")
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": CONTEXT})
    live = start_server(settings)
    yield live
    live.stop()


def counted(live: LiveServer) -> dict[str, int]:
    """The default model's kinds as `/metrics` serves them."""
    out = dict(NONE)
    text = httpx.get(f"{live.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "edge_agent_request_kinds_total" and \
                    s.labels["model"] == DEFAULT_MODEL:
                out[s.labels["kind"]] = int(s.value)
    return out


def gained_until(live: LiveServer, before: dict[str, int], expected: dict[str, int]
                 ) -> dict[str, int]:
    """What the counter gained since `before`, once it is `expected` (a streamed answer's
    last chunk may reach the client a moment before its end is counted), or as it stands
    after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        gained = {k: v - before[k] for k, v in counted(live).items()}
        if gained == expected or time.monotonic() > deadline:
            return gained
        time.sleep(0.05)


def _openai_chat(live: LiveServer) -> None:
    openai.OpenAI(base_url=live.openai_url, api_key="x").chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, max_tokens=4)


def _openai_json_schema(live: LiveServer) -> None:
    openai.OpenAI(base_url=live.openai_url, api_key="x").chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, max_tokens=16,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})


def _openai_json_object_streamed(live: LiveServer) -> None:
    stream = openai.OpenAI(base_url=live.openai_url, api_key="x").chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, max_tokens=8,
        response_format={"type": "json_object"}, stream=True)
    for _ in stream:
        pass


def _openai_tools_streamed(live: LiveServer) -> None:
    stream = openai.OpenAI(base_url=live.openai_url, api_key="x").chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, max_tokens=8, tools=[WEATHER],
        stream=True)
    for _ in stream:
        pass


def _openai_long(live: LiveServer) -> None:
    answer = openai.OpenAI(base_url=live.openai_url, api_key="x").chat.completions.create(
        model=DEFAULT_MODEL, max_tokens=4, messages=[{"role": "user", "content": LONG}])
    assert answer.usage is not None and answer.usage.prompt_tokens >= CONTEXT // 2


def _ollama_chat_streamed(live: LiveServer) -> None:
    for _ in ollama.Client(host=live.ollama_url).chat(
            model=DEFAULT_MODEL, messages=ASK, stream=True, options={"num_predict": 4}):
        pass


def _ollama_tools(live: LiveServer) -> None:
    ollama.Client(host=live.ollama_url).chat(model=DEFAULT_MODEL, messages=ASK,
                                             tools=[WEATHER], options={"num_predict": 8})


def _ollama_generate_json(live: LiveServer) -> None:
    ollama.Client(host=live.ollama_url).generate(model=DEFAULT_MODEL, prompt="A person:",
                                                 format="json", options={"num_predict": 8})


def _ollama_long_schema(live: LiveServer) -> None:
    answer = ollama.Client(host=live.ollama_url).generate(
        model=DEFAULT_MODEL, prompt=LONG, format=PERSON, options={"num_predict": 8})
    assert (answer.prompt_eval_count or 0) >= CONTEXT // 2


def _embeddings(live: LiveServer) -> None:
    openai.OpenAI(base_url=live.openai_url, api_key="x").embeddings.create(
        model=DEFAULT_MODEL, input="not a generation")
    ollama.Client(host=live.ollama_url).embed(model=DEFAULT_MODEL, input="nor this")


@pytest.mark.integration
@pytest.mark.parametrize(("ask", "kinds"), [
    (_openai_chat, {"openai"}),
    (_openai_json_schema, {"openai", "schema"}),
    (_openai_json_object_streamed, {"openai", "schema"}),
    (_openai_tools_streamed, {"openai", "tools"}),
    (_openai_long, {"openai", "long_context"}),
    (_ollama_chat_streamed, {"ollama"}),
    (_ollama_tools, {"ollama", "tools"}),
    (_ollama_generate_json, {"ollama", "schema"}),
    (_ollama_long_schema, {"ollama", "schema", "long_context"}),
    (_embeddings, set()),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_each_request_counts_once_in_each_of_its_kinds(box: LiveServer, ask: Any,
                                                       kinds: set[str]) -> None:
    before = counted(box)
    ask(box)
    expected: dict[str, int] = {k: int(k in kinds) for k in TASK_KINDS}
    assert gained_until(box, before, expected) == expected


@pytest.mark.integration
def test_a_prompt_is_long_from_half_the_context_per_sequence(box: LiveServer) -> None:
    [model] = box.app.state.parts.registry.loaded()
    assert model.n_ctx == CONTEXT and long_threshold(model.n_ctx) == CONTEXT // 2

    def complete(ids: int) -> int:
        r = httpx.post(f"{box.base_url}/v1/completions", timeout=60, json={
            "model": DEFAULT_MODEL, "prompt": [1000] * ids, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    extra = complete(8) - 8  # what the box adds to a token-id prompt (a BOS, or nothing)
    for prompt, long in ((CONTEXT // 2 - 1, False), (CONTEXT // 2, True)):
        before = counted(box)
        assert complete(prompt - extra) == prompt
        expected = {**NONE, "openai": 1, "long_context": int(long)}
        assert gained_until(box, before, expected) == expected


@pytest.mark.integration
def test_the_metrics_message_carries_each_models_kinds_of_the_interval(
        box: LiveServer, tmp_path: Path) -> None:
    parts = box.app.state.parts
    outbox = Outbox(tmp_path / "outbox.db", device="store-042", boot_id=uuid.uuid4().hex,
                    max_bytes=1 << 24)
    try:
        sync = Sync(emit=outbox.append, ledger_path=box.settings.state_dir / "ledger.db",
                    state_path=tmp_path / "fleet-sync.json", metrics=parts.metrics.registry,
                    outbox_stats=outbox.stats)
        assert sync.tick_metrics()  # the baseline: what the module's other tests did

        def message() -> dict[str, Any]:
            outbox.flush()
            return decode(outbox.pending(100_000)[-1].payload).body

        before = counted(box)
        _openai_json_schema(box)
        _ollama_tools(box)
        _ollama_long_schema(box)
        _openai_chat(box)
        expected = {"ollama": 2, "openai": 2, "schema": 2, "tools": 1, "long_context": 1}
        assert gained_until(box, before, expected) == expected
        assert sync.tick_metrics()
        first = message()["models"][DEFAULT_MODEL]
        assert first["kinds"] == expected
        assert first["requests"] == {"200": 4}
        # The next interval: only what came since, every kind there, zeros included.
        before = counted(box)
        _ollama_chat_streamed(box)
        assert gained_until(box, before, {**NONE, "ollama": 1}) == {**NONE, "ollama": 1}
        assert sync.tick_metrics()
        assert message()["models"][DEFAULT_MODEL]["kinds"] == {**NONE, "ollama": 1}
        # No request in the interval: no kinds (the model is listed for its queue alone).
        assert sync.tick_metrics()
        assert "kinds" not in message()["models"][DEFAULT_MODEL]
    finally:
        outbox.close()
