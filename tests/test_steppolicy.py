"""The scheduler's step policy, with plain numbers: no model, no threads, no clock.

Costs are chosen to be exact in binary (1/256 s a token, 0.125 s a rows pass), so each
expected budget is the one number the arithmetic gives."""

from __future__ import annotations

import dataclasses

import pytest

from edge_agent.engine.scheduling.stepcost import DEFAULT_TOKEN_S, PrefillCost
from edge_agent.engine.scheduling.steppolicy import (
    JOIN_COST_TOKENS,
    MIN_COPY_TOKENS,
    MIN_EMBED_CHUNK,
    MIN_PREFILL_CHUNK,
    SHORT_PROMPT,
    PerToken,
    Prompt,
    StepPolicy,
    common_prefix,
    copy_source,
    last_chunk,
    prefill_spans,
    shortest_short,
)

TOKEN = 1 / 256  # seconds a prompt token
STEP = 0.125  # seconds a rows pass, with nobody prefilling


def flat(depth: float) -> float:
    return TOKEN


def policy(stall: float = 3.0, chunk: int = 0, n_batch: int = 512, parallel: int = 4
           ) -> StepPolicy:
    return StepPolicy(max_step_stall=stall, prefill_chunk=chunk, n_batch=n_batch,
                      parallel=parallel)


class Priced:
    """A per-token cost that remembers the depths it was asked about."""

    def __init__(self, price: float = TOKEN, deep: float = float("inf"),
                 deep_price: float = TOKEN) -> None:
        self.price, self.deep, self.deep_price = price, deep, deep_price
        self.depths: list[float] = []

    def __call__(self, depth: float) -> float:
        self.depths.append(depth)
        return self.deep_price if depth >= self.deep else self.price


def budget(p: StepPolicy, *, rows: int = 4, shortest: int = 0, rows_s: float = STEP,
           depth: float = 0, decode_s: dict[int, float] | None = None,
           per_token: PerToken = flat) -> int:
    return p.prefill_budget(rows=rows, shortest=shortest, rows_s=rows_s, depth=depth,
                            decode_s={4: STEP} if decode_s is None else decode_s,
                            per_token=per_token)


def embed(p: StepPolicy, *, rows: int = 4, rows_s: float = STEP, prompt_s: float = 0.0625,
          depth: float = 0, per_token: PerToken = flat) -> tuple[int, float | None]:
    return p.embed_budget(rows=rows, rows_s=rows_s, prompt_s=prompt_s, depth=depth,
                          decode_s={4: STEP}, per_token=per_token)


def test_the_policy_is_a_frozen_set_of_knobs() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy().max_step_stall = 0  # type: ignore[misc]


# -- rows that may wait ----------------------------------------------------------------------
def test_rows_wait_while_the_prompt_fits_the_stall_bound_of_a_full_batch() -> None:
    p = policy(stall=4, parallel=4)
    decode_s = {1: 0.03125, 4: STEP}  # bound: 4 x the full batch = 0.5 s
    cost = 16 * TOKEN  # a 16-token prompt: 0.0625 s
    assert p.rows_may_wait(waited_s=0.5 - cost, prompt_tokens=16, decode_s=decode_s,
                           per_token=flat)
    assert not p.rows_may_wait(waited_s=0.5 - cost + 1e-9, prompt_tokens=16,
                               decode_s=decode_s, per_token=flat)
    # A longer prompt costs more of the same bound.
    assert not p.rows_may_wait(waited_s=0.5 - cost, prompt_tokens=17, decode_s=decode_s,
                               per_token=flat)
    # The full batch's own pass is the reference, even where a smaller one measured slower.
    assert not p.rows_may_wait(waited_s=0.5 - cost + 1e-9, prompt_tokens=16,
                               decode_s={**decode_s, 3: 0.25}, per_token=flat)


