"""A tenant's data boundary on the way out (`gateway.egress`): personal data as placeholders,
the originals back in the answer, whatever chunks a stream arrives in."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.gateway.egress import Pseudonyms
from edge_agent.governance.redaction import Detectors

DETECTORS = Detectors(["US", "GB", "DE", "FR"], ["us", "fr"])
TEXT = ("Mail jane.doe@example.com or call +44 20 7946 0958; pay DE89370400440532013000. "
        "Again: jane.doe@example.com, and bob@example.org.")


def test_values_become_placeholders_the_same_value_the_same_one() -> None:
    names = Pseudonyms(DETECTORS)
    hidden = names.hide(TEXT)
    for value in ("jane.doe@example.com", "+44 20 7946 0958", "DE89370400440532013000",
                  "bob@example.org"):
        assert value not in hidden
    assert hidden.count("<EMAIL>") == 2 and "<EMAIL_2>" in hidden  # bob, the second one
    assert names.restore(hidden) == TEXT
    assert names.entities["EMAIL"] == 3
    # A placeholder the request never gave out is left as the model wrote it.
    assert names.restore("<EMAIL_9> <NAME>") == "<EMAIL_9> <NAME>"


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_a_streamed_answer_is_restored_whatever_its_chunks(cuts: list[int]) -> None:
    names = Pseudonyms(DETECTORS)
    answer = names.hide(TEXT) + " <EMA"  # ends inside something that looks like one
    bounds = sorted({0, len(answer), *(min(c, len(answer)) for c in cuts)})
    restorer = names.restorer()
    out = "".join(restorer.feed(answer[a:b]) for a, b in itertools.pairwise(bounds))
    out += restorer.flush()
    assert out == names.restore(answer) == TEXT + " <EMA"


def test_text_that_cannot_become_a_placeholder_is_not_held_back() -> None:
    names = Pseudonyms(DETECTORS)
    names.hide("jane.doe@example.com")
    restorer = names.restorer()
    assert restorer.feed("a < b and ") == "a < b and "
    assert restorer.feed("x <EM") == "x "  # could still become <EMAIL>
    assert restorer.feed("AIL>!") == "jane.doe@example.com!"
