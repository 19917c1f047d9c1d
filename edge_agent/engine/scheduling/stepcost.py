"""What one prompt token costs to prefill, as a function of how deep in its sequence it
sits: the scheduler sizes prompt chunks with it, so a long prompt delays running streams
by a bounded factor.

A token's cost grows with the cells it attends to. On a CPU with flash attention a chunk
of a few dozen tokens 1,000 cells deep costs about 1.6x what it costs 100 cells deep, so
an average over recent chunks lags behind a prompt that is still growing, and the last,
deepest chunks overshoot their budget. A line through recent (depth, cost) pairs, with
older pairs fading, follows it.
"""

from __future__ import annotations

# How much each older chunk still weighs; about the last ten chunks count.
FORGET = 0.85
# Before any chunk was measured: a small model on a 2-core CPU.
DEFAULT_TOKEN_S = 0.004


class PrefillCost:
    """Exponentially weighted least squares of seconds per prompt token on depth."""

    def __init__(self, initial_s: float = DEFAULT_TOKEN_S) -> None:
        self._w = 0.0
        self._x = 0.0
        self._y = 0.0
        self._xx = 0.0
        self._xy = 0.0
        self._initial = initial_s

    def observe(self, tokens: int, depth: float, seconds: float) -> None:
        """A prompt pass of `tokens` tokens whose middle sat `depth` cells deep."""
        if tokens <= 0:
            return
        y = seconds / tokens
        f = FORGET
        self._w = f * self._w + 1.0
        self._x = f * self._x + depth
        self._y = f * self._y + y
        self._xx = f * self._xx + depth * depth
        self._xy = f * self._xy + depth * y

    def slope(self) -> float:
        """Extra seconds per token per cell of depth (never negative)."""
        spread = self._w * self._xx - self._x * self._x
        if self._w < 2 or spread <= 1e-9 * max(1.0, self._w * self._xx):
            return 0.0
        return max(0.0, (self._w * self._xy - self._x * self._y) / spread)

    def per_token(self, depth: float) -> float:
        """Predicted seconds per prompt token with its middle `depth` cells deep."""
        if self._w == 0:
            return self._initial
        b = self.slope()
        a = (self._y - b * self._x) / self._w
        mean = self._y / self._w
        # Never below a tenth of the mean: a steep line must not promise free tokens.
        return max(a + b * depth, 0.1 * mean, 1e-6)
