"""Draft-model speculation, on the real model: a second model with the same vocabulary
guesses, the main model confirms; the answer is the same as without it (greedy and
sampled), in fewer passes; a guess that fails is no guess; a draft with another
vocabulary is refused when the model loads; and `[models."x"] draft_model` through a live
server, where a request's `prompt_lookup` 0 turns it off.

The draft here is the default model itself (a vocabulary shared trivially, every greedy
guess confirmed): what is checked is that the guesses change the passes, never the text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.request import SamplingParams
from edge_agent.engine.runtime.llama import LlamaModel
from edge_agent.engine.scheduling.draftmodel import vocabulary_difference
from edge_agent.engine.scheduling.scheduler import ModelScheduler
from tests.conftest import DEFAULT_MODEL, LiveServer, clone_state, free_port, start_server
from tests.test_speculation import QUOTE, STORY, _counter, _run

pytestmark = pytest.mark.integration
GEMMA = "gemma3:270m"


@pytest.fixture
def fresh(model_path: Path) -> Iterator[Callable[..., ModelScheduler]]:
    made: list[ModelScheduler] = []

    def make(*, draft: bool, **kw: object) -> ModelScheduler:
        sched = ModelScheduler(
            LlamaModel(model_path, n_gpu_layers=0), parallel=2, n_ctx_seq=1024, n_batch=256,
            n_threads=2, embed_ctx=256, max_queue=8, prefill_chunk=256, aging_s=10.0,
            prompt_lookup=4 if draft else 0,
            draft_model=LlamaModel(model_path, n_gpu_layers=0) if draft else None,
            **kw)  # type: ignore[arg-type]
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.close()


def test_greedy_answers_are_the_same_token_for_token_in_fewer_passes(
        fresh: Callable[..., ModelScheduler]) -> None:
    plain_sched, spec_sched = fresh(draft=False), fresh(draft=True)
    for text in (STORY, QUOTE):  # free text too: a draft model guesses any text
        plain = _run(plain_sched, text, None, max_tokens=64)
        spec = _run(spec_sched, text, None, max_tokens=64)
        assert spec.context == plain.context
    st = spec_sched.stats
    assert st.draft_accepted > 0 and st.drafted >= st.draft_accepted
    assert spec_sched.stats.steps <= plain_sched.stats.steps - st.draft_accepted + 2
    assert spec_sched.drafter is not None and spec_sched.drafter.passes > 0
    # The request's own bound: 0 is no guess at all.
    drafted = st.drafted
    assert _run(spec_sched, STORY.replace("fox", "owl"), 0, max_tokens=16).text
    assert spec_sched.stats.drafted == drafted


def test_sampled_answers_are_the_same_with_the_same_seed(
        fresh: Callable[..., ModelScheduler]) -> None:
    params = SamplingParams(temperature=0.8, seed=7)
    plain = _run(fresh(draft=False), STORY, None, params=params, max_tokens=48)
    sched = fresh(draft=True)
    spec = _run(sched, STORY, None, params=params, max_tokens=48)
    assert spec.context == plain.context
    assert sched.stats.drafted > 0


def test_a_guess_that_fails_is_no_guess(fresh: Callable[..., ModelScheduler],
                                        monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A failure of the draft costs the guesses of that step, never the request: here its
    record of the cells it holds is wiped while the cells stay, so its next pass writes
    positions that llama.cpp refuses; and then a draft that always fails."""
    plain = _run(fresh(draft=False), STORY, None, max_tokens=32)
    sched = fresh(draft=True)
    drafter = sched.drafter
    assert drafter is not None
    _run(sched, STORY, None, max_tokens=32)
    drafter._held = [[] for _ in drafter._held]  # the cells stay: position 0 is taken
    accepted = sched.stats.draft_accepted
    with caplog.at_level(logging.ERROR, logger="edge_agent.engine.scheduling.scheduler"):
        spec = _run(sched, STORY, None, max_tokens=32)
    assert spec.context == plain.context and sched.stats.failures == 0
    failed = [r for r in caplog.records if "failed to guess" in r.getMessage()]
    assert len(failed) == 1  # that step only: its cells forgotten, it guessed again after
    assert sched.stats.draft_accepted > accepted

    def broken(seq: int, tokens: list[int], limit: int) -> list[int]:
        raise RuntimeError("the draft model is gone")

    monkeypatch.setattr(drafter, "draft", broken)
    again = _run(sched, STORY.replace("fox", "owl"), None, max_tokens=32)
    assert again.reason == "length" and sched.stats.failures == 0


