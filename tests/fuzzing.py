"""Shared by the fuzz tests: a server on which fuzzing stays cheap, what a response may be
(documented status, dialect's error shape), and the failures that are known and tracked.

The server is the real app with the real default model, tuned so that no generated request
costs more than a few tokens: the open tenant `local` has an output ceiling that clamps
(`max_tokens`/`num_predict` of any size give at most `MAX_OUTPUT` tokens) and the context is
short, so a long prompt is a quick 400. llama.cpp gets one thread: on a box whose cores are
all busy (the test client, other tests), two threads waiting for each other at every
barrier made a one-token embedding take seconds instead of 0.1 s. Nothing is mocked.

`KNOWN` lists failures that an open issue describes and that are not fixed yet; each names
its issue. A 5xx (or an error inside a 200 stream) on a request that one of them matches is
counted, not failed; a request that would kill or wedge the server (`withhold`) is not sent
at all, since every later case would fail with it. Once a fix is in, its entry goes: every
case is then sent and every 5xx fails. The list is empty.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from edge_agent import __version__
from edge_agent.api import feedback, ollama, ollama_models, ops
from edge_agent.api.openai import batch_routes, routes
from edge_agent.config import load_settings
from edge_agent.engine.registry import FOREVER, parse_keep_alive
from edge_agent.errors import EdgeAgentError
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

MAX_OUTPUT = 4  # output tokens per request, at most
REQUEST_TIMEOUT_S = 30.0  # a request taking longer is a hang
# The statuses the API documents, in the dialect's error shape when not 200.
DOCUMENTED = frozenset({200, 400, 401, 403, 404, 413, 429, 503})
VOCAB = 49152  # the default model's vocabulary (checked against the loaded model)


def start_fuzz_server(model_cache: Path, state: Path) -> LiveServer:
    settings = load_settings(None, state_dir=clone_state(model_cache, state), **{
        "server.port": free_port(), "server.max_body_bytes": 64 * 1024,
        "runtime.context_length": 512, "runtime.threads": 1, "telemetry.hardware": False,
        "tenants.local.max_output_tokens": MAX_OUTPUT,
        "tenants.local.output_limit": "clamp"})
    live = start_server(settings)
    vocab = {m.worker.model.n_vocab for m in live.app.state.parts.registry.loaded()}
    assert vocab == {VOCAB}, f"the default model's vocabulary is {vocab}, not {VOCAB}"
    return live


def own_openapi_document() -> dict[str, Any]:
    """The document the server serves at /openapi.json, built without a server so that the
    operations are known when tests are collected (the schemathesis tests check that the
    live server serves the same)."""
    app = FastAPI(title="edge-agent", version=__version__)
    for router in (ops.router, ollama.router, ollama_models.router, routes.router,
                   batch_routes.router, feedback.router):
        app.include_router(router)
    return app.openapi()


# -- the known failures ----------------------------------------------------------------------

@dataclass(frozen=True)
class Known:
    issue: int  # the issue that describes it
    what: str
    matches: Callable[[str, str, Any], bool]  # (method, path, body)
    withhold: bool = False  # sending it would abort, exhaust or wedge the server


@dataclass(frozen=True)
class Deep:
    """A body with a value nested `depth` levels deep, sent as it is written here: Python's
    own encoder stops near 1,000 levels."""

    depth: int

    def content(self) -> bytes:
        return (b'{"model": "' + DEFAULT_MODEL.encode() + b'", "messages": '
                + b"[" * self.depth + b"]" * self.depth + b"}")


KNOWN: list[Known] = []


UNLOADS = "keep_alive under 60 s (would unload a model the run keeps using)"


def tame_keep_alive(body: Any) -> tuple[Any, str | None]:
    """The body without a `keep_alive` that would make every later case slow or fail, and
    why it was dropped (counted, see `Tally.tamed`).

    A short `keep_alive` unloads a model after its request (the default model ignores it);
    the next request would wait seconds for it to load again, and a fuzz run would spend
    most of its time reloading. Values past a century (1e12, Infinity) mean forever and NaN
    is refused, so they are sent as generated."""
    if not isinstance(body, dict) or "keep_alive" not in body:
        return body, None
    try:
        seconds = parse_keep_alive(body["keep_alive"])
    except EdgeAgentError:
        return body, None
    if seconds is None or seconds == FOREVER:
        return body, None
    reason = UNLOADS if 0 <= seconds < 60 else None
    if reason is None:
        return body, None
    return {k: v for k, v in body.items() if k != "keep_alive"}, reason


def known_for(method: str, path: str, body: Any) -> list[Known]:
    return [k for k in KNOWN if k.matches(method.upper(), path, body)]


def trace(method: str, path: str, body: Any = None, *, status: int | None = None,
          reply: bytes = b"", seconds: float = 0.0, withheld: str | None = None) -> None:
    """With FUZZ_TRACE=file, each request is appended to the file before it is sent (and
    its answer after): a request that kills the process (and the test run with it) is then
    the file's last."""
    target = os.environ.get("FUZZ_TRACE")
    if target:
        entry = {"method": method, "path": path, "body": body} if status is None else \
            {"status": status, "s": round(seconds, 3),
             "reply": reply[:300].decode("utf-8", "replace")}
        if withheld:
            entry["withheld"] = withheld
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


# -- what a response may be ------------------------------------------------------------------

def sets_deadline(body: Any, headers: dict[str, Any] | None = None) -> bool:
    return (isinstance(body, dict) and body.get("timeout_ms") is not None) or any(
        k.lower() == "x-timeout-ms" for k in (headers or {}))


def is_openai(path: str) -> bool:
    """OpenAI's error shape: under /v1, and the box's own namespace, /edge/v1."""
    return path in ("/v1", "/edge/v1") or path.startswith(("/v1/", "/edge/v1/"))


