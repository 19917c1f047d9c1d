"""The box as the store's gateway to an upstream ([upstreams], [routing]): a real
OpenAI-compatible upstream on loopback (a second box with its own model, standing in for the
central team's GPU pool), reached through a relay that keeps every byte the box sends it,
and the official `openai` and `ollama` clients against the box, unchanged.

The box serves smollm2:135m with a 512-token context, one sequence and one place to wait;
the pool serves the same model with 2048 tokens, under two names the box maps
(`pool-only:1b`, which the box does not hold, and `smollm2:135m` itself). Three tenants
draw the data boundary: `open` (egress allowed), `careful` (redacted) and `private`
(never).
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from tests.support.hostile_upstream import HostileUpstream
from tests.support.tcpproxy import TCPProxy

pytestmark = pytest.mark.integration

POOL_ONLY = "pool-only:1b"
HOSTILE = ("hang", "trickle", "error", "cut", "offschema", "huge")
TENANTS = {"open": "allowed", "careful": "redacted", "private": "never"}


@dataclass
class Gateway:
    box: LiveServer
    pool: LiveServer
    relay: TCPProxy
    hostile: HostileUpstream
    keys: dict[str, str]

    def openai(self, tenant: str, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.box.openai_url, api_key=self.keys[tenant],
                             max_retries=0, timeout=120, **kwargs)

    def ollama(self, tenant: str) -> ollama.Client:
        return ollama.Client(host=self.box.base_url, timeout=120,
                             headers={"Authorization": f"Bearer {self.keys[tenant]}"})

    def post(self, tenant: str, path: str, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(f"{self.box.base_url}{path}", json=body, timeout=120, headers={
            "Authorization": f"Bearer {self.keys[tenant]}", **(headers or {})})

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.box.base_url}/metrics", timeout=30).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(name + "{"):
                got = ",".join(sorted(line[len(name) + 1:line.index("}")].split(",")))
                if got == want:
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def gateway(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("upstream")
    pool = start_server(load_settings(None, state_dir=clone_state(model_cache, root / "pool"),
                                      **{"server.port": free_port(),
                                         "runtime.context_length": 2048}))
    relay = TCPProxy(int(pool.base_url.rsplit(":", 1)[1]))
    hostile = HostileUpstream()
    state = clone_state(model_cache, root / "box")
    store = KeyStore(state)
    keys = {tenant: store.create(tenant)[0] for tenant in TENANTS}
    config = root / "config.toml"
    config.write_text("".join(f'[tenants.{t}]\negress = "{e}"\n' for t, e in TENANTS.items())
                      + f"""
[upstreams.pool]
base_url = "http://127.0.0.1:{relay.port}/v1"
models = {{ "{POOL_ONLY}" = "{DEFAULT_MODEL}", "{DEFAULT_MODEL}" = "{DEFAULT_MODEL}" }}
context_length = 2048
json_schema = true
tools = true
failures_to_open = 2
open_s = 1.0
first_token_timeout_s = 20
read_timeout_s = 20

