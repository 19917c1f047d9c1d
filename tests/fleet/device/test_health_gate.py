"""The health gate: the spec and its pure checks (schema, contains, exact, floors, TTFT,
memory, served digest, soak), then on the real engine — the default model on a live
server, a "new release" that is its own GGUF with one metadata byte changed: a passing
gate ends ACTIVE with its evidence row while clients stream across the switch with zero
failed requests; a golden prompt that fails rolls back at once, naming the check, and the
previous digest serves again; the registry's holds, drain and by-digest loads."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from edge_agent.app import create_app
from edge_agent.bench.fleet.rollout import variant
from edge_agent.config import Settings, load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.request import GenerationRequest
from edge_agent.fleet.device.rollout import health_gate
from edge_agent.fleet.device.rollout.health_gate import (
    GATE_DIALECT,
    Check,
    GateReport,
    parse_spec,
)
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.device.rollout.store import Rollout
from edge_agent.fleet.protocol.rollout_states import ACTIVE, ROLLED_BACK
from edge_agent.gateway.probe import ServiceProbe
from edge_agent.ledger.evidence import evidence_for
from edge_agent.server import uvicorn_config
from tests.conftest import DEFAULT_MODEL, NO_EOS, clone_state, free_port
from tests.support.pace import SETTLE_S, measure
from tests.support.rollout_support import DirReleases

SPEC = {"prompts": [
    {"id": "capital", "messages": [{"role": "user",
                                    "content": "What is the capital of France?"}],
     "max_tokens": 24, "expect": {"contains": ["Paris"], "not_contains": ["Berlin"],
                                  "max_output_tokens": 24}},
    {"id": "json", "prompt": "A user record:", "max_tokens": 64,
     "expect": {"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                "required": ["ok"]}}},
    {"id": "greedy", "prompt": "1, 2, 3,", "max_tokens": 8, "expect": {"exact": " 4, 5,"}}],
    "tokens_per_s_floor": 0.8, "ttft_ms_max": 1500, "memory_headroom_bytes": 1 << 28,
    "soak": {"requests": 20, "within_s": 600}}


@dataclass(frozen=True)
class Said:
    text: str
    completion_tokens: int = 5
    ttft_ms: float = 10.0
    eval_ms: float = 100.0
    digest: str = "a" * 64


# -- the spec ------------------------------------------------------------------------------

def test_the_documented_spec_parses() -> None:
    spec = parse_spec(SPEC)
    assert [p.id for p in spec.prompts] == ["capital", "json", "greedy"]
    assert (spec.tokens_per_s_floor, spec.ttft_ms_max, spec.memory_headroom_bytes,
            spec.soak_requests, spec.soak_within_s) == (0.8, 1500.0, 1 << 28, 20, 600.0)
    req = spec.prompts[1].request(DEFAULT_MODEL)
    assert (req.prompt, req.messages, req.max_tokens) == ("A user record:", None, 64)
    assert req.sampling == {"temperature": 0.0, "seed": 0}  # greedy, always
    assert req.json_schema == SPEC["prompts"][1]["expect"]["json_schema"]  # type: ignore[index]
    assert spec.needs_baseline


def test_the_manuals_gate_parses() -> None:
    """The gate the manual shows (docs/fleet/box-rollouts.md) is one the boxes take."""
    import json
    import re

    page = (Path(__file__).resolve().parents[3] / "docs" / "fleet" / "box-rollouts.md")
    section = page.read_text().split("## The health gate", 1)[1]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None
    spec = parse_spec(json.loads(block.group(1)))
    assert [p.raw for p in spec.prompts] == [False, False, True]


def test_a_raw_prompt_is_sent_as_it_is() -> None:
    """`raw`: no chat template (Ollama's raw generate), for a base model's continuation;
    only with a prompt."""
    spec = parse_spec({"prompts": [{"id": "count", "prompt": "1, 2, 3,", "raw": True},
                                   {"id": "chat", "prompt": "Hi"}]})
    raw, templated = (p.request(DEFAULT_MODEL) for p in spec.prompts)
    assert (raw.prompt, raw.raw, templated.raw) == ("1, 2, 3,", True, False)
    for bad in ({"prompt": "x", "raw": "yes"},
                {"messages": [{"role": "user", "content": "y"}], "raw": True}):
        with pytest.raises(ValueError, match="raw: true or false, with a prompt"):
            parse_spec({"prompts": [bad]})


def test_spec_defaults() -> None:
    assert parse_spec(None) == health_gate.GateSpec() and not parse_spec({}).needs_baseline
    one = parse_spec({"prompts": [{"prompt": "x"}], "soak": {"requests": 3}})
    assert one.tokens_per_s_floor == health_gate.DEFAULT_FLOOR == 0.8  # prompts: a floor
    assert one.prompts[0].id == "p0" and one.prompts[0].max_tokens == 32
    assert (one.soak_requests, one.soak_within_s) == (3, health_gate.DEFAULT_SOAK_S)
    assert parse_spec({"prompts": [{"prompt": "x"}], "tokens_per_s_floor": None}
                      ).tokens_per_s_floor is None  # switched off explicitly


@pytest.mark.parametrize(("raw", "message"), [
    ([], "not an object"),
    ({"prompt": []}, "unknown field"),
    ({"prompts": [{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}]},
     "exactly one of messages and prompt"),
    ({"prompts": [{"max_tokens": 3}]}, "exactly one of messages and prompt"),
    ({"prompts": [{"messages": [{"role": "user"}]}]}, "messages"),
    ({"prompts": [{"prompt": "x", "max_tokens": 0}]}, "max_tokens"),
    ({"prompts": [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]}, "unique"),
    ({"prompts": [{"prompt": "x", "expect": {"json_schema": {"type": "nope"}}}]},
     "not a valid schema"),
    ({"prompts": [{"prompt": "x", "expect": {"contains": [""]}}]}, "contains"),
    ({"prompts": [{"prompt": "x", "expect": {"matches": "x"}}]}, "unknown field"),
    ({"tokens_per_s_floor": -1}, "tokens_per_s_floor"),
    ({"ttft_ms_max": True}, "ttft_ms_max"),
    ({"ttft_ms_max": 10**400}, "ttft_ms_max"),  # past any float: refused, not OverflowError
    ({"soak": {"requests": 2, "within_s": -(10**400)}}, "soak.within_s"),
    ({"memory_headroom_bytes": 1.5}, "memory_headroom_bytes"),
    ({"soak": {"requests": 2, "window": 3}}, "soak"),
    ({"prompts": [{"prompt": "x"}] * 33}, "at most 32"),
])
def test_bad_specs_are_refused_with_what_is_wrong(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(raw)


# -- the pure checks -------------------------------------------------------------------------

def _prompt(**expect: Any) -> health_gate.GoldenPrompt:
    return parse_spec({"prompts": [{"id": "p", "prompt": "x", "expect": expect}]}).prompts[0]


def test_contains_and_not_contains() -> None:
    checks = health_gate.check_answer(_prompt(contains=["Paris", "France"], not_contains="Berlin"),
                               "Paris is in France", 5)
    assert [(c.name, c.passed, c.figure) for c in checks] == [
        ("prompt:p:contains", True, "found"), ("prompt:p:contains", True, "found"),
        ("prompt:p:not_contains", True, "absent")]
    bad = health_gate.check_answer(_prompt(contains="paris", not_contains="Berlin"),
                            "Berlin, not Paris", 5)
    assert [(c.passed, c.figure, c.limit) for c in bad] == [
        (False, "missing", "paris"), (False, "found", "Berlin")]
    assert '"Berlin, not Paris"' in bad[0].detail
    assert health_gate.check_answer(_prompt(contains="paris", ignore_case=True), "PARIS", 1
                             )[0].passed


def test_exact_and_max_output_tokens() -> None:
    ok, long = health_gate.check_answer(_prompt(exact=" 4, 5,", max_output_tokens=4), " 4, 5,", 5)
    assert ok.passed and (long.passed, long.figure, long.limit) == (False, 5, 4)
    (diff,) = health_gate.check_answer(_prompt(exact=" 4, 5,"), " 4, 5, 6", 3)
    assert not diff.passed and diff.detail == 'expected " 4, 5,", got " 4, 5, 6"'


def test_json_schema() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert health_gate.check_schema("p", schema, '{"n": 3}').passed
    wrong = health_gate.check_schema("p", schema, '{"n": "three"}')
    assert (wrong.passed, wrong.figure) == (False, "1 error(s)") and wrong.detail.startswith(
        "n: 'three' is not of type 'integer'")
    cut = health_gate.check_schema("p", schema, '{"n": 3')
    assert (cut.passed, cut.figure) == (False, "not JSON")
    assert health_gate.check_schema("p", schema, "{}").detail.startswith(
        "(root): 'n' is a required")


def test_speed_floor_relative_to_the_previous_version() -> None:
    fast = [Said("a", completion_tokens=11, eval_ms=1000)]  # 10 tokens/s
    slow = [Said("a", completion_tokens=8, eval_ms=1000)]  # 7 tokens/s
    assert health_gate.tokens_per_s(fast) == 10.0 \
        and health_gate.tokens_per_s([Said("a", 1)]) is None
    assert health_gate.check_speed(8.0, 10.0, 0.8).passed  # exactly the floor passes
    low = health_gate.check_speed(health_gate.tokens_per_s(slow),
                                  health_gate.tokens_per_s(fast), 0.8)
    assert (low.passed, low.figure, low.limit) == (False, 0.7, 0.8)
    assert "7.0 tokens/s vs 10.0 before" in low.detail
    unknown = health_gate.check_speed(None, 10.0, 0.8)
    assert unknown.passed and "not measured" in unknown.detail


def test_ttft_memory_served_and_soak() -> None:
    answers = [Said("a", ttft_ms=120.0), Said("b", ttft_ms=480.4)]
    assert health_gate.check_ttft(answers, 500).passed
    over = health_gate.check_ttft(answers, 400)
    assert (over.passed, over.figure, over.limit) == (False, 480.4, 400)
    assert health_gate.check_memory(2 << 30, 1 << 30).passed
    assert not health_gate.check_memory(1 << 20, 1 << 30).passed
    served = health_gate.check_served([Said("a", digest="b" * 64)], "a" * 64)
    assert (served.passed, served.figure) == (False, "bbbbbbbbbbbb")
    assert health_gate.check_soak(0, 3, 20, 600).passed
    soak = health_gate.check_soak(1, 20, 20, 600)
    assert not soak.passed and "had 1 server error" in soak.detail


def test_the_report_names_the_first_failed_check_with_its_figures() -> None:
    report = GateReport([Check("ttft_ms", True, 10, 100),
                         Check("tokens_per_s", False, 0.61, 0.8), Check("soak", False, 2, 0)])
    assert not report.passed and [c.name for c in report.failed] == ["tokens_per_s", "soak"]
    assert report.reason() == "gate check tokens_per_s failed: 0.61 (limit 0.8)"
    assert GateReport().passed and GateReport().reason() is None


def test_a_prompt_the_engine_refuses_is_a_failed_check() -> None:
    from edge_agent.errors import ServiceUnavailable

    async def probe(req: GenerationRequest) -> Said:
        if req.prompt == "boom":
            raise ServiceUnavailable("queue full")
        return Said("fine")

    spec = parse_spec({"prompts": [{"id": "a", "prompt": "boom"},
                                   {"id": "b", "prompt": "x", "expect": {"contains": "fine"}}]})
    answers, checks = asyncio.run(health_gate.run_prompts(spec, "m:1", probe))
    assert [a.text for a in answers] == ["fine"]
    assert [(c.name, c.passed, c.detail) for c in checks] == [
        ("prompt:a:answered", False, "queue full"), ("prompt:b:contains", True, "")]


# -- on the real engine ----------------------------------------------------------------------

@dataclass
class Box:
    settings: Settings
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread
    manager: RolloutManager
    loop: asyncio.AbstractEventLoop
    probe: ServiceProbe
    releases: DirReleases
    old: str
    emitted: list[dict[str, Any]]

    def wait(self, rollout_id: str, timeout: float = SETTLE_S) -> Rollout:
        future = asyncio.run_coroutine_threadsafe(self.manager.settled(rollout_id, timeout),
                                                  self.loop)
        r = future.result(timeout + 5)
        assert not r.live, f"{rollout_id} still {r.state}"
        return r

    def ask(self, req: GenerationRequest) -> Any:
        return asyncio.run_coroutine_threadsafe(self.probe(req), self.loop).result(60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def fingerprint(self) -> str:
        r = httpx.post(f"{self.base_url}/v1/chat/completions", timeout=60, json={
            "model": DEFAULT_MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}]})
        return str(r.json()["system_fingerprint"]).removeprefix("fp_")


@pytest.fixture(scope="module")
def box(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    live = start_box(model_cache, tmp_path_factory.mktemp("gate"))
    yield live
    live.stop()


def start_box(model_cache: Path, root: Path, **overrides: Any) -> Box:
    """A live server whose lifespan runs a RolloutManager over its own ModelOps and
    request path, as the app wires it, with releases from files on disk."""
    state = clone_state(model_cache, root / "state")
    store = ModelStore(state)
    installed = store.get(DEFAULT_MODEL)
    blob, old = installed.blob_path(state), installed.digest
    # What a release of this model carries besides its file (the catalog's own facts):
    # its default parameters change greedy answers (repeat_penalty), so they travel too.
    manifest = {"quantization": installed.quantization, "license": installed.license,
                "tier": installed.tier, "parameters": dict(installed.parameters)}
    store.close()
    releases = DirReleases()
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512, "runtime.threads": 1,
        "runtime.parallel": 4, "telemetry.hardware": False,
        # Greedy answers the same batched with the clients' streams or alone: what makes
        # an `exact` golden answer hold on a busy box.
        "runtime.deterministic": True, **overrides})
    app = create_app(settings)
    parts = app.state.parts
    emitted: list[dict[str, Any]] = []
    probe = ServiceProbe(parts.service, dialect=GATE_DIALECT)
    manager = RolloutManager(settings, parts.ops, releases, probe, poll_s=0.1,
                             emit=lambda kind, cls, body: emitted.append(dict(body)))
    loops: list[asyncio.AbstractEventLoop] = []
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with inner(a):
            loops.append(asyncio.get_running_loop())
            await manager.start()
            yield
            await manager.stop()

    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://{settings.server.host}:{settings.server.port}"
    deadline = time.monotonic() + 120
    while not server.started or httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.1)
    for version, letter in (("2", b"T"), ("3", b"U")):
        releases.add(DEFAULT_MODEL, version, variant(blob, root / f"v{version}.gguf", letter),
                     manifest)
    return Box(settings, url, server, thread, manager, loops[0], probe, releases, old, emitted)


@pytest.mark.integration
def test_a_failing_golden_prompt_rolls_back_naming_the_check(box: Box) -> None:
    release = box.releases.releases[(DEFAULT_MODEL, "2")]
    release.manifest["gate"] = {"prompts": [
        {"id": "capital", "messages": [{"role": "user", "content": "Capital of France?"}],
         "max_tokens": 12, "expect": {"contains": "Berlin"}}], "tokens_per_s_floor": None}
    box.manager.begin("fail-1", DEFAULT_MODEL, "2")
    r = box.wait("fail-1")
    assert r.state == ROLLED_BACK and r.restored
    assert r.reason == "gate check prompt:capital:contains failed: missing (limit Berlin)"
    assert box.fingerprint() == box.old[:12]  # the previous digest serves again
    ops = ModelStore(box.settings.state_dir)
    assert {v.digest for v in ops.versions(DEFAULT_MODEL)} == {box.old, release.sha256}
    assert [(h.digest, h.by) for h in ops.history(DEFAULT_MODEL)[:2]] == [
        (box.old, "rollout:fail-1"), (release.sha256, "rollout:fail-1")]
    ops.close()
    ev = evidence_for(box.settings.state_dir / "ledger.db", DEFAULT_MODEL)[0]
    assert (ev["rollout_id"], ev["outcome"], ev["digest"]) == (
        "fail-1", ROLLED_BACK, release.sha256)
    (check,) = [c for c in ev["checks"] if not c["passed"]]
    assert check["name"] == "prompt:capital:contains"
    assert check["detail"].startswith('answer "La France')  # what the model said instead
    served = next(c for c in ev["checks"] if c["name"] == "served_digest")
    assert served["passed"]  # the golden prompt really ran on the new version
    deadline = time.monotonic() + 30  # the new version is unloaded, kept installed
    while {m["digest"] for m in httpx.get(f"{box.base_url}/api/ps").json()["models"]} \
            != {box.old}:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _stream(base_url: str, out: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=160, stream=True, logit_bias=NO_EOS,
            messages=[{"role": "user", "content": "Count to one hundred."}])
        for chunk in stream:
            out.setdefault("times", []).append(time.time())
            out.setdefault("fingerprints", set()).add(chunk.system_fingerprint)
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish"] = chunk.choices[0].finish_reason
    except Exception as exc:  # reported by the asserts
        out["error"] = exc


def _shoppers(base_url: str, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """A store's short requests, one after another, through the whole rollout."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    while not stop.is_set():
        started = time.time()
        try:
            stream = client.chat.completions.create(
                model=DEFAULT_MODEL, max_tokens=4, stream=True,
                messages=[{"role": "user", "content": "Hello"}])
            first = None
            fingerprint = None
            for chunk in stream:
                first = first or time.time()
                fingerprint = chunk.system_fingerprint
            out.append({"at": started, "ttft": (first or time.time()) - started,
                        "fp": fingerprint})
        except Exception as exc:
            out.append({"at": started, "error": repr(exc)})


@pytest.mark.integration
def test_a_passing_gate_activates_with_zero_failed_requests_and_evidence(box: Box) -> None:
    release = box.releases.releases[(DEFAULT_MODEL, "3")]
    pace = measure(box.base_url)  # the waits and the TTFT limit below, at the present speed
    spec: dict[str, Any] = {key: value for key, value in SPEC.items()}
    greedy = spec["prompts"][2]
    said = box.ask(parse_spec({"prompts": [greedy]}).prompts[0].request(DEFAULT_MODEL))
    assert said.digest == box.old
    spec["prompts"] = [*spec["prompts"][:2], {**greedy, "expect": {"exact": said.text}}]
    # The same weights: the ratio is 1 but for noise, which on a shared 2-core test box
    # (other processes, the store's traffic) reaches 2x; the floor is unit-tested.
    spec["tokens_per_s_floor"] = 0.25
    # The limit is unit-tested too; here a golden prompt's first token waits beside three
    # streams and the store's traffic, tens of times longer on a loaded box.
    spec["ttft_ms_max"] = round(pace.bound(5, requests=4) * 1000)
    spec["soak"] = {"requests": 3, "within_s": 60}
    release.manifest["gate"] = spec
    new = release.sha256
    streams: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(box.base_url, s)) for s in streams]
    stop, short = threading.Event(), []
    shopper = threading.Thread(target=_shoppers, args=(box.base_url, stop, short))
    shopper.start()
    time.sleep(1.0)
    for t in threads:
        t.start()
    while not all(s.get("times") for s in streams):
        time.sleep(0.05)
    started = time.time()
    box.manager.begin("pass-1", DEFAULT_MODEL, "3")
    # The golden prompts, the soak's requests and the streams beside them share the steps.
    beside = pace.bound(120, tokens=3 * 160, requests=3)
    r = box.wait("pass-1", pace.bound(180, tokens=3 * 160 + 96, requests=9))
    stop.set()
    for t in [*threads, shopper]:
        t.join(beside)
    assert r.state == ACTIVE, [c for c in r.gate["checks"] if not c["passed"]]
    assert box.fingerprint() == new[:12]
    # Zero failed requests: every stream ran to its length on the version it started on.
    for s in streams:
        assert "error" not in s, s.get("error")
        assert s["finish"] == "length" and s["fingerprints"] == {f"fp_{box.old[:12]}"}
    assert short and not [x for x in short if "error" in x], short[:3]
    assert {x["fp"] for x in short} == {f"fp_{box.old[:12]}", f"fp_{new[:12]}"}
    _figures(r, streams, short, started, [(e["to"], e["ts"]) for e in box.emitted
                                          if e.get("rollout_id") == "pass-1" and "to" in e])
    checks = {c["name"]: c for c in r.gate["checks"]}
    assert all(c["passed"] for c in checks.values()), checks
    assert {"prompt:capital:contains", "prompt:json:json_schema", "prompt:greedy:exact",
            "served_digest", "tokens_per_s", "ttft_ms", "memory_headroom", "soak"} <= set(checks)
    ev = evidence_for(box.settings.state_dir / "ledger.db", DEFAULT_MODEL)[0]
    assert (ev["rollout_id"], ev["outcome"], ev["digest"], ev["previous_digest"]) == (
        "pass-1", ACTIVE, new, box.old)
    assert ev["llama_cpp_version"] == "0.3.36" and ev["parameters"]["threads"] == 1
    assert set(ev["timings"]) >= {"DOWNLOADING", "VERIFYING", "ACTIVATING", "GATING"}
    assert [b["id"] for b in box.emitted if b.get("event") == "rollout.evidence"][-1] == \
        "pass-1/1"


