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

The n-gram is 6 tokens, down to 3. With 3 down to 2, SmolLM2-135M quoting a returns policy
or a product list (`edge-agent bench`'s prompts, 10 prompts of 96 greedy tokens, in turn
with it off, 4 runs) went 1.03-1.13x faster; with 6 down to 3, 1.13-1.27x: a 2-token match
is often a common phrase the model goes on to paraphrase, and every guess after it costs a
row (~0.4 of a pass on a CPU). 8 down to 4 gave 1.07-1.32x and 12 down to 6 1.14x (one
run): no better, within the noise.
"""

from __future__ import annotations

import numpy as np


class PromptLookup:
    """The tokens of one sequence (prompt and answer so far), growing as it decodes, and
    the draft they suggest. Everything is on the worker thread."""

    def __init__(self, tokens: list[int], *, ngram_max: int = 6, ngram_min: int = 3) -> None:
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
