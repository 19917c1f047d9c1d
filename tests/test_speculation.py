"""Speculative decoding by prompt lookup, on the real model: the same answer with it on and
off (greedy, sampled, and under a grammar), fewer decode steps where the answer quotes its
prompt, only a lone stream guessing on a CPU, and the settings that turn it on, through
both dialects of a live server."""

from __future__ import annotations

import json
import queue
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.engine.constrained.json_grammar import schema_to_grammar
from edge_agent.engine.request import DoneEvent, ErrorEvent, Event, SamplingParams
from edge_agent.engine.runtime.llama import LlamaModel
from edge_agent.engine.scheduling.scheduler import GenerationJob, ModelScheduler
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server

pytestmark = pytest.mark.integration

POLICY = ("Returns policy: Unopened items can be returned within 30 days with the receipt for "
          "a full refund. Opened electronics can be returned within 14 days and a restocking "
          "fee of 10 percent applies. Fresh food, gift cards and personalised items cannot be "
          "returned. Refunds are paid to the original payment method within 5 business days.")
QUOTE = (f"<|im_start|>user\n{POLICY}\n\nQuote the returns policy above word for word."
         "<|im_end|>\n<|im_start|>assistant\n")
STORY = ("<|im_start|>user\nWrite a short story about a fox in a forest.<|im_end|>\n"
         "<|im_start|>assistant\n")


@pytest.fixture
def fresh(model_path: Path) -> Iterator[Callable[..., ModelScheduler]]:
    """A new scheduler per run: no cells from an earlier run, so two runs compute the
    same prompt the same way and only the drafts differ."""
    made: list[ModelScheduler] = []

    def make(parallel: int = 1, **kw: object) -> ModelScheduler:
        sched = ModelScheduler(LlamaModel(model_path, n_gpu_layers=0), parallel=parallel,
                               n_ctx_seq=1024, n_batch=256, n_threads=2, embed_ctx=256,
                               max_queue=8, prefill_chunk=256, aging_s=10.0,
                               **kw)  # type: ignore[arg-type]
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.close()


def _run(sched: ModelScheduler, text: str, draft: int | None, *, max_tokens: int = 96,
         params: SamplingParams | None = None, grammar: str | None = None) -> DoneEvent:
    events: queue.Queue[Event] = queue.Queue()
    job = _job(sched, text, draft, events.put, max_tokens=max_tokens, params=params,
               grammar=grammar)
    sched.submit(job)
    return _result(events)


def _job(sched: ModelScheduler, text: str, draft: int | None,
         emit: Callable[[Event], None], *, max_tokens: int = 96,
         params: SamplingParams | None = None, grammar: str | None = None) -> GenerationJob:
    tokens = sched.model.tokenize(text, add_special=True, parse_special=True)
    return GenerationJob(prompt=tokens, params=params or SamplingParams(temperature=0),
                         grammar=grammar, max_tokens=max_tokens, stops=[], emit=emit,
                         draft=draft)


def _result(events: queue.Queue[Event]) -> DoneEvent:
    while True:
        event = events.get(timeout=120)
        if isinstance(event, DoneEvent):
            return event
        if isinstance(event, ErrorEvent):
            raise event.error


def test_greedy_answers_are_the_same_token_for_token_in_fewer_steps(
        fresh: Callable[..., ModelScheduler]) -> None:
    plain_sched = fresh()
    plain = _run(plain_sched, QUOTE, 0)
    spec_sched = fresh()
    spec = _run(spec_sched, QUOTE, 8)
    assert spec.context == plain.context  # every token, not only the text
    assert spec.text == plain.text and spec.reason == plain.reason
    assert plain_sched.stats.drafted == 0
    st = spec_sched.stats
    assert st.draft_accepted > 0 and st.drafted >= st.draft_accepted
    # Each confirmed guess is a token that took no pass of its own.
    assert spec_sched.stats.steps <= plain_sched.stats.steps - st.draft_accepted + 1
    # An answer that quotes nothing: the same text too, with few guesses decoded.
    story_plain = _run(plain_sched, STORY, 0)
    story_spec = _run(spec_sched, STORY, 8)
    assert story_spec.text == story_plain.text


def test_sampled_answers_are_the_same_with_the_same_seed(
        fresh: Callable[..., ModelScheduler]) -> None:
    """Each token is still one draw of the seeded sampler from its own position's logits:
    the guesses change how many passes it takes, not what is drawn."""
    params = SamplingParams(temperature=0.7, seed=99)
    plain = _run(fresh(), QUOTE, 0, params=params)
    sched = fresh()
    spec = _run(sched, QUOTE, 8, params=params)
    assert spec.context == plain.context
    assert sched.stats.draft_accepted > 0


def test_a_grammar_holds_and_the_answer_is_the_same(
        fresh: Callable[..., ModelScheduler]) -> None:
    schema = {"type": "object", "properties": {"policy": {"type": "string"},
                                               "days": {"type": "integer"}},
              "required": ["policy", "days"], "additionalProperties": False}
    grammar = schema_to_grammar(schema, param="format")
    text = QUOTE.replace("word for word.", "word for word, as JSON with the days too.")
    plain = _run(fresh(), text, 0, grammar=grammar, max_tokens=160)
    sched = fresh()
    spec = _run(sched, text, 8, grammar=grammar, max_tokens=160)
    assert spec.context == plain.context
    if spec.reason == "stop":
        jsonschema.validate(json.loads(spec.text), schema)
    assert sched.stats.drafted > 0


