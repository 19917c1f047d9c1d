"""The last check before a synced body goes to the outbox: only names, ids and numbers.

`fleet.device.reporting.sync` never reads text in the first place (no prompt, no completion, no
content table, no redacted span's value, no end-user digest, no client trace id). This screen is
the belt to those braces: it walks every body (keys and values, nested objects and lists)
and withholds any string that does not look like a name or an id, so that a future
field, a mislabelled column or a client's string that slipped into a label cannot carry
text off the box.

A string passes when either
- it is at most `limit` characters (64 by default: a tenant, a status, an error type, a
  sensor or GPU name, a sha256 digest) and holds no control character (a newline or a tab
  is text, not a name); or
- it is a valid model name (`edge_agent.names`: ASCII letters, digits, `._-:/`, at most
  200 characters) — a name cannot hold a space, so it cannot hold a sentence.

A string value that fails is replaced by `"(withheld)"`; an object key that fails is
removed with its value. Numbers must be finite (JSON has no NaN: a NaN sensor reading is
sent as null, not counted). Anything that is not JSON's own (bytes, objects) is withheld.
The caller counts what was withheld and logs it once; the paths it reports never quote a
withheld string.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from edge_agent.errors import InvalidRequest
from edge_agent.names import MAX_NAME_CHARS, ModelName

TEXT_LIMIT = 64
WITHHELD = "(withheld)"


class Screened(NamedTuple):
    body: dict[str, Any]
    withheld: list[str]  # paths of what was withheld (`models.<key>`, `by[3].model`)


def is_name_like(value: str, limit: int = TEXT_LIMIT) -> bool:
    if len(value) <= limit and value.isprintable():
        return True
    if len(value) > MAX_NAME_CHARS or value != value.strip():
        return False
    try:
        ModelName.parse(value)
    except InvalidRequest:
        return False
    return True


def screen(body: Mapping[str, Any], limit: int = TEXT_LIMIT) -> Screened:
    """A copy of `body` holding only names, ids and numbers, and what was withheld."""
    withheld: list[str] = []
    out = _walk(body, "", limit, withheld)
    assert isinstance(out, dict)
    return Screened(out, withheld)


def _walk(value: Any, path: str, limit: int, withheld: list[str]) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        if is_name_like(value, limit):
            return value
        withheld.append(path or "(body)")
        return WITHHELD
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str) or not is_name_like(key, limit):
                withheld.append(f"{path}.(key)" if path else "(key)")
                continue
            out[key] = _walk(item, f"{path}.{key}" if path else key, limit, withheld)
        return out
    if isinstance(value, list | tuple):
        return [_walk(item, f"{path}[{i}]", limit, withheld) for i, item in enumerate(value)]
    withheld.append(path or "(body)")
    return WITHHELD