[upstreams.hostile]
base_url = "http://127.0.0.1:{hostile.port}/v1"
models = {{ {", ".join(f'"{m}:1b" = "{m}"' for m in HOSTILE)} }}
json_schema = true
first_token_timeout_s = 2
read_timeout_s = 2
max_response_bytes = 1048576
failures_to_open = 100
max_concurrency = 32
""")
    box = start_server(load_settings(config, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512, "runtime.parallel": 1,
        "runtime.max_queue": 1}))
    yield Gateway(box, pool, relay, hostile, keys)
    box.stop()
    hostile.close()
    relay.close()
    pool.stop()


def _route(response: httpx.Response) -> str:
    return response.headers.get("x-edge-route", "")


def test_a_model_only_the_pool_has_is_answered_there_in_both_dialects(
        gateway: Gateway) -> None:
    """Not installed here, served by the pool: the OpenAI and Ollama clients, streamed and
    not, get the pool's answer under the name they asked; the ledger says where and why."""
    client = gateway.openai("open")
    raw = client.chat.completions.with_raw_response.create(
        model=POOL_ONLY, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0)
    answer = raw.parse()
    assert answer.model == POOL_ONLY and answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert raw.headers["x-edge-route"] == "upstream; upstream=pool; reason=not_installed"
    row = gateway.box.ledger_row(raw.headers["x-request-id"])
    assert (row["route"], row["upstream"], row["route_reason"], row["egress"]) == \
        ("upstream", "pool", "not_installed", "allowed")
    assert row["model"] == POOL_ONLY and row["model_digest"] == "upstream:pool"
    assert row["egress_bytes"] > 0 and row["upstream_ms"] > 0 and row["status"] == 200
    # Counted with the box's requests, never as the local engine's tokens.
    assert gateway.metric("edge_agent_requests_total", model=POOL_ONLY, dialect="openai",
                          status="200", error_type="") >= 1
    assert gateway.metric("llamacpp:tokens_predicted_total", model=POOL_ONLY) == 0

    chunks = list(client.chat.completions.create(
        model=POOL_ONLY, messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

    completion = client.completions.create(model=POOL_ONLY, prompt="The sky is",
                                           max_tokens=6, temperature=0)
    assert completion.choices[0].text

    ol = gateway.ollama("open")
    said = ol.chat(model=POOL_ONLY, messages=[{"role": "user", "content": "Hi"}],
                   options={"num_predict": 6, "temperature": 0})
    assert said.message.content and said.done and said.eval_count > 0
    parts = list(ol.generate(model=POOL_ONLY, prompt="Name a color.", stream=True,
                             options={"num_predict": 6, "temperature": 0}))
    assert parts[-1].done and "".join(p.response for p in parts[:-1])


def test_the_route_header_asks_for_a_side(gateway: Gateway) -> None:
    """`X-Edge-Route: upstream` sends a model the box holds to the pool; `local` keeps a
    pool-only model here (404); a bad value is a 400 naming the header."""
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4}
    sent = gateway.post("open", "/v1/chat/completions", body, {"X-Edge-Route": "upstream"})
    assert sent.status_code == 200 and _route(sent).endswith("reason=asked"), sent.text
    here = gateway.post("open", "/v1/chat/completions", body, {"X-Edge-Route": "local"})
    assert here.status_code == 200 and not _route(here)
    kept = gateway.post("open", "/v1/chat/completions", {**body, "model": POOL_ONLY},
                        {"X-Edge-Route": "local"})
    assert kept.status_code == 404, kept.text
    bad = gateway.post("open", "/api/chat", {**body, "stream": False},
                       {"X-Edge-Route": "elsewhere"})
    assert bad.status_code == 400 and "X-Edge-Route" in bad.json()["error"]


def test_a_prompt_over_the_box_context_goes_to_the_pool(gateway: Gateway) -> None:
    long = "Here is a list of fruit: " + ", ".join(["apple", "pear", "plum"] * 120) + "."
    answer = gateway.post("open", "/v1/chat/completions", {
        "model": DEFAULT_MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": long}]})
    assert answer.status_code == 200, answer.text
    assert _route(answer).endswith("reason=context")
    assert answer.json()["usage"]["prompt_tokens"] > 512


def test_a_schema_answer_from_the_pool_is_checked_and_valid(gateway: Gateway) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string",
                                                         "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    answer = gateway.post("open", "/v1/chat/completions", {
        "model": POOL_ONLY, "max_tokens": 20,
        "messages": [{"role": "user", "content": "Pick a color."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "c", "schema": schema}}})
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.json()["choices"][0]["message"]["content"])["color"] in \
        ("red", "blue")


LONG = {"model": DEFAULT_MODEL, "stream": True, "logit_bias": NO_EOS, "max_tokens": 400,
        "messages": [{"role": "user", "content": "Tell a long story."}]}
QUICK = {"model": DEFAULT_MODEL, "max_tokens": 4,
         "messages": [{"role": "user", "content": "Hi"}]}


@contextlib.contextmanager
def _saturated(gateway: Gateway) -> Iterator[None]:
    """The box's one sequence held by a long answer and its one place by a second: the
    model is saturated until the block ends (both closed, the box idle again)."""
    auth = {"Authorization": f"Bearer {gateway.keys['open']}"}
    with httpx.Client(base_url=gateway.box.base_url, timeout=120, headers=auth) as one, \
            one.stream("POST", "/v1/chat/completions", json=LONG) as running:
        lines = running.iter_lines()  # held: a dropped iterator would close the stream
        next(line for line in lines if line.startswith("data:"))
        with httpx.Client(base_url=gateway.box.base_url, timeout=120,
                          headers=auth) as two, \
                two.stream("POST", "/v1/chat/completions", json=LONG) as waiting:
            yield
            waiting.close()
        running.close()
    _wait_idle(gateway)