def _figures(r: Rollout, streams: list[dict[str, Any]], short: list[dict[str, Any]],
             started: float, states: list[tuple[str, float]]) -> None:
    """The note's figures: seconds per state, the longest wait between two tokens of a
    stream running across the switch (and the state it fell in), and short requests'
    TTFT before vs during the rollout."""

    def state_at(t: float) -> str:
        return next((s for s, at in reversed(states) if at <= t), "before")

    gaps, during_gaps = [], []
    for s in streams:
        times = s["times"]
        steps = [(times[k] - times[k - 1], times[k - 1]) for k in range(2, len(times))]
        gap, at = max(steps)  # from the first token on (the first chunk is the role)
        gaps.append((round(gap * 1000), state_at(at)))
        inside = [(g, t) for g, t in steps if t >= started]
        if inside:
            gap, at = max(inside)
            during_gaps.append((round(gap * 1000), state_at(at)))
    before = [x["ttft"] for x in short if x["at"] < started]
    during = [x["ttft"] for x in short if x["at"] >= started]
    p = {k: round(v, 2) for k, v in r.timings.items()}
    print(f"\nrollout states (s): {p}; total {sum(r.timings.values()):.2f}")
    print(f"longest token gap per stream (ms, state): {gaps}; after the rollout "
          f"started: {during_gaps}")
    if before and during:
        print(f"short-request TTFT ms: before p50 {statistics.median(before) * 1000:.0f} "
              f"max {max(before) * 1000:.0f} ({len(before)}); during p50 "
              f"{statistics.median(during) * 1000:.0f} max {max(during) * 1000:.0f} "
              f"({len(during)})")