def test_beside_another_stream_nothing_is_guessed_on_a_cpu(
        fresh: Callable[..., ModelScheduler]) -> None:
    """Every extra row costs ~0.4 of a pass on a CPU: two streams decoding together keep
    their passes as they are. Both jobs are queued before the worker takes either, so they
    are prefilled in one step and decode side by side to the same length."""
    sched = fresh(parallel=2)
    no_eog = tuple((t, -100.0) for t in range(sched.model.n_vocab) if sched.model.is_eog(t))
    params = SamplingParams(temperature=0, logit_bias=no_eog)
    outs: list[queue.Queue[Event]] = [queue.Queue(), queue.Queue()]
    jobs = [_job(sched, QUOTE, 8, q.put, max_tokens=48, params=params) for q in outs]
    with sched.queue._cond:  # the worker's pop waits until both are in
        for job in jobs:
            sched.submit(job)
    done = [_result(q) for q in outs]
    assert [d.usage.completion_tokens for d in done] == [48, 48]
    assert sched.stats.drafted == 0


def test_the_batch_invariant_mode_never_guesses(fresh: Callable[..., ModelScheduler]) -> None:
    sched = fresh(deterministic=True, prompt_lookup=8)
    _run(sched, QUOTE, None, max_tokens=32)
    assert sched.stats.drafted == 0


def test_the_models_setting_applies_when_a_request_sets_none(
        fresh: Callable[..., ModelScheduler]) -> None:
    sched = fresh(prompt_lookup=8)
    _run(sched, QUOTE, 0, max_tokens=48)  # the request's 0 turns it off
    assert sched.stats.drafted == 0
    _run(sched, QUOTE, None, max_tokens=48)
    assert sched.stats.draft_accepted > 0


def test_the_setting_is_bounded_in_the_config() -> None:
    assert load_settings(None, **{"runtime.prompt_lookup": 32}).runtime.prompt_lookup == 32
    for bad in (-1, 33):
        with pytest.raises(ConfigError, match="prompt_lookup"):
            load_settings(None, **{"runtime.prompt_lookup": bad})


# -- through the API ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lookup_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[LiveServer]:
    """A server of its own, `prompt_lookup = 8` in its runtime settings: no other test's
    stream decodes beside these (a stream drafts only alone on a CPU)."""
    state = clone_state(model_cache, tmp_path_factory.mktemp("lookup") / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 2048,
        "runtime.prompt_lookup": 8}))
    yield live
    live.stop()


def _counter(live: LiveServer, name: str) -> float:
    text = httpx.get(f"{live.base_url}/metrics").text
    found = re.search(rf'^{name}\{{model="{re.escape(DEFAULT_MODEL)}"\}} (\S+)$', text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def _quote_messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{POLICY}\n\nQuote the returns policy above word "
                                        "for word."}]


# The answer held to the quote by its schema: whether a model of 135M parameters chooses to
# quote at temperature 0 turns on the last bits of its logits, which move with how the
# prompt was split into prefill steps (timed, so with the host's load) and with what the
# cache already held. Unheld, it quoted on an idle host and answered "I'm ready to help
# you with your return policy…" (no run of the prompt to guess from) on a busy one.
QUOTED = {"type": "object", "properties": {"policy": {"const": POLICY}},
          "required": ["policy"]}


def test_the_setting_the_ollama_option_and_the_header_turn_it_on_and_off(
        lookup_server: LiveServer) -> None:
    url = lookup_server.base_url

    def counters() -> tuple[float, float]:
        return (_counter(lookup_server, "edge_agent_draft_tokens_total"),
                _counter(lookup_server, "edge_agent_draft_accepted_tokens_total"))

    def ollama(**options: object) -> None:
        r = httpx.post(f"{url}/api/chat", timeout=120, json={
            "model": DEFAULT_MODEL, "messages": _quote_messages(), "stream": False,
            "format": QUOTED, "options": {"temperature": 0, "num_predict": 64, **options}})
        assert r.status_code == 200, r.text
        assert '"policy": "Returns policy:' in r.json()["message"]["content"], r.text

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def chat(header: str) -> None:
        answer = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=_quote_messages(),  # type: ignore[arg-type]
            temperature=0, max_tokens=64, extra_headers={"X-Edge-Prompt-Lookup": header},
            response_format={"type": "json_schema",
                             "json_schema": {"name": "quote", "schema": QUOTED}})
        assert '"policy": "Returns policy:' in (answer.choices[0].message.content or "")

    start = counters()
    ollama(prompt_lookup=0)  # the request's 0 over the model's 8
    chat("0")
    assert counters() == start
    ollama()  # the runtime setting
    drafted, confirmed = counters()
    assert drafted > start[0] and confirmed > start[1] and drafted >= confirmed
    chat("4")
    assert counters()[0] > drafted and counters()[1] > confirmed
    row = httpx.get(f"{url}/api/ps").json()["models"][0]
    assert row["speculation"] == {"draft_tokens": 8, "source": "prompt"}


@pytest.mark.parametrize("value", ["33", "-1", "8.0", "eight", "0x8", "123"])
def test_a_bad_header_or_option_is_refused_in_the_dialects_shape(
        lookup_server: LiveServer, value: str) -> None:
    url = lookup_server.base_url
    headers = {"X-Edge-Prompt-Lookup": value}
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Edge-Prompt-Lookup"
    r = httpx.post(f"{url}/api/chat", headers=headers, json={
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "X-Edge-Prompt-Lookup" in r.json()["error"]
    r = httpx.post(f"{url}/api/generate", json={
        "model": DEFAULT_MODEL, "prompt": "hi", "options": {"prompt_lookup": 33}})
    assert r.status_code == 400 and "prompt_lookup" in r.json()["error"]
