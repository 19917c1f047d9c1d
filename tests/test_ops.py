"""Health, readiness, metrics and access logs, against a live server."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent import __version__
from edge_agent.app import create_app
from edge_agent.config import load_settings
from edge_agent.errors import QueueFull
from edge_agent.logs import JsonFormatter, request_id_var
from edge_agent.telemetry.metrics import Metrics
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

pytestmark = pytest.mark.integration


def scrape(live: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{live.base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def counted(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    """A server of its own for the test that counts: on the session's server another
    test's request (a stream still ending, a probe) moves the same counters."""
    state = clone_state(model_cache, tmp_path_factory.mktemp("counted") / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 2048}))
    yield live
    live.stop()


def test_counters_and_histograms_move_by_the_usage_of_known_requests(
        counted: LiveServer) -> None:
    live_server = counted
    m = (("model", DEFAULT_MODEL),)
    md = (("dialect", "openai"), ("model", DEFAULT_MODEL))
    before = scrape(live_server)
    client = openai.OpenAI(base_url=live_server.openai_url, api_key="x", max_retries=0)
    usages = []
    for i in range(3):
        r = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=7, temperature=0,
                                           messages=[{"role": "user", "content": f"Hi {i}"}])
        assert r.usage
        usages.append(r.usage)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope:1", messages=[{"role": "user", "content": "x"}])
    after = scrape(live_server)

    def delta(name: str, labels: tuple[tuple[str, str], ...]) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    completion = sum(u.completion_tokens for u in usages)
    cached = sum((u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
                 for u in usages)
    prompt = sum(u.prompt_tokens for u in usages)
    assert delta("llamacpp:tokens_predicted_total", m) == completion
    assert delta("llamacpp:prompt_tokens_total", m) == prompt - cached
    assert delta("edge_agent_cached_prompt_tokens_total", m) == cached
    assert delta("edge_agent_time_to_first_token_seconds_count", md) == 3
    assert delta("edge_agent_request_duration_seconds_count", md) == 3
    assert delta("edge_agent_time_per_output_token_seconds_count", md) == 3
    assert delta("edge_agent_requests_total", (("dialect", "openai"), ("error_type", ""),
                                               ("model", DEFAULT_MODEL), ("status", "200"))) == 3
    assert delta("edge_agent_requests_total", (
        ("dialect", "openai"), ("error_type", "invalid_request_error"), ("model", ""),
        ("status", "404"))) == 1
    assert delta("edge_agent_rejections_total", (("reason", "not_found"),)) == 1
    assert after[("llamacpp:requests_processing", m)] == 0
    assert after[("edge_agent_loaded_models", ())] >= 1
    assert 0 < after[("llamacpp:kv_cache_usage_ratio", m)] < 1
    assert after[("edge_agent_memory_total_bytes", ())] > 0


def test_metrics_need_loopback_or_the_key(live_server: LiveServer) -> None:
    settings = live_server.settings.model_copy(update={"server": live_server.settings.server
                                                       .model_copy(update={"metrics_key": "k1"})})
    app = create_app(settings, preload=False)

    async def get(headers: dict[str, str]) -> httpx.Response:
        # An in-process transport with a documentation-range peer address: nothing is sent.
        transport = httpx.ASGITransport(app=app, client=("192.0.2.10", 50000))
        async with httpx.AsyncClient(transport=transport, base_url="http://box") as c:
            return await c.get("/metrics", headers=headers)

    denied = asyncio.run(get({}))
    assert denied.status_code == 401 and set(denied.json()) == {"error"}
    assert asyncio.run(get({"Authorization": "Bearer wrong"})).status_code == 401
    assert asyncio.run(get({"Authorization": "Bearer k1"})).status_code == 200


@pytest.fixture
def cold_server(model_cache: Path, tmp_path: Path) -> Iterator[LiveServer]:
    state = clone_state(model_cache, tmp_path / "state")
    settings = load_settings(None, state_dir=state, **{"server.port": free_port(),
                                                       "runtime.context_length": 256})
    live = start_server(settings, wait_for_model=None, preload=False)
    yield live
    live.stop()


def test_ready_is_503_until_the_default_model_is_loaded(cold_server: LiveServer) -> None:
    assert httpx.get(f"{cold_server.base_url}/health").json() == {
        "status": "ok", "edge_agent": __version__}
    r = httpx.get(f"{cold_server.base_url}/ready")
    assert r.status_code == 503
    assert r.json()["reasons"] == [f"default model {DEFAULT_MODEL} is not loaded"]
    httpx.post(f"{cold_server.base_url}/api/generate", timeout=60,
               json={"model": DEFAULT_MODEL}).raise_for_status()  # loads it
    r = httpx.get(f"{cold_server.base_url}/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_request_id_round_trip_and_access_line(live_server: LiveServer,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edge_agent.access")
    secret = "my card is 4111 1111 1111 1111"
    with httpx.stream("POST", f"{live_server.base_url}/api/chat", timeout=60,
                      headers={"X-Request-Id": "till-7-0042"},
                      json={"model": DEFAULT_MODEL, "options": {"num_predict": 3},
                            "messages": [{"role": "user", "content": secret}]}) as r:
        assert r.headers["x-request-id"] == "till-7-0042"
        list(r.iter_lines())
    generated = httpx.get(f"{live_server.base_url}/api/version").headers["x-request-id"]
    assert len(generated) == 32
    line = next(rec for rec in caplog.records if getattr(rec, "request_id", "") ==
                "till-7-0042")
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["status"] == 200 and fields["model"] == DEFAULT_MODEL
    assert fields["completion_tokens"] == 3 and fields["ttft_ms"] > 0
    assert fields["total_ms"] >= fields["ttft_ms"]
    formatted = JsonFormatter().format(line)
    assert json.loads(formatted)["request_id"] == "till-7-0042"
    # The card number in any spacing (not "4111" alone: a random hex id may hold it).
    for card in ("4111 1111 1111 1111", "4111111111111111", "1111 1111"):
        assert card not in formatted
        assert all(card not in r.getMessage() for r in caplog.records)


def test_json_formatter_puts_the_request_id_on_every_line() -> None:
    token = request_id_var.set("r-1")
    try:
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "hello %s", ("you",), None)
        entry = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert entry["msg"] == "hello you" and entry["request_id"] == "r-1"
    assert entry["level"] == "warning"


def test_an_error_is_counted_once_however_many_places_see_it() -> None:
    """The request path counts an error with its model; the API's handler sees the same
    error become a response and calls again without one: one count, the first."""
    metrics = Metrics(lambda: [])
    first = QueueFull("the queue for this model is full", retry_after=1.0)
    metrics.observe_error(DEFAULT_MODEL, "openai", first)
    metrics.observe_error("", "openai", first)
    metrics.observe_error(DEFAULT_MODEL, "openai", QueueFull("full again"))
    out = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(metrics.render().decode())
           for s in family.samples}
    labels = (("dialect", "openai"), ("error_type", "server_error"))
    assert out[("edge_agent_requests_total", (*labels, ("model", DEFAULT_MODEL),
                                              ("status", "503")))] == 2
    assert ("edge_agent_requests_total", (*labels, ("model", ""), ("status", "503"))) \
        not in out
    assert out[("edge_agent_rejections_total", (("reason", "queue_full"),))] == 2