@pytest.mark.integration
def test_with_memory_for_one_version_the_switch_drains_and_requests_wait_not_fail(
        model_cache: Path, tmp_path: Path) -> None:
    """A memory budget with room for one version only: the new version cannot load beside
    the old one, so the name is drained — running requests end on the old weights, new
    ones wait in the queue for the swap — swapped, and let go; no request is refused
    (every answer 200), and those that waited got the new version."""
    live = start_box(model_cache, tmp_path)
    try:
        pace = measure(live.base_url)  # the waits below, at this box's present speed
        # The swap waits for the stream's 160 tokens, then loads and gates the new version.
        swap_s = pace.bound(120, tokens=160 + 4, requests=3)
        # A waiting request's bound (`fleet.switch_wait_s`, 60 s) at this box's speed too:
        # on a loaded machine the swap itself takes longer than an idle box's minute.
        live.settings.fleet.switch_wait_s = min(600.0, max(60.0, swap_s))
        registry = live.probe.service.registry
        assert registry.settings is live.settings
        serving = registry.loaded()[0]
        registry.memory_budget = int(serving.memory * 1.5)  # one version, not two
        release = live.releases.releases[(DEFAULT_MODEL, "2")]
        release.manifest["gate"] = {"prompts": [{"id": "hi", "prompt": "Hello", "max_tokens": 4}],
                                    "tokens_per_s_floor": None}
        stream: dict[str, Any] = {}
        streamer = threading.Thread(target=_stream, args=(live.base_url, stream))
        streamer.start()
        while not stream.get("times"):
            time.sleep(0.05)
        stop, answers = threading.Event(), []

        def knock() -> None:  # a client that would see a refusal
            while not stop.is_set():
                began = time.monotonic()
                r = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=swap_s, json={
                    "model": DEFAULT_MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "Hi"}]})
                answers.append((r.status_code, time.monotonic() - began,
                                r.json().get("system_fingerprint")))
                time.sleep(0.05)

        knocker = threading.Thread(target=knock)
        knocker.start()
        live.manager.begin("drain-1", DEFAULT_MODEL, "2")
        r = live.wait("drain-1", max(180, swap_s))
        stop.set()
        knocker.join(swap_s)
        streamer.join(swap_s)
        assert r.state == ACTIVE, r.reason
        assert "error" not in stream and stream["finish"] == "length"
        assert stream["fingerprints"] == {f"fp_{live.old[:12]}"}  # ended on the old weights
        assert {code for code, _, _ in answers} == {200}, answers
        assert answers[-1][2] == f"fp_{release.sha256[:12]}" == f"fp_{live.fingerprint()}"
        longest = max(waited for _, waited, _ in answers)
        print(f"\ndrained: {len(answers)} requests, none refused; the longest took "
              f"{longest:.2f} s; states (s): { {k: round(v, 2) for k, v in r.timings.items()} }")
    finally:
        live.stop()


