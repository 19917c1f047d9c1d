"""A tenant's data boundary on the way to an upstream (`egress = "redacted"`): the personal
data of a request's text replaced by placeholders before anything leaves the box, and the
originals put back into the answer as it comes in, a streamed one included (the
anonymize/deanonymize pattern, with the box's own detectors).

A placeholder names its entity (`<EMAIL>`), and a number from the second value of one kind
on (`<EMAIL_2>`), the same value getting the same placeholder throughout the request, so
the upstream's model can still refer to "the e-mail" consistently (and copies a bare name
more faithfully than a numbered one); the mapping lives only in this object, for one
request, and is never written anywhere. A streamed answer may split a placeholder across
two chunks: the restorer holds back a tail that could still become one, and lets it go as
soon as it cannot.
"""

from __future__ import annotations

import re
from collections import Counter

from edge_agent.governance.redaction import Detectors

_PLACEHOLDER = re.compile(r"<[A-Z][A-Z_]*(?:_\d+)?>")
MAX_PLACEHOLDER = 40  # characters: the longest tail held back, waiting for a `>`


class Pseudonyms:
    """One request's placeholders, both ways."""

    def __init__(self, detectors: Detectors) -> None:
        self.detectors = detectors
        self._originals: dict[str, str] = {}
        self._given: dict[tuple[str, str], str] = {}
        self.entities: Counter[str] = Counter()

    def hide(self, text: str) -> str:
        """`text` with each finding replaced by its placeholder (the strict pass, as for a
        prompt the box's own model sees redacted)."""
        out, pos = [], 0
        for found in self.detectors.find(text):
            value = text[found.start:found.end]
            key = (found.entity, value)
            placeholder = self._given.get(key)
            if placeholder is None:
                number = sum(1 for entity, _ in self._given if entity == found.entity) + 1
                placeholder = f"<{found.entity}>" if number == 1 else \
                    f"<{found.entity}_{number}>"
                self._given[key] = placeholder
                self._originals[placeholder] = value
            self.entities[found.entity] += 1
            out += [text[pos:found.start], placeholder]
            pos = found.end
        out.append(text[pos:])
        return "".join(out)

    def restore(self, text: str) -> str:
        """The originals back in place of every placeholder this request gave out; any
        other text in angle brackets is left as it is."""
        if not self._originals:
            return text
        return _PLACEHOLDER.sub(lambda m: self._originals.get(m.group(0), m.group(0)), text)

    def restorer(self) -> Restorer:
        return Restorer(self)


class Restorer:
    """A streamed answer's chunks with the originals back, never splitting a placeholder:
    `feed` returns what can go out now, `flush` the rest at the end."""

    def __init__(self, pseudonyms: Pseudonyms) -> None:
        self.pseudonyms = pseudonyms
        self._held = ""

    def feed(self, chunk: str) -> str:
        text = self._held + chunk
        cut = _open_tail(text)
        self._held = text[cut:]
        return self.pseudonyms.restore(text[:cut])

    def flush(self) -> str:
        text, self._held = self._held, ""
        return self.pseudonyms.restore(text)


def _open_tail(text: str) -> int:
    """Where a tail that could still grow into a placeholder starts (len(text): none)."""
    start = text.rfind("<", max(0, len(text) - MAX_PLACEHOLDER))
    if start < 0 or ">" in text[start:]:
        return len(text)
    if re.fullmatch(r"<(?:[A-Z][A-Z_]*(?:_\d*)?)?", text[start:]):
        return start
    return len(text)