@dataclass
class _Vocab:
    """Two vocabularies to compare, as `vocabulary_difference` reads them."""

    pieces: list[bytes]

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    def piece(self, token: int) -> bytes:
        return self.pieces[token]


def test_a_draft_must_have_the_same_tokens(model_path: Path) -> None:
    model = LlamaModel(model_path, n_gpu_layers=0)
    try:
        assert vocabulary_difference(model, model) is None
    finally:
        model.close()
    a = _Vocab([b"a", b"b", b"c"])
    assert vocabulary_difference(a, _Vocab([b"a", b"b"])) == "2 tokens against 3"  # type: ignore[arg-type]
    assert "token 1" in str(vocabulary_difference(a, _Vocab([b"a", b"x", b"c"])))  # type: ignore[arg-type]


def test_the_settings_are_bounded() -> None:
    s = load_settings(None, **{"models": {DEFAULT_MODEL: {"draft_model": GEMMA,
                                                          "draft_tokens": 8}}})
    assert s.model_override(DEFAULT_MODEL).draft_model == GEMMA
    for bad in (0, 33):
        with pytest.raises(ConfigError):
            load_settings(None, **{"models": {DEFAULT_MODEL: {"draft_tokens": bad}}})


# -- through the API ------------------------------------------------------------------------

def _server(state: Path, draft: str) -> LiveServer:
    return start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 2048,
        "models": {DEFAULT_MODEL: {"draft_model": draft}}}))


@pytest.fixture(scope="module")
def draft_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[LiveServer]:
    state = clone_state(model_cache, tmp_path_factory.mktemp("draft") / "state")
    live = _server(state, DEFAULT_MODEL)
    yield live
    live.stop()


def _chat(live: LiveServer, **options: object) -> str:
    r = httpx.post(f"{live.base_url}/api/chat", timeout=120, json={
        "model": DEFAULT_MODEL, "stream": False,
        "messages": [{"role": "user", "content": "Write a short story about a fox."}],
        "options": {"temperature": 0, "num_predict": 40, **options}})
    assert r.status_code == 200, r.text
    return str(r.json()["message"]["content"])


def test_the_models_draft_model_guesses_and_a_request_may_turn_it_off(
        draft_server: LiveServer) -> None:
    # The two answers compared are computed alike: each from the prompt's cells cached by
    # this first request. At temperature 0 a prompt prefilled whole and one taken from the
    # cache may differ in the last bits of the logits, and so in a near-tied token.
    _chat(draft_server, prompt_lookup=0)
    before = _counter(draft_server, "edge_agent_draft_accepted_tokens_total")
    off = _chat(draft_server, prompt_lookup=0)
    assert _counter(draft_server, "edge_agent_draft_accepted_tokens_total") == before
    on = _chat(draft_server)
    assert _counter(draft_server, "edge_agent_draft_accepted_tokens_total") > before
    assert on == off
    row = httpx.get(f"{draft_server.base_url}/api/ps").json()["models"][0]
    assert row["speculation"] == {"draft_tokens": 4, "source": DEFAULT_MODEL}


def test_a_draft_with_another_vocabulary_is_refused_and_the_model_serves(
        model_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    store = ModelStore(state)
    try:
        store.pull(GEMMA)
    finally:
        store.close()
    with caplog.at_level(logging.ERROR, logger="edge_agent.engine.registry"):
        live = _server(state, GEMMA)
        try:
            assert _chat(live)
            assert _counter(live, "edge_agent_draft_tokens_total") == 0
            row = httpx.get(f"{live.base_url}/api/ps").json()["models"][0]
            assert row["speculation"] == {"draft_tokens": 0, "source": None}
        finally:
            live.stop()
    assert any("another vocabulary" in r.getMessage() and GEMMA in r.getMessage()
               for r in caplog.records)
