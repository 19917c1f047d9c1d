"""One sequence's next token: a llama.cpp sampler chain, and its grammar checked after it.

A grammar sampler placed in the chain filters the whole vocabulary at every step: each of
the 49,152 tokens of the default model is decoded and run against the grammar's stacks
(4-12 ms a step on a 2-core box, where the decode step itself takes 5-10 ms). So, as
llama.cpp's own `common_sampler` does, a constrained sequence is sampled with the chain
alone, and only the chosen token is checked against the grammar (a one-candidate
`llama_token_data_array` through `llama_sampler_apply`: a logit of -inf is a refusal). Most
steps end there. When the grammar refuses the token:

- greedy: the next best tokens are checked one at a time (~0.01 ms each; the chain's
  scores, logit bias and penalties applied, stay in the candidate array), up to
  `GREEDY_RETRIES`; the token found is the one a grammar-first chain chooses, tie-breaks
  included: the first token in vocabulary order holding the highest score the grammar
  allows;
- otherwise (and when sampling): the tokens the grammar allows are found through the
  vocabulary's prefix forest (`token_prefixes`: ~0.5 ms where a JSON grammar expects a
  key, instead of 4-12 ms), every other token's logit is set to -inf, and the chain runs
  again on exactly the array a whole-vocabulary filter would have left. Where the forest
  cannot help (a state that allows most tokens, the middle of a UTF-8 sequence, the forest
  still being built), llama.cpp filters the whole vocabulary.

Greedy output is therefore the grammar-first chain's, token for token; sampled output
follows llama.cpp's rule (sample, check, resample from the filtered vocabulary on a
refusal), whose distribution is not the grammar-first one either.

The final token is then accepted once into the grammar and once into the chain; never at
sampling time (`llama_sampler_sample` would accept it there, and a token the grammar refused
must not reach, say, the repetition penalty's history). Sequences without a grammar have
their logit bias and penalties written into the row's logits first (`logit_edits`: only
the tokens they name, not the whole vocabulary), then are sampled by the rest of the chain
or, greedy, by numpy's argmax over the row (llama.cpp's greedy sampler copies the
vocabulary first): about 0.03 ms a token where the whole chain took 0.3 (smollm2,
repeat_penalty 1.1, a 2-core box). A chain that starts with top-k (k up to 128; 40 by
default) gets only the row's top candidates, a few hundred tokens that hold the k highest
(`Candidates.load_top`), where `llama_sampler_sample` would fill and sort the whole
vocabulary: the same k tokens in the same order, so the same token for the same seed, but
where two of the k highest logits are exactly equal (their order can differ). Other chains
get the whole row through `llama_sampler_sample`.

`Candidates` is the one candidate array of a worker thread: its sequences sample one after
another, so they share it, and nothing is allocated per token beyond what ctypes and numpy
return. Everything here runs on the scheduler's worker thread.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import llama_cpp as ll
import numpy as np

from edge_agent.engine.constrained.closing import ClosingTokens, JsonLexer
from edge_agent.engine.constrained.grammar_cache import ParsedGrammars
from edge_agent.engine.constrained.grammar_check import CheckedGrammar
from edge_agent.engine.constrained.logit_edits import LogitEdits
from edge_agent.engine.constrained.token_prefixes import TokenPrefixes, Utf8Tail
from edge_agent.engine.request import SamplingParams
from edge_agent.engine.runtime.llama import BatchContext, LlamaModel
from edge_agent.errors import EdgeAgentError

# Refused greedy choices checked one by one before the allowed tokens are looked for: a
# check costs ~0.01 ms, the forest's walk 0.1-0.5 ms (smollm2's vocabulary, a 2-core box).
GREEDY_RETRIES = 8
# A sampled row's top-k candidates (`Candidates.load_top`): the floor is the k-th highest of
# every TOP_STRIDE-th logit; above MAX_TOP_K llama.cpp's top-k sorts by buckets, and the
# whole vocabulary goes to it as before.
TOP_STRIDE = 16
MAX_TOP_K = 128

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)
_NEG_INF = -math.inf


class Candidates:
    """A `llama_token_data_array` over the whole vocabulary in preallocated numpy memory,
    refilled from a batch row's logits, plus a one-entry array for checking one token."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._fresh = np.zeros(n_vocab, dtype=_TOKEN_DATA)  # ids in order, p = 0
        self._fresh["id"] = np.arange(n_vocab, dtype=np.int32)
        self.ids = self.data["id"]
        self.scores = self.data["logit"]  # a strided view: what the samplers made of logits
        self._p = self.data["p"]
        self._logits = np.zeros(n_vocab, dtype=np.float32)
        self.retry = np.zeros(n_vocab, dtype=np.float32)  # greedy retries' scores
        self._addr = self.data.ctypes.data
        self._fresh_addr = self._fresh.ctypes.data
        self._bytes = self.data.nbytes
        self.array = ll.llama_token_data_array(
            data=ctypes.cast(self._addr, ctypes.POINTER(ll.llama_token_data)),
            size=n_vocab, selected=-1, sorted=False)
        self.ref = ctypes.pointer(self.array)
        self.one = ll.llama_token_data(0, 0.0, 0.0)
        self.one_array = ll.llama_token_data_array(
            data=ctypes.pointer(self.one), size=1, selected=-1, sorted=False)
        self.one_ref = ctypes.pointer(self.one_array)

    def load(self, ctx: BatchContext, row: int) -> None:
        """Every token with the logit of batch row `row`, in vocabulary order (what
        `llama_sampler_sample` builds before it applies the chain)."""
        np.copyto(self._logits, ctx.row_logits(row))
        ctypes.memmove(self._addr, self._fresh_addr, self._bytes)  # the chain may reorder
        self.scores[:] = self._logits
        self._fresh_array(self.n_vocab)

    def load_top(self, logits: np.ndarray, k: int) -> bool:
        """Every token that can be among the `k` highest of `logits`, in vocabulary order,
        and no other but a few hundred below them: those at or above a floor, the k-th
        highest of every TOP_STRIDE-th logit (k tokens of that sample are at or above it,
        so the row's k-th highest is too). A chain that starts with top-k then keeps the
        same k tokens as from the whole vocabulary, sorted the same way but for exactly
        equal logits, for ~0.05 ms where filling and sorting all 49,152 took ~0.1. False
        where no floor was found (a NaN in the sample): the whole row must go."""
        sample = logits[::TOP_STRIDE]
        n = sample.size
        if not 0 < k <= n:
            return False
        floor = np.partition(sample, n - k)[n - k]
        ids = np.flatnonzero(logits >= floor)
        m = ids.size
        if m < k:  # a NaN floor: nothing compares at or above it
            return False
        self.ids[:m] = ids
        self.scores[:m] = logits[ids]
        self._p[:m] = 0.0
        self._fresh_array(m)
        return True

    def _fresh_array(self, size: int) -> None:
        """The array over its first `size` entries, unsorted, nothing selected yet."""
        self.array.size = size
        self.array.selected = -1
        self.array.sorted = False

    @property
    def raw_logits(self) -> np.ndarray:
        """After `load`: the row's logits in vocabulary order, before any sampler."""
        return self._logits

    def keep_only(self, allowed: np.ndarray) -> None:
        """After `load`: every token but `allowed` at -inf (what the grammar's filter of the
        whole vocabulary leaves)."""
        self.scores[:] = _NEG_INF
        self.scores[allowed] = self._logits[allowed]

    def selected(self) -> int:
        return int(self.ids[self.array.selected])