def test_a_saturated_box_spills_normal_requests_to_the_pool(gateway: Gateway) -> None:
    """One sequence, one place to wait: while a long answer holds the one and another waits
    in the other, a normal-tier request is answered by the pool (the ledger says
    `saturated`); a high-tier one is refused, never sent elsewhere."""
    with _saturated(gateway):
        deadline = time.monotonic() + 30
        while (spilled := gateway.post("open", "/v1/chat/completions", QUICK)
               ).status_code == 200 and not _route(spilled):
            assert time.monotonic() < deadline, "the second stream never waited"
        assert spilled.status_code == 200, spilled.text
        assert _route(spilled).endswith("reason=saturated")
        row = gateway.box.ledger_row(spilled.headers["x-request-id"])
        assert row["route_reason"] == "saturated" and row["risk_tier"] == "normal"
        refused = gateway.post("open", "/v1/chat/completions", QUICK,
                               {"X-Edge-Risk": "high"})
        assert refused.status_code == 503, refused.text


def test_a_saturated_box_whose_upstream_fails_keeps_its_own_policy(gateway: Gateway) -> None:
    """The link cut while the box is saturated: the request gets the box's own answer for
    a saturated model (here 503, no fallback model set) at once, never the upstream's
    failure; the link back, the pool answers again."""
    with _saturated(gateway):
        gateway.relay.cut()
        try:
            deadline = time.monotonic() + 30
            while (answer := gateway.post("open", "/v1/chat/completions", QUICK)
                   ).status_code == 200:  # until the second stream waits
                assert time.monotonic() < deadline, "the second stream never waited"
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "risk_not_degraded", answer.text
        finally:
            gateway.relay.restore()
    _wait_pool(gateway)


def _wait_pool(gateway: Gateway) -> None:
    """Until the pool answers through the box again (its breaker closed)."""
    deadline = time.monotonic() + 60
    while gateway.post("open", "/v1/chat/completions", {
            "model": POOL_ONLY, "max_tokens": 1, "messages": [
                {"role": "user", "content": "Hi"}]}).status_code != 200:
        assert time.monotonic() < deadline, "the pool never came back"
        time.sleep(0.2)


def _wait_idle(gateway: Gateway) -> None:
    """Until the box's own sequence answers again (the closed streams cancelled)."""
    deadline = time.monotonic() + 60
    while gateway.post("open", "/v1/chat/completions", {
            "model": DEFAULT_MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": "Hi"}]}, {"X-Edge-Route": "local"}
            ).status_code != 200:
        assert time.monotonic() < deadline, "the box stayed busy"
        time.sleep(0.1)


# --- the data boundary -----------------------------------------------------------------------

PII = {"email": "jane.doe@example.com", "phone": "+44 20 7946 0958",
       "iban": "DE89370400440532013000"}


def _copy_prompt(value: str) -> str:
    """A raw prompt a small model continues by copying its last line (placeholders in
    angle brackets among its examples, as the pool's model sees the request)."""
    return ("Copy each line.\nLine: <NAME>\nCopy: <NAME>\nLine: <CITY>\nCopy: <CITY>\n"
            f"Line: {value}\nCopy:")


def test_a_redacted_tenants_personal_data_leaves_only_as_placeholders(
        gateway: Gateway) -> None:
    """The pool sees placeholders, never the values; the answer has the values back,
    streamed and not, in both dialects."""
    before = len(gateway.relay.sent)
    for value in PII.values():
        done = gateway.post("careful", "/api/generate", {
            "model": POOL_ONLY, "prompt": _copy_prompt(value), "raw": True, "stream": False,
            "options": {"num_predict": 16, "temperature": 0, "stop": ["\n"]}})
        assert done.status_code == 200, done.text
        assert value in done.json()["response"], (value, done.json()["response"])
        row = gateway.box.ledger_row(done.headers["x-request-id"])
        assert row["egress"] == "redacted" and row["egress_entities"] >= 1
    streamed = gateway.ollama("careful").generate(
        model=POOL_ONLY, prompt=_copy_prompt(PII["email"]), raw=True, stream=True,
        options={"num_predict": 16, "temperature": 0, "stop": ["\n"]})
    assert PII["email"] in "".join(part.response for part in streamed)
    chunks = gateway.openai("careful").completions.create(
        model=POOL_ONLY, prompt=_copy_prompt(PII["iban"]), max_tokens=16, temperature=0,
        stop=["\n"], stream=True)
    assert PII["iban"] in "".join(c.choices[0].text for c in chunks if c.choices)
    sent = bytes(gateway.relay.sent[before:])
    assert b"<EMAIL" in sent and b"<IBAN" in sent
    for value in PII.values():
        assert value.encode() not in sent and value.replace(" ", "").encode() not in sent


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1,
                    max_size=40),
       model=st.sampled_from([POOL_ONLY, DEFAULT_MODEL]),
       route=st.sampled_from([None, "upstream", "local"]),
       path=st.sampled_from(["/v1/chat/completions", "/api/chat", "/api/generate"]))
