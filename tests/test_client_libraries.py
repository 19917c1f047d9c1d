"""Client libraries as a store's developers use them, against the live box.

- Nested pydantic models as tool schemas (`$defs` / `$ref`): instructor (TOOLS mode,
  `create_iterable`) and pydantic-ai (`output_type=` a nested model) in the OpenAI dialect,
  which is the only one they speak; what each sent is recorded and replayed to the Ollama
  dialect, so both dialects get exactly those schemas. Answers are validated against the
  schema sent (jsonschema), which the grammar guarantees.
- The Ollama dialect reads a body as Ollama does: top-level settings other APIs name
  (`temperature`, `max_tokens`, `max_output_tokens` …) apply as the options they mean,
  `tool_choice` is honoured, any other unknown top-level field is ignored and named
  (`X-Edge-Ignored`, the ledger's `ignored_fields`). The OpenAI dialect still refuses.
- Tool-mode answers never repeat the box's own instructions (a placeholder copied into the
  answer slot came back as the answer), over many seeds.
- The npm clients (ollama-js, the AI SDK's Ollama provider) from tests/js: its lockfile is
  installed with `npm ci` into a cache outside the checkout; skipped only without node/npm.
  instructor and pydantic-ai likewise run in an environment of their own
  (tests/pyclients), so their pins never hold back the project's own openai client.

The model is SmolLM2-135M: what is asserted is what the box guarantees (schema-valid output,
the call's shape, settings applied, no copied instructions), never the answer's quality.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from edge_agent.api.ollama import IGNORED_HEADER, TOP_LEVEL_OPTIONS
from edge_agent.engine.constrained.json_grammar import schema_to_grammar
from edge_agent.engine.constrained.tool_calls import tool_call_schema, tool_instructions
from edge_agent.ledger.store import open_ledger, pending_migrations
from tests.conftest import DEFAULT_MODEL, LiveServer
from tests.support import machinecache

TOOL_TOKENS = 96  # a Team call is some 60 tokens; cut calls are not what is tested here
JS_DIR = Path(__file__).parent / "js"
PY_CLIENTS = Path(__file__).parent / "pyclients"


class Person(BaseModel):
    name: str
    age: int


class Team(BaseModel):
    """A team: its lead and its members."""

    lead: Person
    members: list[Person]


TEAM_PROMPT = "Record a team led by Ann, 30, with Bob, 25."
PEOPLE_PROMPT = "Ann is 30 and Bob is 25."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "Record it",
                                             "parameters": schema}}


# -- $defs / $ref in tool parameters, converted (no server) --------------------------------

TWO_PERSONS = [  # two tools, each with a `Person` of its own: each resolves to its own
    _tool("a", {"$defs": {"Person": {"type": "object", "properties": {"x": {"type": "integer"}},
                                     "required": ["x"]}},
                "type": "object", "properties": {"p": {"$ref": "#/$defs/Person"}},
                "required": ["p"]}),
    _tool("b", {"definitions": {"Person": {"type": "object",
                                           "properties": {"y": {"type": "string"}},
                                           "required": ["y"]}},
                "type": "object", "properties": {"p": {"$ref": "#/definitions/Person"}},
                "required": ["p"]}),
]


@pytest.mark.parametrize("choice", ["auto", "required", "team"])
def test_nested_model_parameters_resolve_against_the_tools_own_schema(choice: str) -> None:
    params = Team.model_json_schema()
    assert "$defs" in params  # the shape pydantic emits for a model holding another
    before = json.dumps(params)
    schema = tool_call_schema([WEATHER, _tool("team", params)], choice)
    schema_to_grammar(schema, param="tools")  # was: 400 "Error resolving ref …"
    assert json.dumps(params) == before  # the client's schema is not rewritten
    good = {"lead": {"name": "Ann", "age": 30}, "members": [{"name": "Bob", "age": 25}]}
    jsonschema.validate({"tool_call": {"name": "team", "arguments": good}}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the reference reaches Person itself
        jsonschema.validate({"tool_call": {"name": "team", "arguments": {
            "lead": {"name": "Ann"}, "members": []}}}, schema)


def test_each_tool_resolves_its_own_definitions() -> None:
    schema = tool_call_schema(TWO_PERSONS, "auto")
    schema_to_grammar(schema, param="tools")
    jsonschema.validate({"tool_call": {"name": "a", "arguments": {"p": {"x": 1}}}}, schema)
    jsonschema.validate({"tool_call": {"name": "b", "arguments": {"p": {"y": "s"}}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_call": {"name": "b", "arguments": {"p": {"x": 1}}}}, schema)


# -- the answers must not repeat the instructions ------------------------------------------

def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def _instruction_prose(tools: list[dict[str, Any]]) -> str:
    """The box's own words in the tool-mode system prompt: the instructions less the
    tools' JSON (the client's words)."""
    text = tool_instructions(tools, "auto")
    return text[:text.index("[")] + " " + text[text.rindex("]") + 1:]


def copied_instructions(answer: str, tools: list[dict[str, Any]]) -> bool:
    """Whether an answer repeats the instructions: it is a piece of them (a placeholder such
    as `<your answer>` copied into the answer slot), or holds three of their words in a row."""
    prose = _words(_instruction_prose(tools))
    words = _words(answer)
    if not words:
        return False
    if f" {' '.join(words)} " in f" {' '.join(prose)} ":
        return True
    grams = {tuple(prose[i:i + 3]) for i in range(len(prose) - 2)}
    return any(tuple(words[i:i + 3]) in grams for i in range(len(words) - 2))


def test_the_copy_check_catches_a_copied_placeholder() -> None:
    prose = _instruction_prose([WEATHER])
    assert copied_instructions(prose, [WEATHER])
    assert not copied_instructions("Hello! I am a helpful assistant.", [WEATHER])


@pytest.mark.integration
def test_no_tool_mode_answer_repeats_the_instructions(live_server: LiveServer) -> None:
    """Many seeds, questions a small model answers in words: never the box's words back.
    (Shown `{"response": "<your answer>"}`, about one answer in words in three was
    `<your answer>`; the first 8 tokens are enough to see it.)"""
    answers = []
    for prompt in ("Who are you?", "Say hello.", "What is 2+2?"):
        for seed in range(12):
            r = _chat(live_server, {"messages": [{"role": "user", "content": prompt}],
                                    "tools": [WEATHER],
                                    "options": {"seed": seed, "num_predict": 8}})
            assert r.status_code == 200, r.text
            answers.append(r.json()["message"]["content"])
    assert any(answers), "the model answered in words at least once"
    copied = [a for a in answers if copied_instructions(a, [WEATHER])]
    assert not copied, copied


# -- instructor and pydantic-ai: the OpenAI dialect, replayed to the Ollama dialect --------

def _py_clients() -> Path:
    """The Python client libraries' own environment (tests/pyclients/requirements.txt),
    made once in a cache outside the checkout and keyed by that file: instructor caps jiter
    below what the newest openai needs, so beside the project's own test dependencies it
    would hold their openai client releases back. Its Python, ready to run."""
    requirements = PY_CLIENTS / "requirements.txt"

    def build(staging: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True, timeout=300)
        done = subprocess.run([str(staging / "bin" / "pip"), "install", "--quiet",
                               "--disable-pip-version-check", "-r", str(requirements)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"installing {requirements} failed: {done.stderr[-2000:]}")
        (staging / ".installed").touch()

    home = machinecache.built_once(
        machinecache.root()
        / f"py-clients-{hashlib.sha256(requirements.read_bytes()).hexdigest()[:16]}",
        ".installed", build)
    python = home / "bin" / "python"
    # The venv's scripts name its staging folder: run it by `python -m`.
    return python if python.exists() else home / "bin" / "python3"


@pytest.fixture(scope="module")
def library_runs(live_server: LiveServer) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each library's call, run once against the OpenAI dialect in the libraries' own
    environment: (result as the library's model returned it, the body it sent)."""
    run = subprocess.run([str(_py_clients()), str(PY_CLIENTS / "run_clients.py"),
                          live_server.openai_url, DEFAULT_MODEL, str(TOOL_TOKENS)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"client libraries: {out['versions']}")
    return {
        "instructor": (Team.model_validate(out["instructor"]["result"]),
                       out["instructor"]["sent"]),
        "instructor-iterable": ([Person.model_validate(p)
                                 for p in out["instructor-iterable"]["result"]],
                                out["instructor-iterable"]["sent"]),
        "pydantic-ai": (Team.model_validate(out["pydantic-ai"]["result"]),
                        out["pydantic-ai"]["sent"]),
    }


def _nested(body: dict[str, Any]) -> dict[str, Any]:
    """The one tool the library sent, after checking its parameters are the nested shape."""
    (tool,) = body["tools"]
    assert "$ref" in json.dumps(tool["function"]["parameters"]), "not a nested schema"
    return dict(tool)


@pytest.mark.integration
def test_instructor_tools_mode_returns_a_nested_model(
        library_runs: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    team, body = library_runs["instructor"]
    _nested(body)
    assert isinstance(team, Team)
    jsonschema.validate(team.model_dump(), Team.model_json_schema())


@pytest.mark.integration
def test_instructor_create_iterable_returns_models(
        library_runs: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    people, body = library_runs["instructor-iterable"]
    _nested(body)
    assert people and all(isinstance(p, Person) for p in people)


@pytest.mark.integration
def test_pydantic_ai_output_type_returns_a_nested_model(
        library_runs: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    team, body = library_runs["pydantic-ai"]
    _nested(body)
    assert body["tool_choice"] == "required"
    assert isinstance(team, Team)
    jsonschema.validate(team.model_dump(), Team.model_json_schema())


@pytest.mark.integration
@pytest.mark.parametrize("library", ["instructor", "instructor-iterable", "pydantic-ai"])
def test_the_libraries_tools_work_in_the_ollama_dialect(
        live_server: LiveServer, library_runs: dict[str, tuple[Any, dict[str, Any]]],
        library: str) -> None:
    """The exact tools and tool_choice the library sent, to /api/chat."""
    _, body = library_runs[library]
    tool = _nested(body)
    r = _chat(live_server, {"messages": body["messages"], "tools": [tool],
                            "tool_choice": body["tool_choice"],
                            "options": {"temperature": 0, "num_predict": TOOL_TOKENS}})
    assert r.status_code == 200, r.text
    assert "x-edge-ignored" not in r.headers  # tool_choice was understood
    (call,) = r.json()["message"]["tool_calls"]
    assert call["function"]["name"] == tool["function"]["name"]
    jsonschema.validate(call["function"]["arguments"], tool["function"]["parameters"])


# -- the Ollama dialect reads a body as Ollama does ----------------------------------------

def _chat(live: LiveServer, body: dict[str, Any], path: str = "/api/chat",
          headers: dict[str, str] | None = None) -> httpx.Response:
    """POST to the Ollama dialect; generation endpoints answer in one piece."""
    stream = {"stream": False} if path in ("/api/chat", "/api/generate") else {}
    return httpx.post(f"{live.base_url}{path}", timeout=300, headers=headers,
                      json={"model": DEFAULT_MODEL, **stream, **body})


FRUITS = [{"role": "user", "content": "List five fruits."}]


@pytest.mark.integration
def test_top_level_settings_apply_as_the_options_they_mean(live_server: LiveServer) -> None:
    def text(body: dict[str, Any]) -> tuple[str, int, httpx.Headers]:
        r = _chat(live_server, {"messages": FRUITS, **body})
        assert r.status_code == 200, r.text
        return r.json()["message"]["content"], r.json()["eval_count"], r.headers

    greedy, count, _ = text({"options": {"temperature": 0, "num_predict": 8}})
    assert count == 8 and "\n" in greedy
    content, count, headers = text({"temperature": 0, "max_output_tokens": 8})
    assert (content, count) == (greedy, 8) and "x-edge-ignored" not in headers
    assert text({"temperature": 0, "max_tokens": 8, "stop": ["\n"]})[0] == \
        greedy.split("\n")[0]
    assert text({"temperature": 1.5, "top_k": 1, "max_tokens": 8})[0] == greedy
    assert text({"temperature": 1.5, "top_p": 0, "max_tokens": 8})[0] == greedy
    hot = {"temperature": 1.5, "seed": 11, "max_tokens": 8}
    assert text(hot)[0] == text(hot)[0]
    # Both limits: the smaller. Set in options too: the options win, and the field is named.
    assert text({"temperature": 0, "max_tokens": 8, "max_output_tokens": 3})[1] == 3
    assert text({"temperature": 0, "max_tokens": -1, "max_output_tokens": 3})[1] == 3
    content, count, headers = text({"options": {"temperature": 0, "num_predict": 2},
                                    "max_tokens": 8, "temperature": 1.5})
    assert count == 2 and headers["x-edge-ignored"] == "max_tokens,temperature"
    r = _chat(live_server, {"prompt": "Count to ten:", "max_tokens": 2}, "/api/generate")
    assert r.status_code == 200 and r.json()["eval_count"] == 2
    # An error about the limit names the field the request used.
    r = _chat(live_server, {"prompt": "Hi", "max_output_tokens": 4000}, "/api/generate")
    assert r.status_code == 400 and "max_output_tokens" in r.json()["error"]


@pytest.mark.integration
def test_unknown_top_level_fields_are_ignored_and_named(live_server: LiveServer) -> None:
    r = _chat(live_server, {
        "messages": [{"role": "user", "content": "hi"}], "max_output_tokens": 1,
        "think": False, "bogus": {"a": 1}, "user": "u-1", "tool_choice": "auto",
        "not a name": 1}, headers={"X-Request-Id": "ignored-chat"})
    assert r.status_code == 200, r.text
    # tool_choice without tools has nothing to choose; a name that is no identifier is counted
    assert r.headers["x-edge-ignored"] == "bogus,user,tool_choice,+1"
    assert live_server.ledger_row("ignored-chat")["ignored_fields"] == \
        "bogus,user,tool_choice,+1"
    r = _chat(live_server, {"prompt": "hi", "max_tokens": 1, "tools": [WEATHER]},
              "/api/generate", headers={"X-Request-Id": "ignored-generate"})
    assert r.status_code == 200 and r.headers["x-edge-ignored"] == "tools"
    r = _chat(live_server, {"input": "hi", "dimensions_hint": 3}, "/api/embed")
    assert r.status_code == 200 and r.headers["x-edge-ignored"] == "dimensions_hint"
    r = _chat(live_server, {"prompt": "", "truncate": True}, "/api/embeddings")
    assert r.status_code == 200 and r.headers["x-edge-ignored"] == "truncate"
    r = _chat(live_server, {"messages": [], "format_hint": "x"})  # loading only
    assert r.json()["done_reason"] == "load" and r.headers["x-edge-ignored"] == "format_hint"
    r = _chat(live_server, {"messages": [{"role": "user", "content": "hi"}],
                            "options": {"num_predict": 1}},
              headers={"X-Request-Id": "ignored-none"})
    assert "x-edge-ignored" not in r.headers
    assert live_server.ledger_row("ignored-none")["ignored_fields"] is None


def test_the_manual_names_every_top_level_field_that_means_an_option() -> None:
    page = (Path(__file__).parents[1] / "docs" / "api" / "ollama.md").read_text()
    section = page[page.index("- Top-level fields Ollama does not define"):]
    section = section[:section.index("\n- ")]
    assert all(f"`{field}`" in section for field in TOP_LEVEL_OPTIONS)
    assert f"`{IGNORED_HEADER}: field,…`" in section


def test_a_ledger_from_before_gains_the_ignored_fields_column(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    open_ledger(path).close()
    db = sqlite3.connect(path)  # as the ledger was before the column's migration
    db.execute("ALTER TABLE requests DROP COLUMN ignored_fields")
    db.execute("DELETE FROM _sqlite_migrations WHERE name = 'm006_ignored_fields'")
    db.commit()
    db.close()
    assert pending_migrations(path) == ["m006_ignored_fields"]
    assert "ignored_fields" in open_ledger(path)["requests"].columns_dict


@pytest.mark.integration
@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"top_p": 2}, "top_p"),
    ({"options": {"bogus": 1}}, "options.bogus"),  # inside options: still refused
    ({"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, "messages.0.bogus"),
])
def test_what_the_ollama_dialect_still_refuses(live_server: LiveServer, body: dict[str, Any],
                                               param: str) -> None:
    r = _chat(live_server, {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400
    assert set(r.json()) == {"error"} and param in r.json()["error"]


@pytest.mark.integration
def test_the_openai_dialect_still_refuses_unknown_parameters(live_server: LiveServer) -> None:
    r = httpx.post(f"{live_server.openai_url}/chat/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_output_tokens": 3})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_output_tokens"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.integration
def test_tool_choice_is_honoured_in_the_ollama_dialect(live_server: LiveServer) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    def chat(choice: Any, tokens: int) -> httpx.Response:
        return _chat(live_server, {"messages": ask, "tools": [WEATHER, ADD],
                                   "tool_choice": choice,
                                   "options": {"temperature": 0, "num_predict": tokens}})

    r = chat("none", 6)
    assert r.status_code == 200 and not r.json()["message"].get("tool_calls")
    assert "tool_call" not in r.json()["message"]["content"]  # not the tool-mode JSON
    # OpenAI's {"type": "function", "function": {"name": …}}: instructor's, replayed above
    for choice, name in [("required", None), ({"type": "function", "name": "add"}, "add")]:
        r = chat(choice, 40)
        assert r.status_code == 200, r.text
        (call,) = r.json()["message"]["tool_calls"]
        assert name is None or call["function"]["name"] == name
        tool = ADD if call["function"]["name"] == "add" else WEATHER
        jsonschema.validate(call["function"]["arguments"], tool["function"]["parameters"])
    r = chat({"type": "function", "function": {"name": "nope"}}, 1)
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]
    r = chat({"type": "web_search_preview"}, 1)  # a choice with no meaning here: "auto"
    assert r.status_code == 200 and r.headers["x-edge-ignored"] == "tool_choice"


# -- the npm clients ------------------------------------------------------------------------

def _npm_clients() -> Path:
    """tests/js installed from its lockfile (`npm ci`) into a cache outside the checkout,
    keyed by the lockfile, reused while it is unchanged; with the script copied in, under
    this run's own name (another run on the machine may be reading its copy). The script's
    path, to run from its folder."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the npm client tests (tests/js)")
    lock = (JS_DIR / "package-lock.json").read_bytes()

    def build(staging: Path) -> None:
        staging.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(JS_DIR / name, staging / name)
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=staging, check=True, timeout=600, capture_output=True)

    home = machinecache.built_once(
        machinecache.root() / f"js-{hashlib.sha256(lock).hexdigest()[:16]}",
        "node_modules/.package-lock.json", build)
    script = home / f"clients-{os.getpid()}.mjs"
    shutil.copy(JS_DIR / "clients.mjs", script)
    return script


@pytest.mark.integration
def test_npm_clients_ollama_js_and_the_ai_sdk_provider(live_server: LiveServer,
                                                       tmp_path: Path) -> None:
    script = _npm_clients()
    team = Team.model_json_schema()
    spec = {"url": live_server.base_url, "model": DEFAULT_MODEL, "seeds": [0, 1, 2],
            "prompt": "Who are you?", "answer_tokens": 12, "tool_tokens": TOOL_TOKENS,
            "simple_tool": WEATHER, "nested_prompt": TEAM_PROMPT,
            "nested_tool": {"type": "function", "function": {
                "name": "record_team", "description": "Record a team", "parameters": team}}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([str(shutil.which("node")), script.name, str(tmp_path / "spec.json")],
                         cwd=script.parent, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])

    for answer in out["ollama_auto"]:  # ollama-js, "auto" mode
        assert not copied_instructions(answer["content"], [WEATHER]), answer
    (call,) = out["ollama_nested"]["tool_calls"]  # ollama-js, nested schema, tool_choice
    assert call["function"]["name"] == "record_team"
    jsonschema.validate(call["function"]["arguments"], team)

    settings = out["ai_settings"]  # AI SDK: top-level temperature, top_p, max_output_tokens
    assert settings["finishReason"] in ("length", "stop")
    assert 0 < settings["outputTokens"] <= spec["answer_tokens"]
    assert settings["ignored"] is None  # everything it sent meant something
    tool = out["ai_tool"]  # AI SDK: a tool call, tool_choice {"type": "function", "name"}
    assert tool["finishReason"] == "tool-calls" and tool["ignored"] is None
    (call,) = tool["toolCalls"]
    assert call["toolName"] == "record_team"
    jsonschema.validate(call["input"], team)
