"""Names: the one rule every model name a client or an operator gives must meet, and the
one rule for fleet and device ids.

Below everything else (config validates `default_model` and `[fleet]` ids with it), so it
imports only the error tree.
"""

from __future__ import annotations

import re
from typing import Any

from edge_agent.errors import InvalidRequest

# Ollama's names: up to two '/' parts before the model (host, namespace), then an optional
# ':tag'. Each part starts with a letter, digit or '_' and holds only those, '.' and '-', so
# a name is plain ASCII with no path component of its own ('.', '..') and no control
# character. Its manifest file name (the name percent-quoted, ':latest' added, '.json')
# stays below the 255-byte limit of file names: at most 200 + 2 x 2 + 9 + 5 = 218 bytes.
MAX_NAME_CHARS = 200
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_NAME = re.compile(rf"(?:{_PART}/){{0,2}}{_PART}(?::{_PART})?")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:/-]*")


class ModelName(str):
    """A model name checked and completed once, where it enters: Ollama's `model.Name`.

    `ModelName.parse` applies the rule below (a bare name means the `latest` tag) to a name
    a client, an operator, a setting or a catalog file gives; what it returns travels on as
    this type, and a function that takes a `ModelName` trusts it without parsing again
    (mypy holds callers to it: a plain `str` is not one). `ModelName(text)` wraps, without
    checks, a name that was parsed before it was stored (a manifest, a database row).
    It is a `str`: it compares, hashes and prints as the name itself; `given` keeps the
    text it was parsed from, so a message quotes the client's own words ("model 'nope'
    not found", as Ollama says), not the completed name.
    """

    @property
    def given(self) -> str:
        """The text this name was parsed from (itself when it was only wrapped)."""
        given = self.__dict__.get("given")
        return given if given is not None else str(self)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """A record field of this type (a manifest's `name`) holds a stored name: wrapped,
        not parsed again."""
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(cls, core_schema.str_schema())

    @classmethod
    def parse(cls, name: str) -> ModelName:
        """The name `name` stands for; InvalidRequest (400, param `model`) if it breaks
        the rule, its message showing the name cut short and escaped. One rule decides
        what may become a manifest file name."""
        if type(name) is cls and "given" in name.__dict__:
            return name  # parsed before; one only wrapped (read back) is checked again
        given, name = str(name), name.strip()
        if not name:
            raise InvalidRequest("model name is empty", param="model")
        if len(name) > MAX_NAME_CHARS:
            raise InvalidRequest(
                f"model name {_shown(name)} is {len(name)} characters; at most "
                f"{MAX_NAME_CHARS}", param="model")
        if not _NAME_CHARS.fullmatch(name):
            bad = next(c for c in name if not _NAME_CHARS.fullmatch(c))
            raise InvalidRequest(
                f"model name {_shown(name)} holds {ascii(bad)}: use letters, digits, "
                "'.', '-', '_', one ':' before the tag and '/' between parts", param="model")
        if not _NAME.fullmatch(name):
            raise InvalidRequest(
                f"model name {_shown(name)} is not [host/][namespace/]name[:tag], each part "
                "starting with a letter, digit or '_'", param="model")
        parsed = cls(name if ":" in name else f"{name}:latest")
        parsed.__dict__["given"] = given
        return parsed


def as_given(name: str) -> str:
    """How a name was given, for a message: a `ModelName`'s `given`, any other text as is
    (a store's own callers, tests among them, may hand it plain text)."""
    return name.given if isinstance(name, ModelName) else name


def _shown(name: str) -> str:
    """A client's name in a message: escaped to ASCII (no surrogate or control character
    reaches a response or a terminal) and cut to 40 characters."""
    text = ascii(name[:41])[1:-1]
    return f"'{text[:40]}...'" if len(text) > 40 else f"'{text}'"


# Fleet and device ids become a topic level and a broker user name. Mosquitto's per-device
# ACL (`pattern readwrite edge/v1/+/%u/#`) substitutes the user name into the pattern: a
# `/` in it reaches into another device's tree, `+` and `#` are wildcards. So ids are plain
# `[A-Za-z0-9_-]`, 1 to 64 characters, and `all` is kept for fleet-wide commands.
# `edge_agent.fleet.protocol.ids` re-exports this as `check_id`; config uses it from here because
# config sits below the fleet link.
FLEET_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESERVED_DEVICE_IDS = frozenset({"all"})


def check_fleet_id(kind: str, value: str) -> str:
    """`value` if it may be a `kind` id ("fleet", "device"); else ValueError saying why."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} id is empty")
    if len(value) > 64:
        raise ValueError(f"{kind} id {value[:64]!r}... is {len(value)} characters; at most 64")
    if not FLEET_ID.fullmatch(value):
        bad = next(c for c in value if not FLEET_ID.fullmatch(c))
        raise ValueError(
            f"{kind} id {ascii(value)} holds {ascii(bad)}: use only letters, digits, '-' and "
            "'_' (a '/', '+' or '#' would break the broker's per-device access rules)")
    if kind == "device" and value in RESERVED_DEVICE_IDS:
        raise ValueError(f"device id {value!r} is reserved for fleet-wide commands")
    return value