def test_nothing_of_a_never_tenant_ever_leaves_the_box(gateway: Gateway, text: str,
                                                       model: str, route: str | None,
                                                       path: str) -> None:
    """Whatever a `never` tenant sends, to whichever model, asking whichever side: not one
    request of it reaches the pool (the relay sees no byte), and it is answered here or
    refused with the reason."""
    marker = f"marker-{time.monotonic_ns()}"
    before = len(gateway.relay.sent)
    prompt = f"{marker} {text}"
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "stream": False}
    if path == "/api/generate":
        body = {"model": model, "prompt": prompt, "stream": False,
                "options": {"num_predict": 1}}
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    answer = gateway.post("private", path, body, {"X-Edge-Route": route} if route else {})
    assert answer.status_code in (200, 403, 404, 503), answer.text
    if answer.status_code == 403:
        assert "egress" in answer.text
    if answer.status_code == 503:  # the box's own model busy: refused here, not sent
        assert "risk_not_degraded" in answer.text
    assert len(gateway.relay.sent) == before
    assert not re.search(re.escape(marker).encode(), bytes(gateway.relay.sent))


# --- an upstream that misbehaves ------------------------------------------------------------

def test_a_hostile_upstream_gets_a_clear_error_and_the_box_stays_responsive(
        gateway: Gateway) -> None:
    """Hanging, trickling, a 500, a stream cut short, an answer off its schema, 50 MB in
    one line: each request ends within its bounds with a 502 in the dialect's shape (an
    error event where a stream had started: only the cut one, whose first tokens came),
    the ledger keeps its row, and the box's own model answers meanwhile as fast as it
    does alone."""
    import concurrent.futures

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}

    def ask(mode: str, stream: bool) -> tuple[str, bool, int, str, float, str]:
        body: dict[str, Any] = {"model": f"{mode}:1b", "max_tokens": 8, "stream": stream,
                                "messages": [{"role": "user", "content": "Hi"}]}
        if mode == "offschema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": schema}}
        started = time.monotonic()
        answer = gateway.post("open", "/v1/chat/completions", body)
        return (mode, stream, answer.status_code, answer.text,
                time.monotonic() - started, answer.headers.get("x-request-id", ""))

    def local() -> float:
        started = time.monotonic()
        answer = gateway.post("open", "/v1/chat/completions", {
            "model": DEFAULT_MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]}, {"X-Edge-Route": "local"})
        assert answer.status_code == 200, answer.text
        return time.monotonic() - started

    alone = sorted(local() for _ in range(3))[1]
    with concurrent.futures.ThreadPoolExecutor(len(HOSTILE) * 2) as pool:
        futures = [pool.submit(ask, mode, stream) for mode in HOSTILE
                   for stream in (False, True)]
        beside = sorted(local() for _ in range(3))[1]
        results = [f.result(timeout=60) for f in futures]
    assert beside < max(1.0, alone * 3), (alone, beside)  # not held up by the upstream
    for mode, stream, status, text, seconds, request_id in results:
        assert seconds < 15, (mode, stream, seconds)
        if stream and mode == "cut":  # the head went out: the error is the last event
            assert status == 200 and "upstream_error" in text and "[DONE]" in text, \
                (mode, text[-300:])
        else:  # failed before its first token: the response's own status
            assert status == 502, (mode, text)
            error = json.loads(text)["error"]
            assert error["code"] == "upstream_error" and "hostile" in error["message"]
        row = gateway.box.ledger_row(request_id)
        assert row["upstream"] == "hostile" and row["route_reason"] == "not_installed"
    assert gateway.hostile.sent_bytes.get("huge", 0) < 50 * 1024 * 1024  # it stopped reading


