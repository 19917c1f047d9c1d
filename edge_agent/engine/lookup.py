"""Prompt lookup: draft tokens for speculative decoding, taken from the sequence itself.

An answer that quotes its prompt (a product list, a policy, a record to fill in: what a
store's assistant is asked most) repeats runs of tokens the sequence already holds. Where
the last few tokens occurred before, the tokens that followed them then are a good guess
of the next ones. The scheduler decodes that guess in the same pass as the sequence's next
token and keeps the longest run the sampler confirms, token by token; a wrong guess costs
the extra rows of one pass, never a different answer (`ModelScheduler._accept`).

This is llama.cpp's "prompt lookup decoding" (an n-gram match over the context, no draft
model): the n-gram is the last `ngram_max` tokens, shortened down to `ngram_min` until it
occurs earlier in the sequence; the most recent earlier occurrence wins, as the text just
before the end is the likeliest to be the one being quoted.
"""

from __future__ import annotations

import numpy as np


class PromptLookup:
    """The tokens of one sequence (prompt and answer so far), growing as it decodes, and
    the draft they suggest. Everything is on the worker thread."""

    def __init__(self, tokens: list[int], *, ngram_max: int = 3, ngram_min: int = 2) -> None:
        self._buf = np.zeros(max(64, 2 * len(tokens)), dtype=np.int32)
        self._n = 0
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n

    def extend(self, tokens: list[int]) -> None:
        need = self._n + len(tokens)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : need] = tokens
        self._n = need

    def append(self, token: int) -> None:
        if self._n == len(self._buf):
            self.extend([token])
            return
        self._buf[self._n] = token
        self._n += 1

    def draft(self, n_max: int) -> list[int]:
        """Up to `n_max` tokens that followed the latest earlier occurrence of the sequence's
        last n-gram; [] where none occurred (then nothing extra is decoded)."""
        ctx, n = self._buf, self._n
        if n_max <= 0:
            return []
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            tail = ctx[n - size : n]
            # Starts of earlier occurrences: at least one token must follow each.
            starts = np.flatnonzero(ctx[: n - size] == tail[0])
            for k in range(1, size):
                if not len(starts):
                    break
                starts = starts[ctx[starts + k] == tail[k]]
            if len(starts):
                begin = int(starts[-1]) + size
                return ctx[begin : min(begin + n_max, n)].tolist()
        return []
