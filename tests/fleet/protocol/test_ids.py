"""Ids, versions and topics: what may become a topic level, a broker user name or a
release's folder, one rule each wherever the value enters."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from edge_agent.errors import InvalidRequest
from edge_agent.fleet.controller.rollouts.operations import parse_ref as rollout_ref
from edge_agent.fleet.device.link.command_gate import command_args
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import StartArgs, lookup
from edge_agent.fleet.protocol.ids import (
    BOOT_ID,
    COMMAND_ID,
    ROLLOUT_ID,
    check_id,
    release_version,
)
from edge_agent.fleet.protocol.manifest import ManifestError, target_path
from edge_agent.fleet.protocol.manifest import parse_ref as manifest_ref
from edge_agent.fleet.protocol.refusals import CommandRefused


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


# -- a release's version: one rule wherever it is typed ---------------------------------------

VERSIONS = [("2", True), ("2.1-rc1", True), ("v3_q4", True), ("x" * 32, True),
            ("x" * 33, False), ("1+build7", False), (".2", False), ("-2", False),
            ("2/3", False), ("", False), ("caf\u00e9", False)]


def _accepted(check: Callable[[], object]) -> bool:
    try:
        check()
    except (ValueError, InvalidRequest, ManifestError, CommandRefused):
        return False
    return True


@pytest.mark.parametrize(("version", "ok"), VERSIONS)
def test_every_door_takes_the_versions_a_release_can_have(version: str, ok: bool) -> None:
    """The release's path (`fleet release add`), the desk's `rollout start NAME@VERSION`,
    the signed `rollout.start` the controller checks, the box's handler of it and
    `models pull NAME@VERSION` agree: a version no release can have is refused at each."""
    args = {"rollout_id": "r1", "name": "m:1", "version": version}
    now = time.time()
    command = Command("c" * 32, "f1", "store-1", "rollout.start", 1, now, now + 60, args,
                      "store-1", b"")
    doors = {
        "release path": lambda: target_path("m:1", version),
        "pull ref": lambda: manifest_ref(f"m:1@{version}"),
        "rollout ref": lambda: rollout_ref(f"m:1@{version}"),
        "command args": lambda: lookup("rollout.start").check_args(args),
        "box handler": lambda: command_args(command, StartArgs),
        "release_version": lambda: release_version(version),
    }
    assert {door: _accepted(check) for door, check in doors.items()} == dict.fromkeys(
        doors, ok)


def test_a_command_may_carry_the_version_as_a_whole_number() -> None:
    assert release_version(2) == "2"
    for bad in (True, -1, 2.0, 10**40):
        with pytest.raises(ValueError, match="whole number"):
            release_version(bad)


@pytest.mark.parametrize(("rule", "good", "bad"), [
    (ROLLOUT_ID, "ro-1a2b_c", "ro/1"), (COMMAND_ID, "c" * 64, "c" * 65),
    (BOOT_ID, "0123456789abcdef" * 2, "ABC"),
])
def test_the_other_ids(rule: re.Pattern[str], good: str, bad: str) -> None:
    assert rule.fullmatch(good) and not rule.fullmatch(bad)
