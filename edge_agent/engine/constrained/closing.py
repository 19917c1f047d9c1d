"""A structured answer closed within its max_tokens, instead of cut off in the middle.

A client that asks for a JSON schema wants a document: an answer cut at `max_tokens`
(`finish_reason: length`) is not one, whatever the grammar held up to there. A small model
cut this way most often because it went on writing optional properties one after another,
or a free string, until the budget ran out. So the last tokens of the budget (the scheduler
decides how many: `runtime.structured_close_tokens`) are spent on closing. At each step the
model chooses as usual; where its token would go on writing rather than end what is open,
the best-scored (by the model's own logits) of the tokens that do end it — a string's
closing quote, an object's `}`, an array's `]`, the end of generation once the document is
whole — is taken instead, if the grammar allows one there. Where it allows none (a required
property still due, a number's digits, a `pattern` not yet matched), the model's token
stands. Nothing here can make an answer invalid: only tokens the grammar allows are ever
chosen; and an answer the model closes by itself is not counted as closed.

What counts as closing depends on where the text is, so `JsonLexer` follows the answer's
bytes: inside a string a `}` is a character like any other and only a quote ends it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as ll
import numpy as np

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_SPACE = frozenset(b" \t\n\r")
_CLOSERS = frozenset(b"}]")
_OPENERS = frozenset(b",{[\"")  # what starts another value or property


class ClosingTokens:
    """One vocabulary's closing tokens: which end a string (a quote, then at most closing
    brackets and whitespace) and which end a value outside one (only closing brackets and
    whitespace, at least one bracket). End-of-generation tokens close in both places (the
    grammar allows them only once the document is whole)."""

    def __init__(self, pieces: Sequence[bytes], eog: Sequence[bool]) -> None:
        n = len(pieces)
        self.pieces = pieces
        self.in_string = np.zeros(n, dtype=bool)
        self.outside = np.zeros(n, dtype=bool)
        for token, piece in enumerate(pieces):
            if eog[token]:
                self.in_string[token] = self.outside[token] = True
            elif piece[:1] == b'"' and all(b in _CLOSERS or b in _SPACE for b in piece[1:]):
                self.in_string[token] = True
            elif piece and all(b in _CLOSERS or b in _SPACE for b in piece) \
                    and any(b in _CLOSERS for b in piece):
                self.outside[token] = True

        # What the model may choose itself and still be closing: inside a string, a token
        # that ends it and opens nothing new after (`"`, `"}`, a key's `":`, but not `",`);
        # outside one, a closing token as above. A token that ends one value to start the
        # next (`},{`) does not count: it writes on.
        self.ends_string = self.in_string.copy()
        for token, piece in enumerate(pieces):
            if piece[:1] == b'"' and not any(b in _OPENERS for b in piece[1:]):
                self.ends_string[token] = True
        self.ends_value = self.outside
        self.in_string_ids = np.flatnonzero(self.in_string).astype(np.int32)
        self.outside_ids = np.flatnonzero(self.outside).astype(np.int32)
        size = max(self.in_string_ids.size, self.outside_ids.size, 1)
        self._probe = np.zeros(size, dtype=_TOKEN_DATA)
        self._array = ll.llama_token_data_array(
            data=ctypes.cast(self._probe.ctypes.data, ctypes.POINTER(ll.llama_token_data)),
            size=0, selected=-1, sorted=False)
        self._ref = ctypes.pointer(self._array)

    def closes(self, token: int, lexer: JsonLexer) -> bool:
        """Whether the model's own choice `token` already ends what is open where the text
        is (then it stands)."""
        return bool((self.ends_string if lexer.in_string else self.ends_value)[token])

    def best(self, grammar: ctypes.c_void_p, lexer: JsonLexer, logits: np.ndarray
             ) -> int | None:
        """The best-scored closing token `grammar` allows next, or None. Only the few
        hundred closing tokens are checked, in one `llama_sampler_apply`: exact in any
        grammar state, a partial UTF-8 character's included (the grammar refuses them
        there)."""
        ids = self.in_string_ids if lexer.in_string else self.outside_ids
        n = ids.size
        if n == 0:
            return None
        probe = self._probe
        probe["id"][:n] = ids
        probe["logit"][:n] = 0.0
        arr = self._array
        arr.size, arr.selected, arr.sorted = n, -1, False
        ll.llama_sampler_apply(grammar, self._ref)
        allowed = ids[probe["logit"][:n] != -np.inf]
        if allowed.size == 0:
            return None
        return int(allowed[int(np.argmax(logits[allowed]))])


class JsonLexer:
    """Whether the text so far ends inside a JSON string: quotes, and backslash escapes
    inside strings, byte by byte (a multibyte character never holds a quote byte)."""

    __slots__ = ("in_string", "_escaped")

    def __init__(self) -> None:
        self.in_string = False
        self._escaped = False

    def feed(self, data: bytes) -> None:
        in_string, escaped = self.in_string, self._escaped
        for byte in data:
            if not in_string:
                if byte == 0x22:  # "
                    in_string = True
            elif escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        self.in_string, self._escaped = in_string, escaped
