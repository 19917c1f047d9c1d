"""The sampler on the real model: a grammar checked after sampling gives the grammar-first
chain's greedy output token for token, and the prefix forest allows exactly what llama.cpp's
whole-vocabulary filter allows, at every step of real generations."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llama_cpp as ll
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edge_agent.engine.constrained import sampler as sampler_module
from edge_agent.engine.constrained.grammar_cache import ParsedGrammars
from edge_agent.engine.constrained.grammar_check import CheckedGrammar
from edge_agent.engine.constrained.json_grammar import schema_to_grammar
from edge_agent.engine.constrained.logit_edits import LogitEdits
from edge_agent.engine.constrained.sampler import Candidates, Sampler, greedy
from edge_agent.engine.constrained.token_prefixes import TokenPrefixes, Utf8Tail, decode_utf8
from edge_agent.engine.constrained.tool_calls import tool_call_schema
from edge_agent.engine.request import SamplingParams
from edge_agent.engine.runtime.llama import BatchContext, LlamaModel
from edge_agent.errors import EdgeAgentError

pytestmark = pytest.mark.integration

ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string", "maxLength": 12}, "customer": {"type": "string"},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 100}, "price": {"type": "number"},
    "express": {"type": "boolean"}},
    "required": ["order_id", "customer", "quantity", "price", "express"]}
NOTE = {"type": "object", "properties": {
    "note": {"type": "string", "maxLength": 20},
    "tags": {"type": "array", "items": {"enum": ["a b", "ü", "日本", "🎉"]}, "maxItems": 4}},
    "required": ["note", "tags"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}}}]
QUESTIONS = ["Give me an order record as JSON.", "What is the weather in Oslo?",
             "Write a poem about the sea, with emoji 🌊."]


class Engine:
    def __init__(self, path: Path) -> None:
        self.model = LlamaModel(path, n_gpu_layers=0)
        self.ctx = BatchContext(self.model, n_seq=3, n_ctx_seq=512, n_batch=256, n_threads=2)
        self.candidates = Candidates(self.model.n_vocab)
        self.grammars = ParsedGrammars(self.model.vocab)
        m = self.model
        self.prefixes = TokenPrefixes([m.grammar_piece(t) for t in range(m.n_vocab)],
                                      [m.is_eog(t) for t in range(m.n_vocab)])
        self.prompts = [m.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                   add_special=True, parse_special=True) for q in QUESTIONS]

    def sampler(self, params: SamplingParams, grammar: CheckedGrammar, **kw: Any) -> Sampler:
        return Sampler.build(self.model, params, grammar, candidates=self.candidates,
                             grammars=self.grammars, **kw)

    def run(self, samplers: list[Sampler], steps: int, each_step: Any = None
            ) -> list[list[int]]:
        """The three prompts decoded together, one batch a step, each with its sampler."""
        ctx, model = self.ctx, self.model
        for seq in range(3):
            ctx.clear(seq)
        batch = ctx.batch
        batch.clear()
        rows = [batch.add_span(p, 0, seq, last_logits=True) for seq, p in enumerate(self.prompts)]
        ctx.decode()
        pos = [len(p) for p in self.prompts]
        out: list[list[int]] = [[] for _ in self.prompts]
        live = [True] * 3
        for _ in range(steps):
            if each_step is not None:
                each_step(samplers, live)
            tokens = [samplers[q].sample(ctx, rows[q]) if live[q] else -1 for q in range(3)]
            batch.clear()
            for q, token in enumerate(tokens):
                if not live[q]:
                    continue
                if model.is_eog(token):
                    live[q] = False
                    continue
                out[q].append(token)
                rows[q] = batch.add(token, pos[q], q, True)
                pos[q] += 1
            if not any(live):
                break
            ctx.decode()
        return out

    def prefill_one(self) -> tuple[list[int], int]:
        """The third prompt alone in sequence 0, decoded: it and its logits' batch row."""
        self.ctx.clear(0)
        batch = self.ctx.batch
        batch.clear()
        prompt = self.prompts[2]
        row = batch.add_span(prompt, 0, 0, last_logits=True)
        self.ctx.decode()
        return prompt, row

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.model.piece(t) for t in tokens).decode()

    def close(self) -> None:
        self.grammars.close()
        self.ctx.close()
        self.model.close()


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    e = Engine(model_path)
    yield e
    e.close()


