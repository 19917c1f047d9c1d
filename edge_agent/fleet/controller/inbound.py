"""What the controller's store takes and gives back: an inbound envelope, the acks a batch
earns.

Plain data only: no database, no MQTT. The seq ranges an ack carries, and their wire
form (signed), are the protocol's (`fleet.protocol.envelope`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.fleet.protocol.envelope import Ranges, encode_ack, merge_ranges


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
