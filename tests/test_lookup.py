"""Prompt lookup's draft: the tokens after the latest earlier occurrence of the last n-gram."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge_agent.engine.scheduling.prompt_lookup import PromptLookup


def test_the_tokens_after_the_last_ngram_where_it_occurred_before() -> None:
    lookup = PromptLookup([5, 1, 2, 3, 40, 41, 42, 9, 9, 1, 2, 3])
    assert lookup.draft(3) == [40, 41, 42]
    assert lookup.draft(8) == [40, 41, 42, 9, 9, 1, 2, 3]  # up to the end of the sequence
    assert lookup.draft(0) == []


def test_the_latest_earlier_occurrence_wins() -> None:
    lookup = PromptLookup([1, 2, 3, 7, 1, 2, 3, 8, 0, 1, 2, 3])
    assert lookup.draft(1) == [8]


def test_the_longest_ngram_that_occurred_wins_over_a_later_shorter_one() -> None:
    # The last 6 tokens (1..6) occurred at the start, followed by 70; their last 3 (4, 5, 6)
    # occurred later too, followed by 80: the 6-gram's continuation is the guess.
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 70, 9, 4, 5, 6, 80, 1, 2, 3, 4, 5, 6])
    assert lookup.draft(1) == [70]


def test_a_shorter_ngram_when_the_longer_one_never_occurred() -> None:
    # (4, 2, 3, 5) never occurred before the end; (2, 3, 5) did, followed by 6.
    lookup = PromptLookup([2, 3, 5, 6, 4, 2, 3, 5])
    assert lookup.draft(2) == [6, 4]


def test_nothing_where_no_ngram_of_three_or_more_occurred() -> None:
    # (3, 4) occurred before, but 2 tokens are too weak a match: often a common phrase
    # the model then paraphrases.
    assert PromptLookup([1, 3, 4, 5, 2, 3, 4]).draft(4) == []
    assert PromptLookup([1, 2, 3, 4, 5, 3]).draft(4) == []
    assert PromptLookup([]).draft(4) == []
    assert PromptLookup([7]).draft(4) == []


def test_tokens_appended_while_decoding_are_searched_too() -> None:
    lookup = PromptLookup([10, 11])
    for token in [12, 13, 10, 11, 12, 99, 10]:
        lookup.append(token)
    assert len(lookup) == 9
    lookup.append(11)
    lookup.append(12)
    assert lookup.draft(3) == [99, 10, 11]  # (10, 11, 12) occurred at 4, followed by 99
    lookup.extend(list(range(500)))  # past the first buffer
    assert len(lookup) == 511
    assert lookup.draft(2) == []


@given(st.lists(st.integers(0, 3), max_size=60), st.integers(0, 10))
def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_tail(
        tokens: list[int], n_max: int) -> None:
    lookup = PromptLookup(tokens)
    draft = lookup.draft(n_max)
    assert len(draft) <= n_max
    n = len(tokens)
    occurred = [(size, start) for size in range(lookup.ngram_max, lookup.ngram_min - 1, -1)
                if n > size for start in range(n - size)
                if tokens[start : start + size] == tokens[n - size :]]
    if not draft:
        assert n_max == 0 or not occurred
        return
    size = occurred[0][0]  # the longest n-gram that occurred
    start = max(s for z, s in occurred if z == size)  # its latest occurrence
    assert draft == tokens[start + size : start + size + n_max]
