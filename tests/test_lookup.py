"""Prompt lookup's draft: the tokens after the latest earlier occurrence of the last n-gram."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge_agent.engine.lookup import PromptLookup


def test_the_tokens_after_the_last_trigram_where_it_occurred_before() -> None:
    lookup = PromptLookup([5, 1, 2, 3, 40, 41, 42, 9, 9, 1, 2, 3])
    assert lookup.draft(3) == [40, 41, 42]
    assert lookup.draft(8) == [40, 41, 42, 9, 9, 1, 2, 3]  # up to the end of the sequence
    assert lookup.draft(0) == []


def test_the_latest_earlier_occurrence_wins() -> None:
    lookup = PromptLookup([1, 2, 3, 7, 1, 2, 3, 8, 0, 1, 2, 3])
    assert lookup.draft(1) == [8]


def test_a_shorter_ngram_when_the_longer_one_never_occurred() -> None:
    # (4, 2, 3) never occurred before the end; (2, 3) did, followed by 6.
    lookup = PromptLookup([2, 3, 6, 4, 2, 3])
    assert lookup.draft(2) == [6, 4]


def test_nothing_where_no_ngram_of_two_or_more_occurred() -> None:
    assert PromptLookup([1, 2, 3, 4, 5, 3]).draft(4) == []  # a single token is too weak
    assert PromptLookup([]).draft(4) == []
    assert PromptLookup([7]).draft(4) == []


def test_tokens_appended_while_decoding_are_searched_too() -> None:
    lookup = PromptLookup([10, 11])
    for token in [12, 13, 10, 11, 12, 99, 10]:
        lookup.append(token)
    assert len(lookup) == 9
    lookup.append(11)
    assert lookup.draft(3) == [12, 99, 10]
    lookup.extend(list(range(500)))  # past the first buffer
    assert len(lookup) == 510
    assert lookup.draft(2) == []


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, 10))
def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_tail(
        tokens: list[int], n_max: int) -> None:
    draft = PromptLookup(tokens).draft(n_max)
    assert len(draft) <= n_max
    if not draft:
        return
    n = len(tokens)
    matches = [(size, start) for size in (3, 2) if n > size
               for start in range(n - size)
               if tokens[start : start + size] == tokens[n - size :]
               and tokens[start + size : start + size + len(draft)] == draft]
    assert matches
