"""The outbox envelope and the ingest acknowledgement: what a device sends (every message
but `status`) and what the controller answers once it has stored it.

    {"v":1,"device":"store-042","boot_id":"<uuid4 hex>","seq":17,"kind":"metrics",
     "class":"metrics","ts":1764520000.123,"body":{...}}
    {"v":1,"device":"store-042","acks":{"<boot_id>":[[1,100],[105,107]]},"sig":"<base64>"}

The ack is signed with the controller's command key (`fleet.protocol.signing`, the same canonical
form as a command's): deleting outbox rows is the one thing a message can make the box do
without a command, so a box that holds the key's public half deletes nothing on an ack it
cannot verify — not one signed by another key, for another device, or not signed at all.
`device` binds an ack to its box (boot ids are random, but a signature should say whom it
is for). A controller without a command key sends the unsigned form, which only a box
without the key accepts (and says at start that it trusts the broker's ACL alone).

This module owns the byte form of both: compact UTF-8 JSON, at most `MAX_BYTES`, decoded
strictly (the controller drops and counts what `decode` refuses, so a field of the wrong
type never reaches its store), and the inclusive seq ranges an ack carries (`Ranges`:
`to_ranges`, `merge_ranges`, `complement`, `check_ranges`), which both the box's outbox and
the controller's store count in. It does no I/O and never assigns a seq — the outbox does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edge_agent.fleet.protocol import signing
from edge_agent.fleet.protocol.ids import BOOT_ID, check_id
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.topics import OUTBOX_KINDS

VERSION = 1
MAX_SEQ = 2**63 - 1  # a BIGINT: both sides store seqs as signed 64-bit integers
MAX_BYTES = 256 * 1024
MAX_ACK_BYTES = 1024 * 1024
AUDIT = "audit"
METRICS = "metrics"
CLASSES = frozenset({AUDIT, METRICS})
_FIELDS = frozenset({"v", "device", "boot_id", "seq", "kind", "class", "ts", "body"})
_ACK_FIELDS = frozenset({"v", "acks"})
_SIGNED_ACK_FIELDS = _ACK_FIELDS | {"device", signing.SIG}

Ranges = list[list[int]]
"""Inclusive, sorted, disjoint, non-adjacent `[first, last]` seq ranges."""


def class_of(kind: str) -> str:
    """The protocol's class for a kind: only `metrics` may be dropped."""
    return METRICS if kind == "metrics" else AUDIT


@dataclass(frozen=True)
class Envelope:
    device: str
    boot_id: str
    seq: int
    kind: str
    cls: str
    ts: float
    body: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"v": VERSION, "device": self.device, "boot_id": self.boot_id, "seq": self.seq,
                "kind": self.kind, "class": self.cls, "ts": self.ts, "body": self.body}


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON; ValueError for NaN/infinity or text UTF-8 cannot hold (a lone
    surrogate), TypeError for what JSON has no form for."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # two values for one key: which one was signed or meant?
        raise ValueError("duplicate key in a JSON object")
    return obj


def loads(payload: bytes, limit: int) -> Any:
    """Strict JSON from bytes: size first, then UTF-8, no NaN/Infinity, no duplicate keys."""
    if not isinstance(payload, bytes | bytearray):
        raise ValueError(f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > limit:
        raise ValueError(f"payload is {len(payload)} bytes; at most {limit}")
    try:
        text = bytes(payload).decode("utf-8")
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"payload is not UTF-8 JSON: {exc}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # An int is finite however large (math.isfinite would raise OverflowError on 10**400).
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def check_boot_id(value: Any) -> str:
    if not isinstance(value, str) or not BOOT_ID.fullmatch(value):
        raise ValueError(f"boot_id {str(value)[:40]!r} is not 32 lowercase hex digits")
    return value


def build(device: str, boot_id: str, seq: int, kind: str, cls: str, body: Mapping[str, Any],
          ts: float) -> Envelope:
    """An envelope with every field checked; ValueError naming the field otherwise."""
    check_id("device", device)
    check_boot_id(boot_id)
    if not _is_int(seq) or seq < 1:
        raise ValueError(f"seq {seq!r} is not an integer >= 1")
    if kind not in OUTBOX_KINDS:
        raise ValueError(f"kind {kind!r} is not one of {sorted(OUTBOX_KINDS)}")
    if cls != class_of(kind):
        raise ValueError(f"kind {kind!r} is class {class_of(kind)!r}, not {cls!r}")
    if not _is_number(ts):
        raise ValueError(f"ts {ts!r} is not a finite number")
    if not isinstance(body, Mapping):
        raise ValueError(f"body is {type(body).__name__}, not an object")
    return Envelope(device, boot_id, seq, kind, cls, ts, dict(body))


def encode(envelope: Envelope) -> bytes:
    """The envelope's bytes; ValueError past `MAX_BYTES` or for a body JSON cannot carry."""
    try:
        data = dumps(envelope.as_dict())
    except TypeError as exc:  # a set, a datetime, an object: the caller's bug, named
        raise ValueError(f"body is not JSON: {exc}") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"{envelope.kind} message is {len(data)} bytes; at most {MAX_BYTES}")
    return data