def _grammars() -> dict[str, CheckedGrammar]:
    return {"order": schema_to_grammar(ORDER, param="format"),
            "note": schema_to_grammar(NOTE, param="format"),
            "tools": schema_to_grammar(tool_call_schema(TOOLS, "auto"), param="tools")}


NO_EOS_BIAS = -100.0


@pytest.mark.parametrize("kind", ["order", "tools"])
@pytest.mark.parametrize("params", [
    {}, {"repeat_penalty": 1.3, "no_eos": True},
    {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repeat_last_n": 16}],
    ids=["plain", "repeat-penalty-and-bias", "frequency-presence"])
def test_greedy_output_is_the_grammar_first_chains_token_for_token(
        engine: Engine, kind: str, params: dict[str, Any]) -> None:
    """Batched, three sequences, the old chain (grammar inside, filtering the vocabulary at
    every step) against the new one: the same tokens. Penalties make a token accepted twice,
    or a refused one accepted, show up as a different answer."""
    no_eos = params.pop("no_eos", False)
    bias = tuple((t, NO_EOS_BIAS) for t in range(engine.model.n_vocab)
                 if engine.model.is_eog(t)) if no_eos else ()
    sampling = SamplingParams(temperature=0.0, logit_bias=bias, **params)
    grammar = _grammars()[kind]
    old = engine.run([engine.sampler(sampling, grammar, grammar_first=True)
                      for _ in range(3)], steps=48)
    new_samplers = [engine.sampler(sampling, grammar, prefixes=engine.prefixes)
                    for _ in range(3)]
    new = engine.run(new_samplers, steps=48)
    assert new == old
    assert sum(s.refusals for s in new_samplers) > 0  # the refusal paths ran
    for s in new_samplers:
        s.close()


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 0.0, "repeat_penalty": 1.3, "no_eos": True},
    {"temperature": 0.0, "repeat_penalty": 1.1, "frequency_penalty": 0.5,
     "presence_penalty": 0.3, "repeat_last_n": 16},
    {"temperature": 0.7, "top_p": 0.9, "repeat_penalty": 1.1, "seed": 7},
    {"temperature": 1.2, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.5,
     "frequency_penalty": 0.2, "presence_penalty": 0.4, "repeat_last_n": 8, "seed": 11,
     "no_eos": True},
    {"temperature": 1.5, "top_k": 128, "top_p": 1.0, "min_p": 0.0, "seed": 5},
    {"temperature": 1.0, "top_k": 1, "seed": 3, "no_eos": True},
    {"temperature": 1.3, "top_k": 60, "typical_p": 0.9, "top_p": 0.95, "min_p": 0.01,
     "seed": 9},
    {"temperature": 1.5, "top_k": 129, "top_p": 1.0, "min_p": 0.0, "seed": 13}],
    ids=["greedy", "greedy-repeat-bias", "greedy-all-penalties", "seeded",
         "hot-all-penalties-bias", "top-128", "top-1-bias", "top-60-typical",
         "top-129-whole-row"])
def test_without_a_grammar_the_edited_row_samples_as_the_whole_chain(
        engine: Engine, params: dict[str, Any]) -> None:
    """The bias and penalties written into the row (`logit_edits`), the greedy argmax and
    the top candidates (`Candidates.load_top`, for top-k 1..128) against llama.cpp's whole
    chain over the whole vocabulary: the same tokens, greedy and seeded, three sequences
    batched, long enough for the penalty window to roll over. The bias names every
    end-of-generation token twice, so both its entries must apply."""
    params = dict(params)
    no_eos = params.pop("no_eos", False)
    eog = [t for t in range(engine.model.n_vocab) if engine.model.is_eog(t)]
    bias = tuple((t, NO_EOS_BIAS / 2) for t in eog for _ in range(2)) if no_eos else ()
    seed = params.pop("seed", None)

    def samplers(**kw: Any) -> list[Sampler]:
        return [Sampler.build(engine.model, SamplingParams(
            logit_bias=bias, seed=None if seed is None else seed + q, **params), None,
            candidates=engine.candidates, **kw) for q in range(3)]

    reference = samplers(grammar_first=True)
    assert all(s.edits is None for s in reference)
    edited = samplers()
    assert all(s.edits is not None for s in edited)
    top = params.get("top_k", SamplingParams().top_k)
    sampled = params["temperature"] > 0
    assert all(s.top_k == (top if sampled and 0 < top <= 128 else 0) for s in edited)
    old = engine.run(reference, steps=80)
    new = engine.run(edited, steps=80)
    assert new == old
    assert max(len(t) for t in new) > 20
    for s in reference + edited:
        s.close()