@pytest.mark.integration
def test_the_registry_loads_a_digest_holds_it_and_drains_a_name(
        model_cache: Path, tmp_path: Path) -> None:
    from edge_agent.engine.modelops import ModelOps
    from edge_agent.engine.registry import ModelRegistry
    from edge_agent.errors import ServiceUnavailable

    state = clone_state(model_cache, tmp_path / "state")
    store = ModelStore(state)
    old = store.get(DEFAULT_MODEL)
    new = store.import_file(variant(old.blob_path(state), tmp_path / "v.gguf", b"T"),
                            DEFAULT_MODEL, by="test", activate=False)
    settings = load_settings(None, state_dir=state, **{
        "runtime.context_length": 256, "runtime.threads": 1, "fleet.switch_wait_s": 1.0})
    registry = ModelRegistry(settings, store)
    ops = ModelOps(store, registry)

    async def scenario() -> None:
        assert await ops.fits(DEFAULT_MODEL, new.digest)  # nothing loaded: room
        await ops.load(DEFAULT_MODEL, digest=new.digest[:12])  # not held: gone again
        assert new.digest not in {m.info.digest for m in registry.loaded()}
        ops.hold(DEFAULT_MODEL, new.digest)
        await ops.load(DEFAULT_MODEL, digest=new.digest)
        await ops.load(DEFAULT_MODEL)  # the active version beside it
        await registry.reap_expired()  # inactive but held: kept
        assert {m.info.digest for m in registry.loaded()} == {old.digest, new.digest}
        assert ops.busy(DEFAULT_MODEL) == 0
        serving, _ = await registry.acquire(DEFAULT_MODEL)
        assert ops.busy(DEFAULT_MODEL) == 1
        ops.drain(DEFAULT_MODEL)
        waiting = asyncio.create_task(registry.acquire(DEFAULT_MODEL))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held back for the swap, not refused
        by_digest, _ = await registry.acquire(DEFAULT_MODEL, digest=new.digest)
        await registry.release(by_digest)  # a rollout's own load passes the drain
        ops.drain(DEFAULT_MODEL, False)
        waited, waited_ns = await waiting
        assert waited_ns >= 0.3e9  # its wait counts as its wait for the model
        await registry.release(waited)
        ops.drain(DEFAULT_MODEL)  # a swap that takes longer than fleet.switch_wait_s
        with pytest.raises(ServiceUnavailable) as refused:
            await registry.acquire(DEFAULT_MODEL)
        assert refused.value.retry_after == 2.0 and "after 1 s" in refused.value.message
        ops.drain(DEFAULT_MODEL, False)
        await registry.release(serving)
        ops.hold(DEFAULT_MODEL, new.digest, False)
        await registry.reap_expired()  # let go: the inactive version is unloaded
        assert {m.info.digest for m in registry.loaded()} == {old.digest}
        await registry.close()

    asyncio.run(scenario())
    store.close()
