"""The vocabulary as a forest of token prefixes: which tokens a grammar allows next, found
without running each of the vocabulary's tokens through the grammar.

llama.cpp's grammar check is closed under prefixes: a token whose text the grammar can
consume from its current state has every prefix of that text consumable too (it walks the
code points one by one and accepts a candidate once they run out). So if a token is refused,
so is every longer token that starts with its text. Each token's parent here is the longest
other token that its text starts with (in code points, as llama.cpp decodes them); the
filter checks the roots, then only the children of what was allowed, level by level, each
level in one `llama_sampler_apply`. A JSON grammar that expects a key allows a handful of
the 49,152 tokens of the default model: ~600 checks instead of 49,152 (about 0.5 ms instead
of 12). The allowed set is exactly the one the full filter gives — a test holds the two
together at every step of real generations.

Two cases the forest cannot see, where the caller filters the whole vocabulary instead:
the grammar in the middle of a UTF-8 sequence (the previous token ended in part of a
character: the next one's first bytes complete it, so its code points are not the ones
below; `Utf8Tail` follows this), and a grammar whose state llama.cpp keeps lazily (not
used here). End-of-generation tokens are roots (the grammar judges them by its own rule,
not by their text); tokens whose text is empty or starts with a NUL are never allowed and
are left out.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import llama_cpp as ll
import numpy as np

# The length of a sequence by the top 4 bits of its first byte (0: not a first byte).
_LOOKUP = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def decode_utf8(data: bytes, value: int = 0, n_remain: int = 0
                ) -> tuple[tuple[int, ...], int, int]:
    """llama.cpp's grammar decoder (`decode_utf8` in llama-grammar.cpp), byte for byte:
    the code points of `data` after a partial sequence (`value`, `n_remain` continuation
    bytes still due), and the partial state it ends in (`n_remain` -1: an invalid byte, the
    code points then empty). Stops at a NUL, as the C string does."""
    points: list[int] = []
    end = data.find(0)
    if end >= 0:
        data = data[:end]
    pos, n = 0, len(data)
    if n_remain > 0:
        while pos < n and n_remain > 0:
            byte = data[pos]
            if byte >> 6 != 2:
                return (), 0, -1
            value = (value << 6) + (byte & 0x3F)
            pos += 1
            n_remain -= 1
        if n_remain == 0:
            points.append(value)
    while pos < n:
        first = data[pos]
        n_remain = _LOOKUP[first >> 4] - 1
        if n_remain < 0:
            return (), 0, -1
        value = first & ((1 << (7 - n_remain)) - 1)
        pos += 1
        while pos < n and n_remain > 0:
            value = (value << 6) + (data[pos] & 0x3F)
            pos += 1
            n_remain -= 1
        if n_remain == 0:
            points.append(value)
    return tuple(points), value, n_remain


def _code_points(data: bytes) -> tuple[str, bool]:
    """A token's code points as llama.cpp's grammar decodes them, as a str (for slicing and
    hashing), and whether it ends at a character boundary. Valid UTF-8 (nearly every
    token) decodes the same in Python; anything else goes through `decode_utf8`. Code
    points no str can hold (above U+10FFFF, from invalid bytes) come back as "": such a
    token is a root, checked each time, which keeps the filter exact."""
    end = data.find(0)
    if end >= 0:
        data = data[:end]
    try:
        return data.decode("utf-8"), True
    except UnicodeDecodeError:
        pass
    points, _, n_remain = decode_utf8(data)
    if any(p > 0x10FFFF for p in points):
        return "", n_remain == 0
    return "".join(map(chr, points)), n_remain == 0


class Utf8Tail:
    """Whether the text accepted so far ends inside a UTF-8 sequence, as the grammar's own
    state has it; `clean` is what the prefix filter needs. One per sampler."""

    __slots__ = ("_pieces", "_value", "n_remain")

    def __init__(self, pieces: Callable[[int], bytes]) -> None:
        self._pieces = pieces
        self._value = 0
        self.n_remain = 0

    def accept(self, token: int, clean_end: bool) -> None:
        """`clean_end`: the token, decoded from a clean state, ends clean (most do)."""
        if self.n_remain == 0 and clean_end:
            return
        _, self._value, self.n_remain = decode_utf8(self._pieces(token), self._value,
                                                    self.n_remain)

    @property
    def clean(self) -> bool:
        return self.n_remain == 0


class TokenPrefixes:
    """The forest of one model's vocabulary, and a preallocated array for its checks."""

    def __init__(self, pieces: Sequence[bytes], eog: Sequence[bool]) -> None:
        """`pieces`: each token's text as llama.cpp's grammar sees it (special tokens
        rendered: `LlamaModel.grammar_piece`); `eog`: whether it ends generation."""
        n_vocab = self.n_vocab = len(pieces)
        parent = np.full(n_vocab, -1, dtype=np.int64)
        self.clean_end = np.zeros(n_vocab, dtype=bool)
        roots: list[int] = []
        by_text: dict[str, int] = {}  # complete texts: the first token of each
        decoded: list[tuple[int, str, bool]] = []
        for token, data in enumerate(pieces):
            if eog[token]:
                roots.append(token)
                self.clean_end[token] = True
                continue
            if not data or data[0] == 0:
                continue  # never allowed
            text, whole = _code_points(data)
            self.clean_end[token] = whole
            if not text:  # a lone partial or invalid sequence: a root, checked each time
                roots.append(token)
                continue
            if whole:
                by_text.setdefault(text, token)
            decoded.append((token, text, whole))
        for token, text, whole in decoded:
            # A parent need only be some token whose text starts this one's (any such
            # prefix keeps the filter exact); the longest prunes most. A complete text's own
            # entry is another token only for a duplicate; a partial tail's parent may be
            # the token of exactly its complete part.
            longest = len(text) if not whole or by_text[text] != token else len(text) - 1
            for size in range(longest, 0, -1):
                found = by_text.get(text[:size])
                if found is not None and found != token:
                    parent[token] = found
                    break
            else:
                roots.append(token)
        self.roots = np.array(sorted(roots), dtype=np.int32)
        has = parent >= 0
        kids = np.flatnonzero(has)
        order = np.argsort(parent[kids], kind="stable")
        self.children = kids[order].astype(np.int32)
        counts = np.bincount(parent[kids], minlength=n_vocab)
        self.child_start = np.zeros(n_vocab + 1, dtype=np.int64)
        np.cumsum(counts, out=self.child_start[1:])
        self._probe = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._probe_ids = self._probe["id"]
        self._probe_logits = self._probe["logit"]
        self._array = ll.llama_token_data_array(
            data=ctypes.cast(self._probe.ctypes.data, ctypes.POINTER(ll.llama_token_data)),
            size=0, selected=-1, sorted=False)
        self._ref = ctypes.pointer(self._array)

    def allowed(self, grammar: ctypes.c_void_p, budget: int | None = None
                ) -> np.ndarray | None:
        """The tokens `grammar` allows next (its state must be at a character boundary:
        `Utf8Tail.clean`), in no particular order; None once more than `budget` tokens
        would have to be checked (a state that allows most of the vocabulary, inside a
        string: the whole-vocabulary filter is cheaper there, having no levels)."""
        found = []
        frontier = self.roots
        checked = 0
        while frontier.size:
            checked += frontier.size
            if budget is not None and checked > budget:
                return None
            ok = self._check(grammar, frontier)
            if not ok.size:
                break
            found.append(ok)
            frontier = self._children_of(ok)
        return np.concatenate(found) if found else self.roots[:0]

    def _check(self, grammar: ctypes.c_void_p, tokens: np.ndarray) -> np.ndarray:
        n = tokens.size
        self._probe_ids[:n] = tokens
        self._probe_logits[:n] = 0.0
        arr = self._array
        arr.size, arr.selected, arr.sorted = n, -1, False
        ll.llama_sampler_apply(grammar, self._ref)
        return tokens[self._probe_logits[:n] != -np.inf]

    def _children_of(self, tokens: np.ndarray) -> np.ndarray:
        starts = self.child_start[tokens]
        counts = self.child_start[tokens + 1] - starts
        total = int(counts.sum())
        if total == 0:
            return self.children[:0]
        # Ragged gather: the children of every token, run after run.
        offsets = np.cumsum(counts) - counts
        index = np.repeat(starts - offsets, counts) + np.arange(total)
        return self.children[index]