@pytest.mark.parametrize("params", [
    {"repeat_penalty": 1.3},
    {"repeat_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.3,
     "repeat_last_n": 16},
    {"repeat_penalty": 0.8, "frequency_penalty": -0.4, "presence_penalty": 1.7,
     "repeat_last_n": 5},
    {"repeat_penalty": 5e-324, "frequency_penalty": 3e38, "repeat_last_n": 8}],
    ids=["repeat", "all-three", "negative-and-short-window", "zero-and-overflow"])
def test_the_edits_write_exactly_what_llama_cpps_samplers_leave(
        engine: Engine, params: dict[str, Any]) -> None:
    """Every logit of the row, bit for bit, after llama.cpp's logit-bias and penalties
    samplers over the whole vocabulary and after `LogitEdits` over the tokens they name,
    at each step of a greedy run whose window fills and rolls over (a repeated token, a
    token leaving it, one named twice by the bias)."""
    model, ctx = engine.model, engine.ctx
    bias = ((13, 2.5), (13, -0.75), (42, -3.0), (model.eos, -100.0))
    sampling = SamplingParams(temperature=0.0, logit_bias=bias, **params)
    edits = LogitEdits(sampling)
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    arr = (ll.llama_logit_bias * len(bias))(*(ll.llama_logit_bias(t, b) for t, b in bias))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_logit_bias(model.n_vocab,
                                                                       len(bias), arr))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
        model.n_vocab, sampling.repeat_last_n, sampling.repeat_penalty,
        sampling.frequency_penalty, sampling.presence_penalty))
    c = engine.candidates
    prompt, row = engine.prefill_one()
    batch = ctx.batch
    try:
        for step in range(40):
            c.load(ctx, row)
            ll.llama_sampler_apply(chain, c.ref)
            expected = c.scores.copy()
            got = c.raw_logits.copy()
            edits.apply(got)
            assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), step
            # A repeated token now and then, so a count reaches 2 and the window rolls.
            token = int(got.argmax()) if step % 3 else 13
            ll.llama_sampler_accept(chain, token)
            edits.accept(token)
            batch.clear()
            row = batch.add(token, len(prompt) + step, 0, True)
            ctx.decode()
        assert max(edits.counts.values()) >= 2
        assert len(edits.window) == min(40, sampling.repeat_last_n)
    finally:
        ll.llama_sampler_free(chain)


def test_a_rows_logits_view_is_llama_cpps_buffer_row_after_every_decode(
        engine: Engine) -> None:
    """`BatchContext.row_logits` reads what llama.cpp's own accessor points at, for each
    row of a batch, after each decode (the views it keeps by address are reused, never
    stale), and a row without logits is an error rather than a read of whatever is there."""
    model, ctx = engine.model, engine.ctx
    for seq in range(3):
        ctx.clear(seq)
    batch = ctx.batch
    batch.clear()
    rows = [batch.add_span(engine.prompts[seq], 0, seq, last_logits=True) for seq in range(3)]
    ctx.decode()
    pos = [len(engine.prompts[seq]) for seq in range(3)]
    seen: dict[int, np.ndarray] = {}
    for step in range(4):
        for seq, row in enumerate(rows):
            view = ctx.row_logits(row)
            ptr = ll.llama_get_logits_ith(ctx.ptr, row)
            expected = np.ctypeslib.as_array(ptr, shape=(model.n_vocab,))
            assert view.ctypes.data == ctypes.addressof(ptr.contents)
            assert np.array_equal(view, expected), (step, seq)
            seen.setdefault(view.ctypes.data, view)
            assert seen[view.ctypes.data] is view  # the same row's view, reused
        tokens = [int(ctx.row_logits(row).argmax()) for row in rows]
        batch.clear()
        rows = [batch.add(tokens[seq], pos[seq] + step, seq, True) for seq in range(3)]
        ctx.decode()
    with pytest.raises(EdgeAgentError):
        ctx.row_logits(len(rows) + 5)


