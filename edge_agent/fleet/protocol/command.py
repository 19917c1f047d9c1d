"""A signed command as it travels from the controller to a box: its fields, their ranges,
and `parse`, which checks them. Both sides hold to these facts: the controller builds
commands no larger than `MAX_COMMAND_BYTES`, the box refuses anything else.

    {"v":1,"id":"<uuid4 hex>","fleet":"f1","device":"store-042"|"all","type":"ping",
     "seq":12,"issued_at":...,"expires_at":...,"args":{...},"sig":"<base64 ed25519>"}

`parse` is steps 1 and 2 of the box's command gate (`device.link.command_gate`): size,
then strict JSON with exactly these fields, each of its type and within its range. It
never looks at the signature, the device or the time (the gate does, in its order).
`Result` is the `cmd/result` body a box sends back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from edge_agent.fleet.protocol.envelope import MAX_SEQ, loads
from edge_agent.fleet.protocol.ids import COMMAND_ID
from edge_agent.fleet.protocol.refusals import MALFORMED, OVERSIZED, CommandRefused

__all__ = ["CLOCK_SKEW_S", "MAX_COMMAND_BYTES", "MAX_SEQ", "Command", "Result",
           "best_effort_names", "command_of", "is_finite_number", "parse"]

MAX_COMMAND_BYTES = 64 * 1024
# A box's clock may lag the controller's by seconds (NTP not yet synced after boot); a
# command is still taken this long after its expiry. Replay is stopped by seq, not by this.
CLOCK_SKEW_S = 30.0
_FIELDS = frozenset({"v", "id", "fleet", "device", "type", "seq", "issued_at", "expires_at",
                     "args", "sig"})
_TYPE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
# What a numeric field must be, said in its refusal so that the controller's operator
# sees the range and not only the name.
_HINTS = {"seq": f"a whole number from 1 to {MAX_SEQ} (2**63-1)",
          "issued_at": "a finite number (unix time)",
          "expires_at": "a finite number (unix time)"}


@dataclass(frozen=True)
class Command:
    id: str
    fleet: str
    device: str  # this box's id, or "all"
    type: str
    seq: int
    issued_at: float
    expires_at: float
    args: dict[str, Any]
    stream: str  # whose seq: the device's id, or "all"
    payload: bytes = field(repr=False)


@dataclass(frozen=True)
class Result:
    id: str | None  # None when the payload held no readable id
    type: str | None
    status: str  # ok | refused | failed
    reason: str | None
    result: dict[str, Any] | None

    def body(self) -> dict[str, Any]:
        """The `cmd/result` outbox body."""
        return {"id": self.id, "type": self.type, "status": self.status,
                "reason": self.reason, "result": self.result}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite as a float. A JSON integer has no size
    limit, and one past the float range would make `math.isfinite` itself raise
    OverflowError: such a number is simply not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_time(value: Any) -> bool:
    return is_finite_number(value)


def parse(payload: bytes) -> dict[str, Any]:
    """The command object in `payload`, every field checked; CommandRefused (oversized,
    malformed) otherwise. Signature, device and freshness are not checked here."""
    if len(payload) > MAX_COMMAND_BYTES:
        raise CommandRefused(OVERSIZED, f"{len(payload)} bytes; at most {MAX_COMMAND_BYTES}")
    try:
        obj = loads(payload, MAX_COMMAND_BYTES)
    except ValueError as exc:
        raise CommandRefused(MALFORMED, str(exc)[:200]) from None
    if not isinstance(obj, dict):
        raise CommandRefused(MALFORMED, "not a JSON object")
    # `sig` may be missing or of any type here: that is the signature check's refusal
    # (bad_signature), so an unsigned command is reported as unsigned.
    missing, unknown = _FIELDS - {"sig"} - set(obj), set(obj) - _FIELDS
    if missing or unknown:
        raise CommandRefused(MALFORMED, f"fields: missing {sorted(missing)}, "
                                        f"unknown {sorted(unknown)[:10]}")
    checks = [
        ("v", _is_int(obj["v"]) and obj["v"] == 1),
        ("id", isinstance(obj["id"], str) and bool(COMMAND_ID.fullmatch(obj["id"]))),
        ("fleet", isinstance(obj["fleet"], str)),
        ("device", isinstance(obj["device"], str)),
        ("type", isinstance(obj["type"], str) and bool(_TYPE.fullmatch(obj["type"]))),
        ("seq", _is_int(obj["seq"]) and 1 <= obj["seq"] <= MAX_SEQ),
        ("issued_at", _is_time(obj["issued_at"])),
        ("expires_at", _is_time(obj["expires_at"])),
        ("args", isinstance(obj["args"], dict)),
    ]
    bad = [name for name, ok in checks if not ok]
    if bad:
        hints = "; ".join(f"{name}: {_HINTS[name]}" for name in bad if name in _HINTS)
        raise CommandRefused(MALFORMED, f"bad field(s): {', '.join(bad)}"
                                        + (f" ({hints})" if hints else ""))
    if obj["expires_at"] <= obj["issued_at"]:
        raise CommandRefused(MALFORMED, "expires_at is not after issued_at")
    return obj


def command_of(obj: dict[str, Any], payload: bytes) -> Command:
    """The command in an object `parse` has checked."""
    return Command(obj["id"], obj["fleet"], obj["device"], obj["type"], obj["seq"],
                   float(obj["issued_at"]), float(obj["expires_at"]), obj["args"],
                   obj["device"], payload)


def best_effort_names(obj: Any, payload: bytes) -> tuple[str | None, str | None]:
    """The id and type of a refused command, for its result, if they are readable."""
    if obj is None and len(payload) <= MAX_COMMAND_BYTES:
        try:
            obj = loads(payload, MAX_COMMAND_BYTES)
        except ValueError:
            return None, None
    if not isinstance(obj, dict):
        return None, None
    cid, ctype = obj.get("id"), obj.get("type")
    return (cid if isinstance(cid, str) and COMMAND_ID.fullmatch(cid) else None,
            ctype if isinstance(ctype, str) and _TYPE.fullmatch(ctype) else None)
