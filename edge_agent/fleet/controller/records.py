"""What the controller's store takes and gives back: an inbound envelope, the acks a batch
earns, and inclusive seq ranges.

Plain data and pure functions only: no database, no MQTT. The ranges are the wire form of
the ingest acknowledgement (`{"v":1,"acks":{"<boot_id>":[[1,100],[105,107]]}}`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Ranges = list[list[int]]
"""Inclusive, sorted, disjoint, non-adjacent `[first, last]` seq ranges."""


@dataclass(frozen=True)
class Inbound:
    """One outbox envelope as it came off a device's topic (the topic's fleet, device and
    kind; the envelope's boot_id, seq, class, ts and body)."""

    fleet: str
    device: str
    kind: str
    boot_id: str
    seq: int
    cls: str
    ts: float
    body: Mapping[str, Any]
    received: float


@dataclass
class Acks:
    """What one `ingest` committed: per device, per boot, the seq ranges now in the store
    (duplicates included), and how many rows were new or already there."""

    ranges: dict[str, dict[str, Ranges]] = field(default_factory=dict)
    stored: int = 0
    duplicates: int = 0
    stored_by_kind: dict[str, int] = field(default_factory=dict)

    def payload(self, device: str) -> bytes:
        """The ack message for `device` (compact JSON, as on the wire)."""
        return ack_payload(self.ranges.get(device, {}))


def ack_payload(by_boot: Mapping[str, Ranges]) -> bytes:
    return json.dumps({"v": 1, "acks": dict(by_boot)}, separators=(",", ":")).encode()


def to_ranges(seqs: Iterable[int]) -> Ranges:
    """[1, 2, 3, 7, 5, 6, 9] -> [[1, 3], [5, 7], [9, 9]] (duplicates collapse)."""
    out: Ranges = []
    for seq in sorted(set(seqs)):
        if out and seq == out[-1][1] + 1:
            out[-1][1] = seq
        else:
            out.append([seq, seq])
    return out


def merge_ranges(ranges: Iterable[Iterable[int]]) -> Ranges:
    """Overlapping or adjacent ranges joined: [[1, 3], [2, 5], [6, 6]] -> [[1, 6]]."""
    out: Ranges = []
    for first, last in sorted((int(a), int(b)) for a, b in ranges):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return out


def complement(covered: Ranges, upto: int) -> Ranges:
    """The seqs of 1..upto that `covered` (merged) leaves out, as ranges."""
    out: Ranges = []
    nxt = 1
    for first, last in covered:
        if first > nxt:
            out.append([nxt, min(first - 1, upto)])
        nxt = max(nxt, last + 1)
        if nxt > upto:
            break
    if nxt <= upto:
        out.append([nxt, upto])
    return [r for r in out if r[0] <= r[1]]


def check_ranges(value: Any) -> Ranges:
    """A `[[a, b], ...]` list from a device's message, checked (ints, 1 <= a <= b); else
    ValueError. Device data is never trusted to have the shape the protocol says."""
    if not isinstance(value, list):
        raise ValueError("ranges must be a list")
    out: Ranges = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
                or not 1 <= item[0] <= item[1]):
            raise ValueError(f"bad range {item!r}")
        out.append([item[0], item[1]])
    return merge_ranges(out)
