from __future__ import annotations

from edge_agent.engine.text.textstream import TextStream


def test_multibyte_characters_split_across_tokens_come_out_whole() -> None:
    data = "日本語 😀 ok".encode()
    stream = TextStream([])
    out = "".join(stream.feed(data[i : i + 1]) for i in range(len(data))) + stream.finish()
    assert out == "日本語 😀 ok"
    # Nothing is released while a character is incomplete.
    stream = TextStream([])
    assert stream.feed("😀".encode()[:2]) == ""
    assert stream.feed("😀".encode()[2:]) == "😀"


def test_stop_string_spanning_tokens_is_cut_and_not_emitted() -> None:
    stream = TextStream(["END"])
    assert stream.feed(b"hello E") == "hello "
    assert stream.feed(b"N") == ""
    assert stream.feed(b"D and more") == ""
    assert stream.stopped
    assert stream.finish() == ""


def test_held_prefix_of_a_stop_is_released_when_it_turns_out_not_to_be_one() -> None:
    stream = TextStream(["\n\nUser:"])
    assert stream.feed(b"a\n") == "a"
    assert stream.feed(b"\nB") == "\n\nB"
    assert stream.feed(b"x\n") == "x"
    assert stream.finish() == "\n"
    assert not stream.stopped


def test_earliest_of_several_stops_wins() -> None:
    stream = TextStream(["cd", "b"])
    assert stream.feed(b"abcd") == "a"
    assert stream.stopped


def test_a_character_cut_by_the_token_limit_is_dropped_not_replaced() -> None:
    stream = TextStream([])
    assert stream.feed("ok 😀".encode()[:-2]) == "ok "
    assert stream.finish() == ""