def error_shape_problem(path: str, payload: Any) -> str | None:
    """None when `payload` is an error in the dialect's shape: OpenAI
    `{"error": {"message", "type", "param", "code"}}` under /v1, Ollama `{"error": "..."}`."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return f"error body is not {{'error': ...}}: {str(payload)[:200]}"
    err = payload["error"]
    if not is_openai(path):
        return None if isinstance(err, str) and err else f"Ollama error is not a string: {err!r}"
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"OpenAI error has the wrong keys: {str(err)[:200]}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return f"OpenAI error message/type are not strings: {err!r}"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return f"OpenAI error param/code are neither strings nor null: {err!r}"
    return None


@dataclass
class Verdict:
    status: int
    server_error: str | None = None  # a 5xx, or an error event inside a 200 stream
    problem: str | None = None  # undocumented status or wrong shape: always a failure


def judge(path: str, status: int, content_type: str, content: bytes, *,
          other_method: bool = False, deadline: bool = False) -> Verdict:
    """`other_method`: the request used a method the route does not serve (405 then).
    `deadline`: the client set its own deadline (`timeout_ms`, `X-Timeout-Ms`), so a 504
    saying it passed is the documented answer, not a server error."""
    verdict = Verdict(status)
    if status == 504 and deadline:
        pass
    elif status >= 500:
        verdict.server_error = f"{status}: {content[:300]!r}"
    elif status not in DOCUMENTED and not (other_method and status == 405):
        verdict.problem = f"undocumented status {status}: {content[:300]!r}"
    if status != 200:
        try:
            payload = json.loads(content)
        except ValueError:
            verdict.problem = f"{status} without a JSON body: {content[:300]!r}"
            return verdict
        verdict.problem = verdict.problem or error_shape_problem(path, payload)
        return verdict
    if content_type.startswith(("text/event-stream", "application/x-ndjson")):
        for payload in _stream_payloads(content_type, content):
            if isinstance(payload, dict) and "error" in payload:
                verdict.problem = error_shape_problem(path, payload)
                verdict.server_error = f"error inside a 200 stream: {str(payload)[:300]}"
    elif content_type.startswith("application/json"):
        try:
            json.loads(content)
        except ValueError:
            verdict.problem = f"200 whose JSON does not parse: {content[:300]!r}"
    return verdict


def _stream_payloads(content_type: str, content: bytes) -> Iterator[Any]:
    for line in content.decode("utf-8", "replace").splitlines():
        if content_type.startswith("text/event-stream"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            line = line[6:]
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError:
                yield {"error": f"stream line is not JSON: {line[:200]}"}


# -- the server afterwards -------------------------------------------------------------------

def scheduler_problems(live: LiveServer) -> list[str]:
    """Every loaded model's scheduler thread is alive and still generates."""
    problems = []
    for m in live.app.state.parts.registry.loaded():
        thread = m.worker._thread
        if not thread.is_alive():
            problems.append(f"the scheduler thread of {m.info.name} is dead")
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{live.base_url}/api/generate", timeout=REQUEST_TIMEOUT_S, json={
            "model": DEFAULT_MODEL, "prompt": "Hello", "stream": False,
            "options": {"num_predict": 2, "temperature": 0}})
        if r.status_code != 200:
            problems.append(f"a plain generation afterwards got {r.status_code}: {r.text[:200]}")
    except httpx.HTTPError as exc:
        problems.append(f"a plain generation afterwards failed after "
                        f"{time.monotonic() - t0:.1f} s: {exc!r}")
    if not any(m.worker._thread.is_alive() for m in live.app.state.parts.registry.loaded()):
        problems.append("no scheduler thread is running after a generation")
    return problems


# -- counts, for the report --------------------------------------------------------------------

@dataclass
class Tally:
    """Per operation: cases sent and by status, known 5xx by item, cases withheld."""

    sent: Counter[str] = field(default_factory=Counter)
    statuses: defaultdict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    known: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    withheld: defaultdict[str, Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter))
    seconds: Counter[str] = field(default_factory=Counter)
    nulls_dropped: defaultdict[str, Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter))
    tamed: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    reconnects: Counter[str] = field(default_factory=Counter)  # see test_fuzz_hypothesis
    previous_status: int = 0

    def lines(self) -> list[str]:
        ops = sorted(set(self.sent) | set(self.withheld))
        only_405 = [op for op in ops if set(self.statuses[op]) == {405}
                    and not self.withheld[op]]
        out = []
        if only_405:
            n = sum(self.sent[op] for op in only_405)
            out.append(f"{n} cases with a method the route does not serve, on "
                       f"{len(only_405)} method/route pairs: all 405")
        for op in ops:
            if op in only_405:
                continue
            statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses[op].items()))
            line = f"{op}: {self.sent[op]} sent ({statuses}) in {self.seconds[op]:.1f} s"
            if self.known[op]:
                line += "; known 5xx " + ", ".join(f"{k}: {n}" for k, n in
                                                  sorted(self.known[op].items()))
            if self.nulls_dropped[op]:
                line += "; nulls dropped " + ", ".join(f"{k}: {n}" for k, n in
                                                      sorted(self.nulls_dropped[op].items()))
            if self.reconnects[op]:
                line += f"; connection reset after a 5xx: {self.reconnects[op]}"
            if self.tamed[op]:
                line += "; keep_alive dropped " + ", ".join(f"{k}: {n}" for k, n in
                                                           sorted(self.tamed[op].items()))
            if self.withheld[op]:
                line += "; withheld " + ", ".join(f"{k}: {n}" for k, n in
                                                 sorted(self.withheld[op].items()))
            out.append(line)
        return out


def label(k: Known) -> str:
    return f"issue {k.issue} ({k.what})"
