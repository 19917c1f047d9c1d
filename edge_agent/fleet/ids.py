"""Fleet and device ids: the one rule, checked wherever an id enters (config, broker
provisioning, the controller reading a topic).

An id becomes a topic level and a broker user name. Mosquitto's per-device ACL
(`pattern readwrite edge/v1/+/%u/#`) substitutes the user name into the pattern: a `/` in
it reaches into another device's tree, `+` and `#` are wildcards. So ids are plain
`[A-Za-z0-9_-]`, 1 to 64 characters, and `all` is kept for fleet-wide commands.
"""

from __future__ import annotations

import re

ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESERVED = frozenset({"all"})


def check_id(kind: str, value: str) -> str:
    """`value` if it may be a `kind` id ("fleet", "device"); else ValueError saying why."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} id is empty")
    if len(value) > 64:
        raise ValueError(f"{kind} id {value[:64]!r}... is {len(value)} characters; at most 64")
    if not ID.fullmatch(value):
        bad = next(c for c in value if not ID.fullmatch(c))
        raise ValueError(
            f"{kind} id {ascii(value)} holds {ascii(bad)}: use only letters, digits, '-' and "
            "'_' (a '/', '+' or '#' would break the broker's per-device access rules)")
    if kind == "device" and value in RESERVED:
        raise ValueError(f"device id {value!r} is reserved for fleet-wide commands")
    return value
