"""The structured-coverage section: its sample as shipped, the verdict on each kind of
answer, and a short run of the section against a real edge-agent server."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.bench.serving.peers import HttpPeer
from edge_agent.bench.serving.schema_coverage import (
    INSTRUCTION,
    MAX_TOKENS,
    OUTCOMES,
    PROMPT_SCHEMA_CHARS,
    Case,
    Verdict,
    ask,
    bench_schema_coverage,
    classify,
    load_sample,
    messages,
    mismatch,
    reasons,
    request_body,
    summarise,
)
from tests.conftest import DEFAULT_MODEL, NO_EOS, LiveServer, clone_state
from tests.support.pace import Pace

CATEGORIES = ["Github_easy", "Github_hard", "Github_medium", "Github_trivial", "Github_ultra",
              "Glaiveai2K", "JsonSchemaStore", "Kubernetes", "Snowplow", "WashingtonPost"]
ORDER = {"type": "object", "properties": {"id": {"type": "string"},
                                          "n": {"type": "integer", "minimum": 1}},
         "required": ["id", "n"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


# -- the sample as shipped ------------------------------------------------------------------

def test_the_sample_holds_25_schemas_of_each_category_with_its_source_and_licence() -> None:
    sample = load_sample()
    assert sample.categories == CATEGORIES
    assert len(sample.cases) == 250
    assert all(sum(c.category == k for c in sample.cases) == 25 for k in CATEGORIES)
    assert len({c.file for c in sample.cases}) == 250
    assert all(c.file.startswith(f"data/{c.category}/") and isinstance(c.schema, dict)
               for c in sample.cases)
    assert sample.source == "https://github.com/guidance-ai/jsonschemabench"
    assert re.fullmatch(r"[0-9a-f]{40}", sample.commit)
    folder = resources.files("edge_agent.bench.serving").joinpath("jsonschemabench")
    assert "MIT License" in folder.joinpath("LICENSE").read_text(encoding="utf-8")
    # The note beside it names the same commit.
    assert sample.commit in folder.joinpath("README.md").read_text(encoding="utf-8")


def test_a_smaller_run_takes_the_first_of_each_category() -> None:
    sample = load_sample()
    two = sample.pick(2)
    assert len(two.cases) == 20 and two.categories == CATEGORIES
    firsts = [c for c in sample.cases if c.category == "Snowplow"][:2]
    assert [c for c in two.cases if c.category == "Snowplow"] == firsts
    only = sample.pick(3, ["Kubernetes", "Glaiveai2K"])
    assert only.categories == ["Glaiveai2K", "Kubernetes"] and len(only.cases) == 6


def test_the_request_carries_the_whole_schema_and_a_prompt_of_bounded_length() -> None:
    big = {"type": "object", "description": "x" * 10_000}
    body = request_body("m", big)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": big}}
    assert body["max_tokens"] == MAX_TOKENS == 384 and body["temperature"] == 0
    assert body["stream"] is True
    system, user = body["messages"]
    assert system == {"role": "system", "content": INSTRUCTION}
    assert len(user["content"]) < PROMPT_SCHEMA_CHARS + 100
    assert user["content"].endswith("(schema shortened: 10,037 characters)")
    assert messages(ORDER)[1]["content"] == json.dumps(ORDER)


# -- the verdict on one answer --------------------------------------------------------------

def _answer(content: str, finish: str = "stop") -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content}}]}


def test_each_kind_of_answer_gets_its_outcome() -> None:
    refused = classify(400, {"error": {"message": "schema keyword 'not' is not supported",
                                       "type": "invalid_request_error"}}, ORDER)
    assert refused == Verdict("refused", "schema keyword 'not' is not supported")
    assert not refused.accepted
    assert classify(400, {"error": "unsupported"}, ORDER).outcome == "refused"  # Ollama's
    valid = classify(200, _answer('{"id": "a1", "n": 3}'), ORDER)
    assert valid == Verdict("valid") and valid.accepted
    # Finished, and not held to the schema: the serious case.
    wrong = classify(200, _answer('{"id": "a1", "n": 0}'), ORDER)
    assert wrong.outcome == "invalid" and "$.n" in wrong.detail and wrong.accepted
    extra = classify(200, _answer('{"id": "a1", "n": 2, "x": 1}'), ORDER)
    assert extra.outcome == "invalid"
    not_json = classify(200, _answer('{"id": "a1", "n": '), ORDER)
    assert not_json.outcome == "invalid" and not_json.detail.startswith("not JSON")
    cut = classify(200, _answer('{"id": "a1", "n": ', finish="length"), ORDER)
    assert cut == Verdict("cut") and cut.accepted
    for status, body in ((500, {"error": {"message": "boom"}}), (503, "busy"),
                         (None, "ReadTimeout: timed out"), (200, _answer("{}", "tool_calls")),
                         (200, {"object": "list"})):
        verdict = classify(status, body, ORDER)
        assert verdict.outcome == "error" and not verdict.accepted, (status, body)


def test_validation_follows_the_schemas_draft_and_formats_and_fetches_nothing() -> None:
    # Draft 4's boolean exclusiveMinimum (not a schema at all under 2020-12).
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
              "minimum": 1, "exclusiveMinimum": True}
    assert mismatch(2, draft4) is None and mismatch(1, draft4) is not None
    assert mismatch("2026-12-03T07:00:00Z", {"type": "string", "format": "date-time"}) is None
    assert mismatch("yesterday", {"type": "string", "format": "date-time"}) is not None
    assert mismatch("2026-12-03 25:00:00+01:00", {"format": "date-time"}) is not None
    assert mismatch("07:00:00.5+01:00", {"type": "string", "format": "time"}) is None
    assert mismatch("7 am", {"type": "string", "format": "time"}) is not None
    assert mismatch("2026-02-30", {"type": "string", "format": "date"}) is not None
    assert mismatch("not-a-uuid", {"type": "string", "format": "uuid"}) is not None
    remote = {"$ref": "https://json.schemastore.org/never-fetched.json"}
    assert (mismatch({}, remote) or "").startswith("unresolvable $ref")


def test_the_figures_per_category_and_overall() -> None:
    sample = load_sample().pick(2, ["Glaiveai2K", "Snowplow"])
    verdicts = {"edge-agent": [Verdict("valid"), Verdict("cut"), Verdict("refused"),
                               Verdict("valid")]}
    summary = summarise(sample, verdicts)["edge-agent"]
    assert summary["categories"]["Glaiveai2K"] == {
        "n": 2, "refused": 0, "valid": 1, "invalid": 0, "cut": 1, "error": 0,
        "declared_coverage": 1.0, "empirical_coverage": 0.5}
    assert summary["overall"]["declared_coverage"] == 0.75
    assert summary["overall"]["empirical_coverage"] == 0.5


def test_refusals_are_grouped_by_reason_whatever_the_numbers() -> None:
    got = [Verdict("refused", "'maxLength' 4096 exceeds the limit of 1000"),
           Verdict("refused", "'maxLength' 1024 exceeds the limit of 1000"),
           Verdict("refused", "unsupported JSON schema: Unrecognized schema: {'a': 1}"),
           Verdict("valid"), Verdict("invalid", "$.n: 0 is less than the minimum of 1")]
    assert reasons(got) == [("'maxLength' N exceeds the limit of N", 2),
                            ("unsupported JSON schema: Unrecognized schema: {…}", 1)]
    assert reasons(got, "invalid") == [("$.n: N is less than the minimum of N", 1)]


# -- against a real server ------------------------------------------------------------------

@pytest.mark.integration
def test_a_schema_the_server_cannot_read_is_refused_and_a_plain_one_answered(
        live_server: LiveServer) -> None:
    """`ask` as the section sends it, on the session's server: the refusal as the server
    words it, and a small record answered, streamed, with a document that fits it."""
    peer = HttpPeer.__new__(HttpPeer)  # the server is already running: no process
    peer.model = DEFAULT_MODEL
    with httpx.Client(base_url=live_server.base_url, timeout=120) as peer.client:
        refused = ask(peer, Case("crafted", "-", {"type": "no-such-type"}))
        # A record with one short answer, {"ok": true} or false: done within a few tokens.
        answered = ask(peer, Case("crafted", "-", FLAG), timeout=600)
    assert refused.outcome == "refused" and refused.detail
    assert answered == Verdict("valid"), answered


@pytest.mark.integration
def test_the_section_runs_on_a_few_schemas_and_reports_its_figures(
        model_cache: Path, tmp_path: Path) -> None:
    """The section as `edge-agent bench structured-coverage --per-category 1 --category …`
    runs it, on its own edge-agent server: the table, the verdicts and the figures' shape."""
    state = clone_state(model_cache, tmp_path / "state")
    lines: list[str] = []
    parallel = 2

    def per_answer(peer: HttpPeer) -> float:
        """Each answer's bound, from the pace of the section's own server: a warm-up with
        the longest prompt the section sends (the schema cut at PROMPT_SCHEMA_CHARS), then
        an answer waits for its own and its neighbour's prompt and MAX_TOKENS tokens each;
        600 s at least. A loaded box generates tens of times slower than an idle one."""
        longest = max(load_sample().cases, key=lambda c: len(json.dumps(c.schema)))
        warm = peer.chat(messages(longest.schema), 16, extra={"logit_bias": NO_EOS})
        pace = Pace.of(warm.start, warm.arrivals)
        return pace.bound(600, tokens=parallel * MAX_TOKENS, requests=parallel)

    out = bench_schema_coverage(state, DEFAULT_MODEL, threads=2, context=2048,
                                echo=lines.append, per_category=1,
                                categories=("Glaiveai2K", "Snowplow", "Github_easy"),
                                parallel=parallel, timeout=per_answer)
    assert out["schemas"] == 3 and set(out["wall_s"]) == {"edge-agent"}
    assert "llama-server" not in out  # no binary: edge-agent's columns alone
    overall = out["edge-agent"]["overall"]
    assert overall["n"] == 3 and sum(overall[o] for o in OUTCOMES) == 3
    assert set(out["edge-agent"]["categories"]) == {"Glaiveai2K", "Snowplow", "Github_easy"}
    assert out["declared_coverage"] == overall["declared_coverage"]
    assert out["edge_invalid"] == overall["invalid"] == 0
    assert overall["error"] == 0, [c for c in out["cases"]
                                   if c["edge-agent"]["outcome"] == "error"]
    assert [c["file"].split("/")[1] for c in out["cases"]] == ["Github_easy", "Glaiveai2K",
                                                               "Snowplow"]
    assert all(c["edge-agent"]["outcome"] in OUTCOMES for c in out["cases"])
    table = "\n".join(lines)
    assert "structured coverage: 3 JSONSchemaBench schemas" in table
    for row in ("Glaiveai2K", "Snowplow", "Github_easy", "overall"):
        assert re.search(rf"^  {row} +1?\d ", table, re.M), row
    assert "edge-agent answers that finished and do not fit their schema, of 3" in table
    assert "categories of" not in table  # that target needs llama-server
