"""What the controller's store takes and gives back: an inbound envelope, the acks a batch
earns, and inclusive seq ranges.

Plain data and pure functions only: no database, no MQTT. The ranges are what the ingest
acknowledgement carries; its wire form (signed) is `fleet.protocol.envelope.encode_ack`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.fleet.protocol.envelope import encode_ack

Ranges = list[list[int]]
"""Inclusive, sorted, disjoint, non-adjacent `[first, last]` seq ranges."""

MAX_SEQ = 2**63 - 1  # a BIGINT: a larger seq from a device is refused, not a failed commit


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

    def add(self, other: Acks) -> None:
        """Fold another ingest's acks into these (ranges merged per device and boot)."""
        for device, by_boot in other.ranges.items():
            mine = self.ranges.setdefault(device, {})
            for boot_id, ranges in by_boot.items():
                mine[boot_id] = merge_ranges(mine.get(boot_id, []) + ranges)
        self.stored += other.stored
        self.duplicates += other.duplicates
        for kind, count in other.stored_by_kind.items():
            self.stored_by_kind[kind] = self.stored_by_kind.get(kind, 0) + count

    def payload(self, device: str, key: Ed25519PrivateKey | None = None) -> bytes:
        """The ack message for `device`, signed with the command key when there is one
        (its wire form is `fleet.protocol.envelope`'s)."""
        return encode_ack(self.ranges.get(device, {}), device=device, key=key)


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
                or not 1 <= item[0] <= item[1] <= MAX_SEQ):
            raise ValueError(f"bad range {item!r}")
        out.append([item[0], item[1]])
    return merge_ranges(out)