def test_a_rows_top_candidates_are_a_few_hundred_holding_its_k_highest(
        engine: Engine) -> None:
    """On the model's own logits, step after step: `load_top` keeps every token at or above
    the k-th highest logit, in vocabulary order, and only a small share of the vocabulary
    (else it would cost what it saves)."""
    model, ctx, c = engine.model, engine.ctx, engine.candidates
    prompt, row = engine.prefill_one()
    batch = ctx.batch
    sizes = []
    for step in range(24):
        logits = ctx.row_logits(row)
        for k in (1, 40, 128):
            assert c.load_top(logits, k)
            ids = c.ids[: c.array.size].copy()
            kth = np.sort(logits)[-k]
            assert np.array_equal(ids, np.sort(ids))
            assert set(np.flatnonzero(logits >= kth)) <= set(ids.tolist()), (step, k)
            assert np.array_equal(c.scores[: c.array.size], logits[ids])
            sizes.append(len(ids))
        token = int(logits.argmax())
        batch.clear()
        row = batch.add(token, len(prompt) + step, 0, True)
        ctx.decode()
    assert max(sizes) < model.n_vocab // 8


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.sampled_from([-np.inf, -3.0, -1.0, 0.0, 0.5, 2.0, 7.0, np.inf,
                                        np.nan]), min_size=1, max_size=600),
       k=st.integers(1, 140))
def test_the_top_candidates_hold_whatever_the_whole_rows_top_k_keeps(
        values: list[float], k: int) -> None:
    """Ties, infinities and NaNs: where `load_top` answers, its candidates are in
    vocabulary order with their logits, hold every token at or above the row's k-th
    highest logit, and llama.cpp's top-k keeps the same logits from them as from the whole
    row. (Declining is always safe: the whole row then goes to llama.cpp.)"""
    logits = np.array(values, dtype=np.float32)
    c = Candidates(len(logits))
    if not c.load_top(logits, k):
        return
    m = c.array.size
    ids = c.ids[:m].copy()
    assert np.all(np.diff(ids) > 0)
    assert np.array_equal(c.scores[:m], logits[ids], equal_nan=True)
    finite = logits[~np.isnan(logits)]
    kth = np.sort(finite)[-k]
    assert set(np.flatnonzero(logits >= kth).tolist()) <= set(ids.tolist())
    if np.isnan(logits).any():
        return  # llama.cpp's sort has no order for a NaN
    top_k = ll.llama_sampler_init_top_k(k)
    try:
        ll.llama_sampler_apply(top_k, c.ref)
        kept = np.sort(c.scores[: c.array.size])
        whole = Candidates(len(logits))
        whole.data["id"] = np.arange(len(logits))
        whole.scores[:] = logits
        ll.llama_sampler_apply(top_k, whole.ref)
        assert np.array_equal(kept, np.sort(whole.scores[: whole.array.size]))
    finally:
        ll.llama_sampler_free(top_k)