# --- a link that fails -----------------------------------------------------------------------

def test_a_dead_upstream_opens_the_breaker_and_closes_it_again(gateway: Gateway) -> None:
    """The link cut: the first requests fail fast (502), the breaker opens after two, and
    then a pool-only model is 503 with Retry-After at once, while the box's own model
    answers as before; the link back, a probe closes the breaker and the pool answers."""
    body = {"model": POOL_ONLY, "max_tokens": 4, "messages": [{"role": "user",
                                                               "content": "Hi"}]}
    gateway.relay.cut()
    try:
        statuses = []
        deadline = time.monotonic() + 60
        while gateway.metric("edge_agent_upstream_breaker_state", upstream="pool") != 2:
            assert time.monotonic() < deadline, statuses
            started = time.monotonic()
            answer = gateway.post("open", "/v1/chat/completions", body)
            statuses.append((answer.status_code, round(time.monotonic() - started, 2)))
            assert answer.status_code in (502, 503), answer.text
        assert all(seconds < 10 for _, seconds in statuses), statuses
        started = time.monotonic()
        refused = gateway.post("open", "/v1/chat/completions", body)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert time.monotonic() - started < 1.0
        local = gateway.post("open", "/v1/chat/completions", {**body, "model": DEFAULT_MODEL})
        assert local.status_code == 200 and not _route(local)
    finally:
        gateway.relay.restore()
    deadline = time.monotonic() + 60
    while True:  # the probe runs once a request finds the wait over
        answer = gateway.post("open", "/v1/chat/completions", body)
        if answer.status_code == 200:
            break
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.2)
    assert gateway.metric("edge_agent_upstream_breaker_state", upstream="pool") == 0


# --- what the technician sees -----------------------------------------------------------------

def test_doctor_checks_each_upstream(gateway: Gateway, tmp_path: Path) -> None:
    """Reachable with its models listed (the pool); reachable but missing a model it is
    mapped to (the hostile one lists none); a key file others may read; nothing there."""
    from edge_agent.config import UpstreamSettings
    from edge_agent.doctor import run_checks

    checks = {c.name: c for c in run_checks(gateway.box.settings)}
    assert checks["upstream pool"].status == "ok", checks["upstream pool"]
    assert checks["upstream hostile"].status == "warn" and \
        "does not list" in checks["upstream hostile"].detail
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    key.chmod(0o644)
    loose = UpstreamSettings(base_url=gateway.pool.openai_url, api_key_file=key)
    shown = {c.name: c for c in run_checks(gateway.box.settings.model_copy(
        update={"upstreams": {"loose": loose, "gone": UpstreamSettings(
            base_url=f"http://127.0.0.1:{free_port()}/v1")}}))}
    assert shown["upstream loose"].status == "fail" and "chmod 600" in shown[
        "upstream loose"].fix
    assert shown["upstream gone"].status == "warn" and "answered here meanwhile" in shown[
        "upstream gone"].detail


