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
from contextlib import nullcontext

import numpy as np

from edge_agent.engine.request import SamplingParams

_BOUND = 1e6


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
        self._bias_unbounded = any(not -_BOUND <= bias <= _BOUND for _, bias in self.bias)
        # llama.cpp's is_disabled(): no window, or no penalty at all.
        self.penalized = self.last_n != 0 and not (
            params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0)
        # Penalties that never raise a logit they touch nor make a NaN of one (`may_change`):
        # bounded, so that no product or sum of them reaches inf (inf - inf is a NaN).
        self.lowers_only = bool(1 <= self.repeat <= _BOUND and 0 <= self.frequency <= _BOUND
                                and 0 <= self.presence <= _BOUND)
        self.window: deque[int] = deque()
        self.counts: dict[int, int] = {}

    @property
    def active(self) -> bool:
        """Whether any token's logit may ever change."""
        return bool(self.bias) or self.penalized

    def apply(self, logits: np.ndarray) -> None:
        self.apply_bias(logits)
        self.apply_penalties(logits)

    def apply_bias(self, logits: np.ndarray) -> None:
        """As C's float arithmetic: a sum past float32's range is inf, not an error. A bias
        that cannot make one of a model's logits overflow (any the API lets through) is
        added without numpy's error state, whose context costs more than the sums."""
        with np.errstate(all="ignore") if self._bias_unbounded else nullcontext():
            for token, bias in self.bias:  # one by one: a token named twice gets both
                logits[token] += bias

    @np.errstate(all="ignore")
    def apply_penalties(self, logits: np.ndarray) -> None:
        """As C's float arithmetic: a penalty that is 0 as a float (5e-324) divides to inf,
        a sum past float32's range is inf, and neither is an error."""
        if not self.penalized or not self.counts:
            return
        ids = np.fromiter(self.counts, dtype=np.intp, count=len(self.counts))
        counts = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
        x = logits[ids]
        x = np.where(x <= 0, x * self.repeat, x / self.repeat)
        logits[ids] = x - (counts * self.frequency + self.presence)

    def may_change(self, token: int) -> bool:
        """Whether the penalties can make a greedy choice other than `token`, the row's
        first highest logit before them (bias applied). Penalties that only ever lower the
        logits they touch (repeat_penalty >= 1, frequency and presence >= 0: the defaults;
        none of them absurdly large) leave a token they do not touch the first highest:
        every other logit stays where it was or falls. So they need writing only when the
        window holds `token`, which in most steps of an answer it does not; that skips the
        row's numpy work, which right after a decode costs ~0.1 ms a token (a 2-core box,
        smollm2 at c=1)."""
        if not self.penalized or not self.counts:
            return False
        return not self.lowers_only or token in self.counts

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