def test_every_refusal_path_chooses_the_same_greedy_token(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Next-best checks, the prefix forest, llama.cpp's whole-vocabulary filter: each alone
    gives the same answer."""
    grammar = _grammars()["order"]
    greedy = SamplingParams(temperature=0.0)

    def run(**kw: Any) -> list[list[int]]:
        samplers = [engine.sampler(greedy, grammar, **kw) for _ in range(3)]
        try:
            return engine.run(samplers, steps=60)
        finally:
            for s in samplers:
                s.close()

    retries = run(prefixes=engine.prefixes)
    monkeypatch.setattr(sampler_module, "GREEDY_RETRIES", 0)
    forest = run(prefixes=engine.prefixes)
    whole = run()
    assert retries == forest == whole


def _full_filter(grammar: ctypes.c_void_p, n_vocab: int) -> np.ndarray:
    data = np.zeros(n_vocab, dtype=[("id", np.int32), ("logit", np.float32),
                                    ("p", np.float32)])
    data["id"] = np.arange(n_vocab)
    arr = ll.llama_token_data_array(
        data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), size=n_vocab,
        selected=-1, sorted=False)
    ll.llama_sampler_apply(grammar, ctypes.byref(arr))
    return np.flatnonzero(data["logit"] != -np.inf)


@pytest.mark.parametrize(("kind", "temperature"), [
    ("order", 0.0), ("tools", 0.0), ("note", 1.3), ("tools", 1.3)])
def test_the_prefix_forest_allows_exactly_what_the_whole_vocabulary_filter_allows(
        engine: Engine, kind: str, temperature: float) -> None:
    grammar = _grammars()[kind]
    compared = [0]

    def compare(samplers: list[Sampler], live: list[bool]) -> None:
        for s, on in zip(samplers, live, strict=True):
            assert s.tail is not None and s.grammar is not None
            if on and s.tail.clean:
                found = engine.prefixes.allowed(s.grammar)
                assert found is not None
                assert np.array_equal(np.sort(found), _full_filter(s.grammar,
                                                                   engine.model.n_vocab))
                compared[0] += 1

    samplers = [engine.sampler(SamplingParams(temperature=temperature, seed=7 + i), grammar,
                               prefixes=engine.prefixes) for i in range(3)]
    out = engine.run(samplers, steps=40, each_step=compare)
    assert compared[0] >= 40
    schema = {"order": ORDER, "note": NOTE, "tools": tool_call_schema(TOOLS, "auto")}[kind]
    for tokens, s in zip(out, samplers, strict=True):
        if len(tokens) < 40:  # finished: the whole answer is valid
            jsonschema.validate(json.loads(engine.text(tokens)), schema)
        s.close()


def test_sampled_outputs_stay_valid(engine: Engine) -> None:
    """Hot sampling over the whole vocabulary refuses often; every finished answer is valid
    (a long run of the grammar's optional whitespace may use up the steps)."""
    grammar = _grammars()["note"]
    finished = 0
    for seed in range(3):
        samplers = [engine.sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0,
                                                  min_p=0.0, seed=seed * 3 + i), grammar,
                                   prefixes=engine.prefixes) for i in range(3)]
        out = engine.run(samplers, steps=300)
        for tokens, s in zip(out, samplers, strict=True):
            assert s.refusals > 0
            if len(tokens) < 300:
                jsonschema.validate(json.loads(engine.text(tokens)), NOTE)
                finished += 1
            s.close()
    assert finished >= 6


def test_a_grammar_is_parsed_once_and_each_sampler_gets_its_own_copy(
        engine: Engine) -> None:
    grammars = ParsedGrammars(engine.model.vocab, capacity=2)
    try:
        g = _grammars()
        first = grammars.sampler(g["order"])
        second = grammars.sampler(g["order"])
        assert grammars.parses == 1
        brace = engine.model.tokenize("{", add_special=False, parse_special=False)[0]
        ll.llama_sampler_accept(first, brace)  # one copy moves on, the other does not
        assert len(_full_filter(first, engine.model.n_vocab)) != len(
            _full_filter(second, engine.model.n_vocab))
        for kind in ("note", "tools", "order"):  # capacity 2: "order" was evicted
            ll.llama_sampler_free(grammars.sampler(g[kind]))
        assert grammars.parses == 4
        ll.llama_sampler_free(first)
        ll.llama_sampler_free(second)
    finally:
        grammars.close()


# -- the UTF-8 decoder the forest is built with: llama.cpp's, byte for byte ----------------

@pytest.mark.parametrize(("data", "state", "expected"), [
    (b"abc", (0, 0), ((97, 98, 99), 0)),
    ("é日🎉".encode(), (0, 0), ((0xE9, 0x65E5, 0x1F389), 0)),
    (b"a\xe6\x97", (0, 0), ((97,), 1)),  # ends one byte short of a character
    (b"\xa5x", (0x197, 1), ((0x65E5, 120), 0)),  # completes the previous token's character
    (b"\x80", (0, 0), ((), -1)),  # a continuation byte first: invalid
    (b"xy", (0x19, 1), ((), -1)),  # a character left unfinished: invalid
    (b"ab\x00cd", (0, 0), ((97, 98), 0)),  # a C string ends at the NUL
])
def test_decode_utf8_follows_llama_cpp(data: bytes, state: tuple[int, int],
                                       expected: tuple[tuple[int, ...], int]) -> None:
    points, _, n_remain = decode_utf8(data, *state)
    assert (points, n_remain) == expected