def decode(payload: bytes) -> Envelope:
    """The envelope in `payload`; ValueError for anything that is not exactly one."""
    obj = loads(payload, MAX_BYTES)
    if not isinstance(obj, dict):
        raise ValueError("envelope is not a JSON object")
    if set(obj) != _FIELDS:
        missing, extra = sorted(_FIELDS - set(obj)), sorted(set(obj) - _FIELDS)
        raise ValueError(f"envelope fields: missing {missing}, unknown {extra}")
    if obj["v"] != VERSION or not _is_int(obj["v"]):
        raise ValueError(f"envelope version {obj['v']!r} is not {VERSION}")
    if not isinstance(obj["device"], str) or not isinstance(obj["kind"], str):
        raise ValueError("device and kind must be strings")
    if not isinstance(obj["body"], dict):
        raise ValueError("body is not an object")
    return build(obj["device"], obj["boot_id"], obj["seq"], obj["kind"], obj["class"],
                 obj["body"], obj["ts"])


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


def check_acks(acks: Any) -> dict[str, list[tuple[int, int]]]:
    """`{boot_id: [[a, b], ...]}` checked: ids well formed, 1 <= a <= b, integers."""
    if not isinstance(acks, Mapping):
        raise ValueError("acks is not an object")
    out: dict[str, list[tuple[int, int]]] = {}
    for boot_id, runs in acks.items():
        check_boot_id(boot_id)
        if not isinstance(runs, Sequence) or isinstance(runs, str | bytes):
            raise ValueError(f"acks for {boot_id} are not a list")
        checked: list[tuple[int, int]] = []
        for run in runs:
            if (not isinstance(run, Sequence) or isinstance(run, str | bytes) or len(run) != 2
                    or not all(_is_int(x) for x in run) or not 1 <= run[0] <= run[1]):
                raise ValueError(f"ack range {str(run)[:40]} is not [a, b] with 1 <= a <= b")
            checked.append((run[0], run[1]))
        out[boot_id] = checked
    return out


class AckRefused(ValueError):
    """A well-formed ack the box must not act on: unsigned, signed by another key, or
    addressed to another device."""


def encode_ack(acks: Mapping[str, Sequence[Sequence[int]]], *, device: str,
               key: Ed25519PrivateKey | None = None) -> bytes:
    """The ack for `device`: signed when the controller has its command key."""
    checked = check_acks(acks)
    check_id("device", device)
    obj: dict[str, Any] = {"v": VERSION, "device": device,
                           "acks": {b: [list(r) for r in rs] for b, rs in checked.items()}}
    return dumps(signing.sign(obj, key) if key is not None else obj)


def decode_ack(payload: bytes, *, device: str, public_key: Ed25519PublicKey | None,
               signed: bool = True) -> dict[str, list[tuple[int, int]]]:
    """The ranges in an ingest acknowledgement for `device`: ValueError for anything
    malformed, AckRefused for one that `public_key` (the box's command key) does not
    verify. `signed=False` (a box configured without a key): nothing to verify against,
    the ranges as they came."""
    obj = loads(payload, MAX_ACK_BYTES)
    if (not isinstance(obj, dict) or not _ACK_FIELDS <= set(obj)
            or not set(obj) <= _SIGNED_ACK_FIELDS):
        raise ValueError("ack is not {\"v\":1,\"device\":...,\"acks\":{...},\"sig\":...}")
    if obj["v"] != VERSION or not _is_int(obj["v"]):
        raise ValueError(f"ack version {obj['v']!r} is not {VERSION}")
    acks = check_acks(obj["acks"])
    if "device" in obj and obj["device"] != device:
        raise AckRefused(f"ack is for device {str(obj['device'])[:40]!r}, not {device!r}")
    if not signed:
        return acks
    if public_key is None:  # configured but unreadable: verify nothing, trust nothing
        raise AckRefused("the box's command key is unreadable")
    if "device" not in obj:
        raise AckRefused("ack names no device")
    try:
        signing.verify(obj, public_key)
    except CommandRefused as exc:
        raise AckRefused(f"ack is not the controller's ({exc.message})") from None
    return acks
