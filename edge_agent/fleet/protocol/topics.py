"""The link's topics: `edge/v1/{fleet}/{device}/{kind}`, and `edge/v1/{fleet}/all/cmd`.

| kind | direction | retained | payload |
|---|---|---|---|
| status | device → controller | yes | birth / death (not through the outbox: it is state) |
| metrics | device → controller | no | outbox envelope, class `metrics` |
| ledger, events, cmd/result, rollout | device → controller | no | outbox envelope, class `audit` |
| ack | controller → device | no | the ranges the controller stored, signed (command key) |
| cmd | controller → device | no | a signed command |

The direction is enforced twice: the broker's ACL (`fleet.controller.broker`) lets a device
publish only the kinds a device sends (`DEVICE_KINDS`) and only read the kinds the
controller sends (`CONTROLLER_KINDS`); the box then checks every ack's signature, so a client
holding a box's own credentials cannot make it delete what no controller stored.
"""

from __future__ import annotations

from typing import NamedTuple

from edge_agent.fleet.protocol.ids import check_id

PREFIX = "edge/v1"
ALL = "all"
STATUS = "status"
ACK = "ack"
CMD = "cmd"
RESULT = "cmd/result"
OUTBOX_KINDS = frozenset({"metrics", "ledger", "events", RESULT, "rollout"})
DEVICE_KINDS = OUTBOX_KINDS | {STATUS}
CONTROLLER_KINDS = frozenset({ACK, CMD})
KINDS = DEVICE_KINDS | CONTROLLER_KINDS


class Topic(NamedTuple):
    fleet: str
    device: str  # "all" for fleet-wide commands
    kind: str


def topic(fleet: str, device: str, kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown topic kind {kind!r}")
    if device == ALL and kind != CMD:
        raise ValueError("only commands go to the whole fleet")
    check_id("fleet", fleet)
    if device != ALL:
        check_id("device", device)
    return f"{PREFIX}/{fleet}/{device}/{kind}"


def parse(name: str) -> Topic:
    """The parts of a link topic; ValueError for anything else (ids checked too)."""
    parts = name.split("/")
    if len(parts) < 5 or "/".join(parts[:2]) != PREFIX:
        raise ValueError(f"not a link topic: {name!r}")
    fleet, device, kind = parts[2], parts[3], "/".join(parts[4:])
    if kind not in KINDS or (device == ALL and kind != CMD):
        raise ValueError(f"not a link topic: {name!r}")
    check_id("fleet", fleet)
    if device != ALL:
        check_id("device", device)
    return Topic(fleet, device, kind)


def device_filter(fleet: str, device: str) -> list[str]:
    """What a device subscribes to: its own commands and acks, and its fleet's commands."""
    return [topic(fleet, device, CMD), topic(fleet, device, ACK), topic(fleet, ALL, CMD)]


CONTROLLER_FILTER = f"{PREFIX}/+/+/#"
STATUS_FILTER = f"{PREFIX}/+/+/{STATUS}"
