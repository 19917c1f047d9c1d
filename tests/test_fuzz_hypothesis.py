"""Arbitrary JSON at every endpoint of the live server: each answer is a documented status
(200/400/401/403/404/413/429/503) in the dialect's shape (OpenAI `{"error": {...}}` under
/v1, Ollama `{"error": "..."}` elsewhere), nothing hangs, and every scheduler thread is alive
afterwards (and still generates).

Bodies are anything JSON can hold (NaN and Infinity included, as Python's parser takes them),
or objects with the endpoint's own documented fields holding such values, or near-valid
bodies (the installed model, messages/prompt/input, small JSON schemas as grammars) so that
requests reach the template, the grammar compiler and the scheduler. A fixed seed and a
bounded number of examples per endpoint keep it fast; known failures of issue 10 are
counted, not failed (`tests.fuzzing.KNOWN`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.conftest import DEFAULT_MODEL, LiveServer
from tests.fuzzing import (
    REQUEST_TIMEOUT_S,
    VOCAB,
    Deep,
    Tally,
    judge,
    known_for,
    label,
    own_openapi_document,
    scheduler_problems,
    sets_deadline,
    tame_keep_alive,
    trace,
)

# Examples per endpoint, by kind of body (see `bodies`); endpoints without a body get `any`.
EXAMPLES = {"near": 30, "fields": 10, "any": 5}
DOCUMENT = own_openapi_document()
RUNS = [(method.upper(), path, kind) for path, ops in DOCUMENT["paths"].items()
        for method, op in ops.items()
        for kind in (EXAMPLES if "requestBody" in op else ["any"])]
# (An upload's fields are a form's; the JSON sent to it is refused whole, as it should be.)
BODY_FIELDS = {(m.upper(), p): sorted(next(iter(op["requestBody"]["content"].values()))[
    "schema"]["properties"]) for p, ops in DOCUMENT["paths"].items() for m, op in ops.items()
    if "requestBody" in op}

# -- strategies ---------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=10), kids, max_size=4), max_leaves=12)
# sampled_from draws evenly: the installed model about half the time.
model_names = st.sampled_from([DEFAULT_MODEL] * 6 + [
    "smollm2", "SmolLM2:135M", " smollm2:135m ", "nope:1", "../../etc/passwd", ""]).flatmap(
    lambda name: st.just(name) if name else st.text(max_size=30))
token_ids = st.lists(st.integers(0, VOCAB - 1) | st.integers(-5, VOCAB + 5), max_size=8)
# Lone surrogates are valid JSON (escaped: \ud800) but not text: item 8.
# One text in eight carries one.
texts = st.text(max_size=60).flatmap(lambda s: st.sampled_from([s] * 7 + [s + "\udfff"]))

json_schemas = st.recursive(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean",
                                           "null")]) | st.builds(
        lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n},
        st.integers(0, 8), st.integers(0, 8)) | st.builds(
        lambda e: {"enum": e}, st.lists(scalars, min_size=1, max_size=4)) | st.builds(
        lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
        st.integers(-10**6, 10**6), st.integers(-10**6, 10**6)),
    lambda kids: st.builds(lambda props, req: {"type": "object", "properties": props,
                                               "required": [k for k in props if req]},
                           st.dictionaries(st.text(max_size=8), kids, max_size=3),
                           st.booleans())
    | st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                kids, st.integers(0, 4))
    | st.builds(lambda alts: {"anyOf": alts}, st.lists(kids, min_size=1, max_size=3)),
    max_leaves=6)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                        st.fixed_dictionaries(
                                            {"name": st.text(min_size=1, max_size=12)},
                                            optional={"parameters": json_schemas,
                                                      "description": texts})}),
                 max_size=2)
roles = st.sampled_from(["system", "user", "assistant", "tool"] * 4 + ["developer", ""])
messages = st.lists(st.fixed_dictionaries(
    {"role": roles}, optional={"content": st.one_of(texts, texts, json_values)}),
    min_size=1, max_size=4) | st.just([])

# Fields that shape a request the most, with values that get far into the server.
NEAR = {
    "model": model_names,
    "messages": messages,
    "prompt": texts | token_ids | st.lists(token_ids, max_size=3),
    "input": texts | st.lists(texts, max_size=4) | token_ids,
    "context": token_ids,
    "format": st.just("json") | json_schemas,
    "response_format": st.just({"type": "json_object"}) | st.builds(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
        json_schemas),
    "tools": tools,
    "stream": st.booleans(),
    "max_tokens": st.integers(-2, 10**9),
    "options": st.dictionaries(st.sampled_from(["num_predict", "temperature", "top_k",
                                                "top_p", "seed", "stop", "num_ctx"]),
                               st.integers(-5, 10**6) | st.floats() | texts, max_size=3),
    "keep_alive": st.sampled_from(["5m", -1, "1h"]),
}


def bodies(method: str, path: str, kind: str) -> st.SearchStrategy[Any]:
    """`any`: any JSON value; `fields`: an object of the endpoint's documented fields with
    any values; `near`: the fields that shape a request, with values that get far."""
    fields = BODY_FIELDS.get((method, path), [])
    if kind == "any":
        return json_values
    if kind == "fields":
        return st.fixed_dictionaries({}, optional={f: json_values for f in fields})
    near = {f: NEAR[f] for f in fields if f in NEAR}
    if method == "DELETE":  # the installed model is needed by every later example
        near["model"] = st.text(max_size=30)
    required = ("model", "messages", "input", "prompt" if path == "/v1/completions" else "")
    return st.fixed_dictionaries({k: v for k, v in near.items() if k in required},
                                 optional={k: v for k, v in near.items() if k not in required})


def target(path: str) -> st.SearchStrategy[str]:
    if "{model_id}" not in path:
        return st.just(path)
    return st.one_of(st.just(DEFAULT_MODEL), st.text(min_size=1, max_size=100)).map(
        lambda name: path.replace("{model_id}", quote(name, safe="")))


# -- the run -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(fuzz_live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_live.base_url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    t = Tally()
    yield t
    print("\nhypothesis cases per endpoint:\n  " + "\n  ".join(t.lines()))


def _send(client: httpx.Client, tally: Tally, op: str, method: str, path: str,
          content: bytes) -> httpx.Response:
    """One request; sent again once on a new connection when the previous answer was a
    5xx and the connection it came on turns out closed: after an unhandled error the server
    closes a keep-alive connection without saying so (`Connection: close`), and the next
    request on it is reset. Counted; a reset after anything else fails."""
    headers = {"content-type": "application/json"}
    try:
        return client.request(method, path, content=content, headers=headers)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        if tally.previous_status < 500:
            raise
        tally.reconnects[op] += 1
        return client.request(method, path, content=content, headers=headers)


def _post(client: httpx.Client, live: LiveServer, tally: Tally, method: str, template: str,
          path: str, body: Any) -> None:
    op = f"{method} {template}"
    body, tamed = tame_keep_alive(body)
    if tamed:
        tally.tamed[op][tamed] += 1
    known = known_for(method, unquote(path), body)
    withheld = [k for k in known if k.withhold]
    if withheld:
        tally.withheld[op][label(withheld[0])] += 1
        trace(method, path, body, withheld=label(withheld[0]))
        return
    deep = isinstance(body, Deep)
    content = body.content() if deep else json.dumps(body, allow_nan=True).encode()
    trace(method, path, repr(body) if deep else body)
    t0 = time.monotonic()
    try:
        r = _send(client, tally, op, method, path, content)
    except httpx.TimeoutException:
        pytest.fail(f"{op} hung (> {REQUEST_TIMEOUT_S} s) on {content[:2000]!r}")
    finally:
        tally.seconds[op] += time.monotonic() - t0
    tally.previous_status = r.status_code
    trace(method, path, status=r.status_code, reply=r.content, seconds=time.monotonic() - t0)
    tally.sent[op] += 1
    tally.statuses[op][r.status_code] += 1
    verdict = judge(path, r.status_code, r.headers.get("content-type", ""), r.content,
                    deadline=sets_deadline(body))
    assert verdict.problem is None, f"{op}: {verdict.problem}\nbody: {content[:2000]!r}"
    if verdict.server_error:
        assert known, f"{op}: {verdict.server_error}\nbody: {content[:2000]!r}"
        tally.known[op][label(known[0])] += 1
    dead = [m.info.name for m in live.app.state.parts.registry.loaded()
            if not m.worker._thread.is_alive()]
    assert not dead, f"{op}: the scheduler of {dead} died on {content[:2000]!r}"


@pytest.mark.integration
@pytest.mark.fuzz
@pytest.mark.parametrize(("method", "path", "kind"), RUNS,
                         ids=[f"{m} {p} {k}" for m, p, k in RUNS])
def test_arbitrary_json(method: str, path: str, kind: str, fuzz_live: LiveServer,
                        client: httpx.Client, tally: Tally) -> None:
    @seed(10)
    @settings(max_examples=EXAMPLES[kind], deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(url=target(path), body=bodies(method, path, kind))
    def run(url: str, body: Any) -> None:
        _post(client, fuzz_live, tally, method, path, url, body)

    run()


@pytest.mark.integration
@pytest.mark.fuzz
@pytest.mark.parametrize(("method", "path"), sorted(BODY_FIELDS))
def test_deeply_nested_json(method: str, path: str, fuzz_live: LiveServer,
                            client: httpx.Client, tally: Tally) -> None:
    """JSON nested up to and past the parser's recursion limit (near 1,000 levels)."""
    for depth in (10, 500, 999, 1000, 2500):
        _post(client, fuzz_live, tally, method, path, path, Deep(depth))


@pytest.mark.integration
@pytest.mark.fuzz
def test_schedulers_alive_afterwards(fuzz_live: LiveServer) -> None:
    assert scheduler_problems(fuzz_live) == []