@dataclass
class Sampler:
    """A llama.cpp sampler chain for one request: its own seed, penalties and grammar.

    `grammar_first` builds the chain the way it was before the check-after-sampling rule,
    with the grammar inside it filtering the vocabulary at every step (llama.cpp's
    `grammar_first`), and without a grammar with the bias and penalties inside it too:
    the reference the default path is held to, kept for those tests."""

    ptr: ctypes.c_void_p  # the chain
    grammar: ctypes.c_void_p | None = None  # checked after the chain (None: none, or inside)
    candidates: Candidates | None = None
    prefixes: TokenPrefixes | None = None
    tail: Utf8Tail | None = None
    greedy: bool = False
    refusals: int = 0  # chosen tokens the grammar refused
    filtered: int = 0  # of them, those that took llama.cpp's whole-vocabulary filter
    # Closing a JSON answer within its budget (`closing`): the vocabulary's closing tokens,
    # where the text is, whether the budget's last tokens have begun, and how many tokens
    # were chosen for closing.
    closers: ClosingTokens | None = None
    lexer: JsonLexer | None = None
    closed_tokens: int = 0
    # Without a grammar: the bias and penalties, written into the row's logits before the
    # chain (which then holds neither) or numpy's argmax (greedy) samples them.
    edits: LogitEdits | None = None
    # Without a grammar, sampled, the chain starting with top-k (1..MAX_TOP_K): its k, and
    # the chain gets the row's top candidates only (`Candidates.load_top`). 0: the whole row.
    top_k: int = 0

    @property
    def closing(self) -> bool:
        return self.lexer is not None

    def start_closing(self, closers: ClosingTokens, completion: list[int]) -> None:
        """From the next token on, close the answer (`constrained.closing`): `completion` is
        what the sequence wrote so far, read once to know whether it ends in a string."""
        if self.grammar is None:
            return
        lexer = JsonLexer()
        for token in completion:
            lexer.feed(closers.pieces[token])
        self.closers, self.lexer = closers, lexer

    @classmethod
    def build(cls, model: LlamaModel, params: SamplingParams, grammar: str | None, *,
              candidates: Candidates | None = None, grammars: ParsedGrammars | None = None,
              prefixes: TokenPrefixes | None = None, grammar_first: bool = False) -> Sampler:
        """`candidates`, `grammars` and `prefixes` are the worker's, shared by its sequences
        (the first two made here when not given; without `prefixes` a refusal filters the
        whole vocabulary)."""
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        sampler = cls(chain, greedy=params.temperature <= 0)
        try:
            g = None
            if grammar is not None:
                # llama.cpp kills the process on a grammar it cannot follow: only text that
                # grammar_check has shown to its parser (in a child process) gets this far.
                if not isinstance(grammar, CheckedGrammar):
                    raise EdgeAgentError("a grammar reached the sampler unchecked")
                g = grammars.sampler(grammar) if grammars is not None \
                    else ParsedGrammars.parse(model.vocab, grammar)
            if grammar_first:
                _add_chain(chain, model, params, g)
            elif g is None:
                sampler.edits = LogitEdits(params)
                _add_chain(chain, model, params, None, edits_apart=True)
                if params.temperature > 0 and 0 < params.top_k <= MAX_TOP_K:
                    sampler.top_k = params.top_k
                    sampler.candidates = candidates or Candidates(model.n_vocab)
            else:
                sampler.grammar = g
                sampler.candidates = candidates or Candidates(model.n_vocab)
                if prefixes is not None:
                    sampler.prefixes, sampler.tail = prefixes, Utf8Tail(model.grammar_piece)
                _add_chain(chain, model, params, None)
            return sampler
        except BaseException:
            sampler.close()
            raise

    def sample(self, ctx: BatchContext, row: int) -> int:
        """The next token from batch row `row`'s logits, accepted into the grammar and the
        chain (once each)."""
        if self.grammar is None:
            edits = self.edits
            if edits is None:  # the whole chain in llama.cpp (the reference build)
                return int(ll.llama_sampler_sample(self.ptr, ctx.ptr, row))
            if self.greedy:
                # llama.cpp's greedy sampler, without its copy of the vocabulary: the first
                # of the highest logits, as numpy's argmax takes it.
                logits = ctx.row_logits(row)
                if edits.bias:
                    edits.apply_bias(logits)
                token = greedy(logits)
                if edits.may_change(token):
                    edits.apply_penalties(logits)
                    token = greedy(logits)
            elif self.top_k:
                logits = ctx.row_logits(row)
                if edits.active:
                    edits.apply(logits)
                token = self._sample_top(ctx, row, logits)
            else:
                if edits.active:
                    edits.apply(ctx.row_logits(row))
                # Samples the edited logits; accepts the token into the chain.
                token = int(ll.llama_sampler_sample(self.ptr, ctx.ptr, row))
            edits.accept(token)
            return token
        c = self.candidates
        assert c is not None
        c.load(ctx, row)
        ll.llama_sampler_apply(self.ptr, c.ref)
        token = c.selected()
        if not self._allows(token):
            self.refusals += 1
            found = self._next_best(token) if self.greedy else None
            token = self._filtered(ctx, row) if found is None else found
        if self.lexer is not None and self.closers is not None \
                and not self.closers.closes(token, self.lexer):
            # The model's own choice goes on writing: end what is open instead, where the
            # grammar allows it here.
            found = self.closers.best(self.grammar, self.lexer, c.raw_logits)
            if found is not None:
                token = found
                self.closed_tokens += 1
        ll.llama_sampler_accept(self.grammar, token)
        ll.llama_sampler_accept(self.ptr, token)
        if self.tail is not None and self.prefixes is not None:
            self.tail.accept(token, bool(self.prefixes.clean_end[token]))
        if self.lexer is not None and self.closers is not None:
            self.lexer.feed(self.closers.pieces[token])
        return token

    def _sample_top(self, ctx: BatchContext, row: int, logits: np.ndarray) -> int:
        """The chain on the row's top candidates (`Candidates.load_top`), the token
        accepted into it, as `llama_sampler_sample` does on the whole row (which it falls
        back to where no floor was found)."""
        c = self.candidates
        assert c is not None
        if not c.load_top(logits, self.top_k):
            return int(ll.llama_sampler_sample(self.ptr, ctx.ptr, row))
        ll.llama_sampler_apply(self.ptr, c.ref)
        if not 0 <= c.array.selected < c.array.size:
            raise EdgeAgentError("the sampler chain chose no token")
        token = c.selected()
        ll.llama_sampler_accept(self.ptr, token)
        return token

    def _allows(self, token: int) -> bool:
        """Whether the grammar, in its current state, accepts `token` next."""
        c = self.candidates
        assert c is not None
        one, arr = c.one, c.one_array
        one.id, one.logit, one.p = token, 1.0, 0.0  # type: ignore[assignment]
        arr.size, arr.selected, arr.sorted = 1, -1, False
        ll.llama_sampler_apply(self.grammar, c.one_ref)
        return one.logit != _NEG_INF

    def _next_best(self, refused: int) -> int | None:
        """Greedy after a refusal: the best-scored token the grammar allows, found among
        the next GREEDY_RETRIES in score order (numpy's argmax, like llama.cpp's greedy
        sampler, takes the first of equal scores); None if none of them is allowed."""
        c = self.candidates
        assert c is not None
        scores = c.retry
        np.copyto(scores, c.scores)  # the chain left them in vocabulary order
        token = refused
        for _ in range(GREEDY_RETRIES):
            scores[token] = _NEG_INF
            token = int(scores.argmax())
            if scores[token] == _NEG_INF:
                return None
            if self._allows(token):
                return token
        return None

    def _filtered(self, ctx: BatchContext, row: int) -> int:
        """The chain again, on the vocabulary with every token the grammar refuses at -inf."""
        c, g = self.candidates, self.grammar
        assert c is not None and g is not None
        allowed = None
        if self.prefixes is not None and self.tail is not None and self.tail.clean:
            allowed = self.prefixes.allowed(g, budget=c.n_vocab // 8)
        c.load(ctx, row)
        if allowed is None:
            self.filtered += 1
            ll.llama_sampler_apply(g, c.ref)
        else:
            c.keep_only(allowed)
        ll.llama_sampler_apply(self.ptr, c.ref)
        chosen = c.array.selected
        if not 0 <= chosen < c.array.size or not math.isfinite(c.data["logit"][chosen]):
            # Accepting it would abort the process inside llama.cpp: end the request.
            raise EdgeAgentError("the grammar allows no token here")
        return c.selected()

    def close(self) -> None:
        if self.grammar:
            ll.llama_sampler_free(self.grammar)
            self.grammar = None
        if self.ptr:
            ll.llama_sampler_free(self.ptr)
            self.ptr = None  # type: ignore[assignment]


def greedy(logits: np.ndarray) -> int:
    """llama.cpp's greedy choice: the first of the highest logits. A NaN is never greater
    than anything there (nor anything than it), so it is chosen only at index 0, where the
    search starts; numpy's argmax would take the first NaN."""
    token = int(logits.argmax())
    if not math.isnan(logits[token]):
        return token
    return 0 if math.isnan(logits[0]) else int(np.nanargmax(logits))


def _add_chain(chain: ctypes.c_void_p, model: LlamaModel, params: SamplingParams,
               grammar: ctypes.c_void_p | None, *, edits_apart: bool = False) -> None:
    """The samplers of `params` into `chain`, in llama.cpp's order; the grammar (when given)
    after the logit bias, where a grammar-first chain has it. `edits_apart`: without the
    logit bias and the penalties, which `LogitEdits` applies to the row first."""
    add = lambda s: ll.llama_sampler_chain_add(chain, s)  # noqa: E731
    if params.logit_bias and not edits_apart:
        arr = (ll.llama_logit_bias * len(params.logit_bias))()
        for i, (tok, bias) in enumerate(params.logit_bias):
            arr[i] = ll.llama_logit_bias(tok, bias)
        add(ll.llama_sampler_init_logit_bias(model.n_vocab, len(arr), arr))
    if grammar is not None:
        add(grammar)  # the chain owns it from here
    if (params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty) \
            and not edits_apart:
        add(ll.llama_sampler_init_penalties(
            model.n_vocab, params.repeat_last_n, params.repeat_penalty,
            params.frequency_penalty, params.presence_penalty))
    if params.temperature <= 0:
        add(ll.llama_sampler_init_greedy())
        return
    if params.top_k > 0:
        add(ll.llama_sampler_init_top_k(params.top_k))
    if params.typical_p < 1.0:
        add(ll.llama_sampler_init_typical(params.typical_p, 1))
    if params.top_p < 1.0:
        add(ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(ll.llama_sampler_init_min_p(params.min_p, 1))
    add(ll.llama_sampler_init_temp(params.temperature))
    seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
    add(ll.llama_sampler_init_dist(seed))