def test_rows_wait_measured_against_the_largest_pass_until_a_full_batch_ran() -> None:
    p = policy(stall=2, parallel=8)
    decode_s = {2: 0.0625, 3: STEP}  # no 8-row pass yet: 2 x 0.125 = 0.25 s
    assert p.rows_may_wait(waited_s=0.25 - 8 * TOKEN, prompt_tokens=8, decode_s=decode_s,
                           per_token=flat)
    assert not p.rows_may_wait(waited_s=0.25 - 7 * TOKEN, prompt_tokens=8,
                               decode_s=decode_s, per_token=flat)


def test_rows_wait_with_nothing_measured_assume_ten_ms_a_row() -> None:
    p = policy(stall=1, parallel=4)  # bound: 1 x 4 x 10 ms
    assert p.rows_may_wait(waited_s=0.0, prompt_tokens=1, decode_s={},
                           per_token=lambda d: 0.039)
    assert not p.rows_may_wait(waited_s=0.0, prompt_tokens=1, decode_s={},
                               per_token=lambda d: 0.041)


def test_rows_wait_prices_the_prompt_at_its_middle() -> None:
    priced = Priced()
    policy().rows_may_wait(waited_s=0.0, prompt_tokens=40, decode_s={4: STEP},
                           per_token=priced)
    assert priced.depths == [20]


def test_rows_never_wait_without_a_stall_bound_or_for_a_huge_prompt() -> None:
    assert not policy(stall=0).rows_may_wait(waited_s=0.0, prompt_tokens=1,
                                             decode_s={4: 100.0}, per_token=flat)
    assert not policy().rows_may_wait(waited_s=0.0, prompt_tokens=10**6, decode_s={4: STEP},
                                      per_token=flat)


# -- shortest prompt ------------------------------------------------------------------------
def test_shortest_counts_only_prompts_that_were_short_to_begin_with() -> None:
    assert shortest_short([]) == 0
    assert shortest_short([Prompt(0, 5, SHORT_PROMPT + 1, 0)]) == 0  # a long one's tail
    assert shortest_short([Prompt(0, 30, SHORT_PROMPT, 0)]) == 30
    assert shortest_short([Prompt(0, 30, SHORT_PROMPT, 0), Prompt(1, 12, 40, 0),
                           Prompt(2, 3, 400, 0)]) == 12


# -- the prefill budget ---------------------------------------------------------------------
def test_with_no_rows_one_whole_short_prompt_per_step_else_the_batch() -> None:
    p = policy()
    assert budget(p, rows=0, shortest=20) == 20
    assert budget(p, rows=0, shortest=SHORT_PROMPT) == SHORT_PROMPT
    assert budget(p, rows=0, shortest=SHORT_PROMPT + 1) == 512
    assert budget(p, rows=0, shortest=0) == 512


def test_budget_is_what_the_stall_bound_leaves_after_the_rows_pass() -> None:
    # 3 x 0.125 s - 0.125 s = 0.25 s, at 1/256 s a token: 64 tokens.
    assert budget(policy()) == 64
    # Tighter bound, less room: 2 x 0.125 - 0.125 = 32 tokens.
    assert budget(policy(stall=2)) == 32


def test_a_slowed_rows_pass_counts_against_the_budget() -> None:
    """The bound is against the pass measured with nobody prefilling; this step's slower
    pass is subtracted as it was."""
    assert budget(policy(), rows_s=0.25) == 32
    # No plain measurement for this row count: the pass itself is the reference.
    assert budget(policy(), rows=3, decode_s={4: 1.0}) == 64


def test_the_chunk_is_priced_again_at_its_middle() -> None:
    """64 tokens at the prompt's depth; then the same seconds priced 32 cells deeper."""
    cheap = Priced(deep=100, deep_price=2 * TOKEN)
    assert budget(policy(), depth=50, per_token=cheap) == 64
    assert cheap.depths == [50, 50 + 32]
    dear = Priced(deep=100, deep_price=2 * TOKEN)
    assert budget(policy(), depth=90, per_token=dear) == 32
    assert dear.depths == [90, 90 + 32]