def test_a_tail_is_clean_only_at_a_character_boundary() -> None:
    pieces = {1: b"ok", 2: b"\xf0\x9f", 3: b"\x8e", 4: b"\x89!"}
    tail = Utf8Tail(pieces.__getitem__)
    tail.accept(1, True)
    assert tail.clean
    tail.accept(2, False)
    assert not tail.clean
    tail.accept(3, False)
    assert not tail.clean
    tail.accept(4, False)  # 🎉 completed, then "!"
    assert tail.clean


def test_the_forest_checks_children_only_under_allowed_parents() -> None:
    pieces = [b"a", b"ab", b"abc", b"b", b"ba", b"\xe6", b"", b"ab"]
    forest = TokenPrefixes(pieces, [False] * len(pieces))
    assert sorted(forest.roots.tolist()) == [0, 3, 5]  # "a", "b", the lone byte
    assert sorted(forest._children_of(np.array([0], dtype=np.int32)).tolist()) == [1]
    assert sorted(forest._children_of(np.array([1], dtype=np.int32)).tolist()) == [2, 7]


def test_greedy_takes_the_first_highest_logit_and_a_nan_as_llama_cpp_does() -> None:
    """llama.cpp's loop keeps index 0 and moves only to a strictly greater logit: the first
    of equal maxima wins, and a NaN is taken only where it starts, at index 0."""
    f32 = np.float32
    assert greedy(np.array([0, 2, 2], f32)) == 1
    assert greedy(np.array([1, np.nan, 3, 3], f32)) == 2
    assert greedy(np.array([np.nan, 5, 3], f32)) == 0
    assert greedy(np.array([-np.inf, -np.inf], f32)) == 0
    assert greedy(np.array([1, np.inf, np.inf], f32)) == 1


_LOGIT = st.one_of(st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan, 3.0, -3.0]),
                   st.floats(-30, 30, width=32))


@settings(max_examples=400, deadline=None)
@given(logits=st.lists(_LOGIT, min_size=2, max_size=12),
       window=st.lists(st.integers(0, 11), max_size=8),
       repeat=st.sampled_from([1.0, 1.1, 1.3, 0.8, 5e-324, 1e39]),
       frequency=st.sampled_from([0.0, 0.5, -0.4, 3e38]),
       presence=st.sampled_from([0.0, 0.3, -1.0]),
       bias=st.lists(st.tuples(st.integers(0, 11), st.sampled_from([-100.0, 2.5, 100.0])),
                     max_size=3))
@example(logits=[0.0, 1.0], window=[0], repeat=1e39, frequency=0.0, presence=0.0, bias=[])
def test_a_greedy_choice_skips_the_penalties_only_where_they_cannot_change_it(
        logits: list[float], window: list[int], repeat: float, frequency: float,
        presence: float, bias: list[tuple[int, float]]) -> None:
    """`Sampler.sample`'s greedy path writes the penalties only when `may_change` says they
    can change the choice: whatever the logits (NaN, inf, ties, 0), the window and the
    penalties (lowering, raising, absurdly large), the token is the one the whole edit
    gives."""
    row = np.array(logits, dtype=np.float32)
    bias = [(t % len(row), b) for t, b in bias]
    edits = LogitEdits(SamplingParams(temperature=0.0, repeat_penalty=repeat,
                                      frequency_penalty=frequency, presence_penalty=presence,
                                      repeat_last_n=4, logit_bias=tuple(bias)))
    for token in window:
        edits.accept(token % len(row))
    whole = row.copy()
    edits.apply(whole)
    expected = greedy(whole)
    fast = row.copy()
    edits.apply_bias(fast)
    token = greedy(fast)
    if edits.may_change(token):
        edits.apply_penalties(fast)
        token = greedy(fast)
    assert token == expected
