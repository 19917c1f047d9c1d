"""Model names: Ollama's rule, the one check every name a client or operator gives passes.

Owns the rule only; never looks at what is installed.
"""

from __future__ import annotations

import re

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


def normalize_name(name: str) -> str:
    """Ollama's naming: a bare name means the `latest` tag.

    Every model name a client or an operator gives passes here first, so one rule decides
    what may become a manifest file name; a name it refuses is an InvalidRequest (400,
    param `model`), whose message shows the name cut short and escaped.
    """
    name = name.strip()
    if not name:
        raise InvalidRequest("model name is empty", param="model")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(
            f"model name {_shown(name)} is {len(name)} characters; at most {MAX_NAME_CHARS}",
            param="model")
    if not _NAME_CHARS.fullmatch(name):
        bad = next(c for c in name if not _NAME_CHARS.fullmatch(c))
        raise InvalidRequest(
            f"model name {_shown(name)} holds {ascii(bad)}: use letters, digits, "
            "'.', '-', '_', one ':' before the tag and '/' between parts", param="model")
    if not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"model name {_shown(name)} is not [host/][namespace/]name[:tag], each part "
            "starting with a letter, digit or '_'", param="model")
    return name if ":" in name else f"{name}:latest"


def _shown(name: str) -> str:
    """A client's name in a message: escaped to ASCII (no surrogate or control character
    reaches a response or a terminal) and cut to 40 characters."""
    text = ascii(name[:41])[1:-1]
    return f"'{text[:40]}...'" if len(text) > 40 else f"'{text}'"
