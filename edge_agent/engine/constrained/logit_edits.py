"""A request's logit bias and repetition penalties, written into its batch row's logits
before anything samples them.

llama.cpp's own samplers for these two visit the whole vocabulary at every token: the
penalties sampler looks each of the default model's 49,152 candidates up in its hash map
of recent tokens (about 0.2 ms a token on a 2-core box, a sixth of a one-row decode step
of smollm2 there; eight rows, eight times that), to change the few dozen it finds. Both
only ever change the logits of the tokens they name: the bias's, and those of the last
`repeat_last_n` tokens. So they are applied here, in place, to exactly those tokens, in
llama.cpp's order (the bias, then the penalties) and with its float32 arithmetic, and the
chain that samples the row afterwards holds neither: its input is what theirs would have
handed on, bit for bit (`tests/test_sampler.py` holds the tokens to the whole chain's,
greedy and seeded).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from edge_agent.engine.request import SamplingParams


class LogitEdits:
    """One sequence's bias and penalty state; its window holds only the tokens it sampled
    (never the prompt), as the chain's penalties sampler does."""

    def __init__(self, params: SamplingParams) -> None:
        self.last_n = params.repeat_last_n
        with np.errstate(all="ignore"):  # as C's float(): past float32's range is inf
            self.bias = [(token, np.float32(bias)) for token, bias in params.logit_bias]
            self.repeat = np.float32(params.repeat_penalty)
            self.frequency = np.float32(params.frequency_penalty)
            self.presence = np.float32(params.presence_penalty)
        # llama.cpp's is_disabled(): no window, or no penalty at all.
        self.penalized = self.last_n != 0 and not (
            params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0)
        self.window: deque[int] = deque()
        self.counts: dict[int, int] = {}

    @property
    def active(self) -> bool:
        """Whether any token's logit may ever change."""
        return bool(self.bias) or self.penalized

    @np.errstate(all="ignore")
    def apply(self, logits: np.ndarray) -> None:
        """As C's float arithmetic: a penalty that is 0 as a float (5e-324) divides to inf,
        a sum past float32's range is inf, and neither is an error."""
        for token, bias in self.bias:  # one by one: a token named twice gets both
            logits[token] += bias
        if not self.penalized or not self.counts:
            return
        ids = np.fromiter(self.counts, dtype=np.intp, count=len(self.counts))
        counts = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
        x = logits[ids]
        x = np.where(x <= 0, x * self.repeat, x / self.repeat)
        logits[ids] = x - (counts * self.frequency + self.presence)

    def accept(self, token: int) -> None:
        """The sampled token into the window (llama.cpp's penalties `accept`)."""
        if not self.penalized:
            return
        self.counts[token] = self.counts.get(token, 0) + 1
        if len(self.window) >= self.last_n:
            old = self.window.popleft()
            left = self.counts[old] - 1
            if left:
                self.counts[old] = left
            else:
                del self.counts[old]
        self.window.append(token)
