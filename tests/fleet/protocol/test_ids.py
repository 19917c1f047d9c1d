"""Ids and topics: what may become a topic level and a broker user name."""

from __future__ import annotations

import pytest

from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.ids import check_id


@pytest.mark.parametrize("value", ["store-042", "A_b-9", "x" * 64, "0"])
def test_plain_ids_pass(value: str) -> None:
    assert check_id("device", value) == value


@pytest.mark.parametrize(("value", "why"), [
    ("", "empty"), ("storeB/x", "'/'"), ("a+b", "'+'"), ("a#", "'#'"), ("a b", "' '"),
    ("x" * 65, "at most 64"), ("caf\u00e9", "letters"), ("all", "reserved"),
])
def test_ids_that_would_break_the_acl_are_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match="device id") as info:
        check_id("device", value)
    assert why in str(info.value)


def test_all_is_a_fleet_id_but_not_a_device_id() -> None:
    assert check_id("fleet", "all") == "all"


def test_topics_round_trip() -> None:
    name = topics.topic("f1", "store-042", "cmd/result")
    assert name == "edge/v1/f1/store-042/cmd/result"
    assert topics.parse(name) == topics.Topic("f1", "store-042", "cmd/result")
    assert topics.parse("edge/v1/f1/all/cmd").device == "all"


@pytest.mark.parametrize("name", [
    "edge/v1/f1/store/unknown", "edge/v2/f1/store/metrics", "edge/v1/f1/all/metrics",
    "edge/v1/f1/st+re/metrics", "edge/v1/f1", "x/v1/f1/d/metrics",
])
def test_anything_else_is_not_a_link_topic(name: str) -> None:
    with pytest.raises(ValueError):
        topics.parse(name)


def test_a_device_subscribes_to_its_commands_acks_and_the_fleets_commands() -> None:
    assert topics.device_filter("f1", "d1") == [
        "edge/v1/f1/d1/cmd", "edge/v1/f1/d1/ack", "edge/v1/f1/all/cmd"]