def test_the_manuals_example_runs(gateway: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    page = Path(__file__).resolve().parents[1] / "docs" / "api" / "upstreams.md"
    block = re.search(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
    assert block is not None
    code = block.group(1).replace("http://store-box.local:11434/v1", gateway.box.openai_url)
    code = code.replace('"ea-pos-…"', repr(gateway.keys["open"]))
    exec(compile(code, str(page), "exec"), {})
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] and out[-1] == "upstream; upstream=pool; reason=not_installed", out


def test_the_upstream_bench_runs_its_three_servers(model_cache: Path, tmp_path: Path) -> None:
    """`edge-agent bench upstream`, small: every request of both phases answered (none
    refused: what the box cannot take spills), the added time and the chunks measured."""
    from edge_agent.bench.serving.upstream import run_upstream_bench

    lines: list[str] = []
    result = run_upstream_bench(
        clone_state(model_cache, tmp_path / "box"), DEFAULT_MODEL, threads=1, context=512,
        clients=5, requests=1, parallel=1, pool_parallel=2, max_tokens=8, passes=2,
        pool_dir=clone_state(model_cache, tmp_path / "pool"), echo=lines.append)
    assert result["refused_local"] == 0 and result["refused_spill"] == 0, lines
    assert result["tokens_per_s_local"] > 0 and result["tokens_per_s_spill"] > 0
    assert len(result["added_ttft_ms_passes"]) == 2 and result["chunks_ratio"] > 0
    assert any("TTFT the box adds" in line for line in lines), lines


TOOLS = [{"type": "function", "function": {
    "name": "find_product", "description": "Look a product up by its name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}]


def test_tools_pass_through_to_the_pool_in_both_dialects(gateway: Gateway) -> None:
    """A tool call answered by the pool comes back as the dialect's tool call, streamed
    and not: the box passes `tools` to an upstream that declares them."""
    ask = [{"role": "user", "content": "Find the product called oat milk."}]
    client = gateway.openai("open")
    answer = client.chat.completions.create(model=POOL_ONLY, messages=ask, tools=TOOLS,
                                            tool_choice="required", max_tokens=48)
    [call] = answer.choices[0].message.tool_calls or []
    assert call.function.name == "find_product" and "name" in json.loads(
        call.function.arguments)
    assert answer.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(
        model=POOL_ONLY, messages=ask, tools=TOOLS, tool_choice="required", max_tokens=48,
        stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function and d.function.name] == \
        ["find_product"]
    # The arguments as they came, in pieces after the name (OpenAI's streamed shape).
    pieces = [d.function.arguments for d in deltas if d.function and d.function.arguments]
    assert len(pieces) > 1 and "name" in json.loads("".join(pieces)), pieces
    said = gateway.ollama("open").chat(model=POOL_ONLY, messages=ask, tools=TOOLS,
                                       options={"num_predict": 48, "temperature": 0})
    assert [c.function.name for c in said.message.tool_calls or []] == ["find_product"], said


def test_a_batch_drains_through_the_pool_while_the_box_is_busy(gateway: Gateway) -> None:
    """While a long answer holds the box's one sequence, a batch's lines go to the pool
    (it is idle: at most half of its places taken) instead of waiting for the sequence;
    their rows say `batch`, and the batch completes before the long answer ends."""
    auth = {"Authorization": f"Bearer {gateway.keys['open']}"}
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": {
                                    "model": DEFAULT_MODEL, "max_tokens": 4, "messages": [
                                        {"role": "user", "content": f"Name fruit {i}."}]}})
                    + "\n" for i in range(3))
    with httpx.Client(base_url=gateway.box.base_url, timeout=120, headers=auth) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG) as running:
            events = running.iter_lines()
            next(line for line in events if line.startswith("data:"))
            uploaded = client.post("/v1/files", files={"file": ("b.jsonl", lines.encode())},
                                   data={"purpose": "batch"})
            assert uploaded.status_code == 200, uploaded.text
            batch = client.post("/v1/batches", json={
                "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}).json()
            deadline = time.monotonic() + 60
            while (status := client.get(f"/v1/batches/{batch['id']}").json())["status"] \
                    not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
            still = next(line for line in events if line.startswith("data:"))
            assert '"finish_reason":null' in still.replace(" ", "")  # the answer goes on
            running.close()
        assert status["status"] == "completed" and status["request_counts"]["completed"] == 3
        output = client.get(f"/v1/files/{status['output_file_id']}/content").text
        ids = [json.loads(line)["response"]["request_id"] for line in output.splitlines()]
    assert gateway.box.app.state.parts.ledger.flush()
    db = sqlite3.connect(gateway.box.settings.state_dir / "ledger.db")
    rows = db.execute(f"SELECT route, route_reason, batch_id FROM requests WHERE id IN "
                      f"({','.join('?' * len(ids))})", ids).fetchall()
    db.close()
    assert set(rows) == {("upstream", "batch", batch["id"])} and len(rows) == 3, rows
    _wait_idle(gateway)