def test_however_tight_the_bound_a_prompt_advances() -> None:
    p = policy()
    assert budget(p, rows_s=1.0) == MIN_PREFILL_CHUNK
    # A short prompt goes in whole …
    assert budget(p, rows_s=1.0, shortest=20) == 20
    # … a longer one by the least chunk.
    assert budget(p, rows_s=1.0, shortest=SHORT_PROMPT + 1) == MIN_PREFILL_CHUNK


def test_a_huge_depth_leaves_the_least_chunk() -> None:
    cost = PrefillCost()
    for depth in range(0, 1000, 20):
        cost.observe(20, depth, 20 * (0.003 + 0.000004 * depth))
    p = policy()
    shallow = budget(p, depth=0, per_token=cost.per_token)
    deep = budget(p, depth=1000, per_token=cost.per_token)
    assert shallow > deep > MIN_PREFILL_CHUNK
    assert budget(p, depth=10**9, per_token=cost.per_token) == MIN_PREFILL_CHUNK


def test_budget_capped_by_the_prefill_chunk_and_by_the_batch() -> None:
    assert budget(policy(chunk=16)) == 16
    assert budget(policy(chunk=100)) == 64
    assert budget(policy(n_batch=40)) == 36
    # The batch's room wins even over the least chunk: 3 rows of 10 leaves 7 < 8.
    assert budget(policy(n_batch=10), rows=3, rows_s=1.0) == 7 < MIN_PREFILL_CHUNK
    assert budget(policy(n_batch=4)) == 0


def test_without_a_stall_bound_only_the_chunk_and_the_batch_limit() -> None:
    assert budget(policy(stall=0)) == 508
    assert budget(policy(stall=0), rows_s=100.0) == 508
    assert budget(policy(stall=0, chunk=64)) == 64


# -- the last chunk of a long prompt --------------------------------------------------------
def test_last_chunk_leaves_room_for_the_row_it_adds() -> None:
    price = 0.005  # the row costs JOIN_COST_TOKENS = 2 tokens at any depth
    assert JOIN_COST_TOKENS == 2.0
    assert last_chunk(10, 12, 1000, lambda d: price) == 10
    assert last_chunk(10, 11, 1000, lambda d: price) == 9
    assert last_chunk(1, 1, 1000, lambda d: price) == 1  # never stalls a prompt outright
    assert last_chunk(2, 2, 1000, lambda d: price) == 1


def test_last_chunk_prices_the_row_at_the_prompt_end() -> None:
    """A row at 1,010 cells costs twice a token in the chunk's middle (1,005): four
    tokens' worth must fit beside the ten."""
    priced = Priced(deep=1008, deep_price=2 * TOKEN)
    assert last_chunk(10, 14, 1000, priced) == 10
    assert priced.depths == [1010, 1005]
    assert last_chunk(10, 13, 1000, Priced(deep=1008, deep_price=2 * TOKEN)) == 9
    # Shallow, the same chunk needs only two tokens' room.
    assert last_chunk(10, 12, 0, Priced(deep=1008, deep_price=2 * TOKEN)) == 10


# -- sharing the budget among prompts -------------------------------------------------------
def test_spans_go_shortest_first_and_ties_keep_their_order() -> None:
    prompts = [Prompt(0, 30, 30, 0), Prompt(1, 10, 10, 0), Prompt(2, 10, 10, 0)]
    spans = prefill_spans(prompts, 50, rows=False, per_token=flat)
    assert list(spans.items()) == [(1, 10), (2, 10), (0, 30)]


def test_a_short_prompt_goes_in_whole_or_waits_once_another_is_in() -> None:
    prompts = [Prompt(0, 5, 5, 0), Prompt(1, 30, 30, 0), Prompt(2, 100, 200, 0)]
    # The second short prompt does not fit whole: skipped; the long one takes the rest.
    assert prefill_spans(prompts, 20, rows=False, per_token=flat) == {0: 5, 2: 15}
    # Alone, a short prompt takes what there is.
    assert prefill_spans([Prompt(1, 30, 30, 0)], 20, rows=False, per_token=flat) == {1: 20}
    # Shortness is of the whole prompt: a long prompt's 10-token tail is cut like any.
    assert prefill_spans([Prompt(0, 5, 5, 0), Prompt(1, 10, 500, 0)], 8, rows=False,
                         per_token=flat) == {0: 5, 1: 3}


def test_a_long_prompt_ends_one_token_short_beside_rows_only() -> None:
    tail = [Prompt(3, 10, 500, 1000)]
    price = lambda d: 0.005  # noqa: E731
    assert prefill_spans(tail, 11, rows=True, per_token=price) == {3: 9}
    assert prefill_spans(tail, 11, rows=False, per_token=price) == {3: 10}
    assert prefill_spans(tail, 12, rows=True, per_token=price) == {3: 10}
    # A short prompt finishing beside rows is never held back.
    assert prefill_spans([Prompt(3, 10, 10, 1000)], 10, rows=True, per_token=price) == {3: 10}


def test_no_budget_no_spans() -> None:
    prompts = [Prompt(0, 5, 5, 0)]
    assert prefill_spans(prompts, 0, rows=False, per_token=flat) == {}
    assert prefill_spans(prompts, -3, rows=False, per_token=flat) == {}
    assert prefill_spans([], 64, rows=True, per_token=flat) == {}


# -- reusing cells --------------------------------------------------------------------------
def test_cells_are_copied_only_for_more_than_the_copy_threshold() -> None:
    assert MIN_COPY_TOKENS == 8
    assert copy_source(10, []) == (None, 10)
    assert copy_source(10, [10, 18]) == (None, 10)  # 8 more: recomputing is as cheap
    assert copy_source(10, [10, 18, 19]) == (2, 19)
    # Each later candidate must beat the best so far by as much.
    assert copy_source(0, [30, 35, 39]) == (2, 39)
    assert copy_source(0, [30, 38]) == (0, 30)


# -- embeddings -----------------------------------------------------------------------------
def test_embed_chunk_is_a_prompt_chunk_or_the_batch() -> None:
    assert policy(chunk=64).embed_chunk == 64
    assert policy(chunk=0, n_batch=256).embed_chunk == 256


def test_embed_budget_after_rows_and_prompt() -> None:
    # 3 x 0.125 - 0.125 - 0.0625 = 0.1875 s: 48 tokens.
    assert embed(policy()) == (48, 0.1875)
    assert embed(policy(chunk=32)) == (32, 0.1875)
    # Only prompts in the step: the least, and no time.
    assert embed(policy(), rows=0) == (MIN_EMBED_CHUNK, 0.0)
    # No stall bound: a whole chunk, with no time limit.
    assert embed(policy(stall=0, chunk=64)) == (64, None)


def test_embed_budget_is_priced_at_the_input_position() -> None:
    dear = Priced(deep=300, deep_price=2 * TOKEN)
    assert embed(policy(), depth=300, per_token=dear) == (24, 0.1875)
    assert dear.depths == [300, 300 + 12]


def test_embed_budget_with_no_time_left_still_advances() -> None:
    priced = Priced()
    assert embed(policy(), prompt_s=1.0, depth=300, per_token=priced) == (MIN_EMBED_CHUNK, 0.0)
    assert priced.depths == [300, 300]  # a negative allowance is not priced shallower


def test_the_default_prefill_cost_plugs_in() -> None:
    """The scheduler passes `PrefillCost.per_token`; before any measurement it prices
    every token at the default."""
    assert budget(policy(), per_token=PrefillCost().per_token) == int(0.25 / DEFAULT_TOKEN_S)


def test_the_common_prefix_stops_at_the_first_difference_or_the_limit() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 10) == 4  # one holds the other
    assert common_prefix([1, 2, 9, 4], [1, 2, 3, 4], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([], [1], 5) == 0
    assert common_prefix([1], [1], -1) == 0  # an empty prompt's limit
