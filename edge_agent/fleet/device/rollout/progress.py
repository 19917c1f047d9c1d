"""Download progress as the fleet link carries it: which of a download's progress calls
(the transfer makes one every 0.25 s) become `rollout.progress` audit messages.

Progress goes as AUDIT, which the outbox never drops, so what it costs is the link's:
hundreds of boxes on a slow WAN, each reporting four times a second, would crowd out
everything else. A box sends the first report, then at most one every
`fleet.progress_interval_s`, and the last: the finished download (`offer` sends it), or
whatever a download reached when it stopped (`held` gives what was kept back). The local
callback keeps the transfer's pace (a cancel is still noticed within a chunk); only what
is sent is thinned.

The figures: `bytes` and `total`, `rate_bps` (bytes a second over this attempt, not
counting what a resumed part already held) and `eta_s` (None until a rate is known).
Pure: the clock is injected; no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Figures = dict[str, Any]


class ProgressThrottle:
    """One download attempt's reports: `offer(done, total)` for every call, each
    answering the figures to send now or None (kept back); `held()` at the end."""

    def __init__(self, interval_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._first: tuple[float, int] | None = None  # (when, bytes) of the first call
        self._sent_at: float | None = None
        self._held: Figures | None = None

    def offer(self, done: int, total: int) -> Figures | None:
        now = self.clock()
        if self._first is None:
            self._first = (now, done)
        since, start = self._first
        rate = (done - start) / (now - since) if now > since else 0.0
        eta = (total - done) / rate if rate > 0 else None
        figures = {"bytes": done, "total": total, "rate_bps": round(rate),
                   "eta_s": round(eta, 1) if eta is not None else None}
        if self._sent_at is None or done >= total or now - self._sent_at >= self.interval_s:
            self._sent_at, self._held = now, None
            return figures
        self._held = figures
        return None

    def held(self) -> Figures | None:
        """The newest figures `offer` kept back (None if the last call was sent): what a
        download that stopped short reached. Given once."""
        held, self._held = self._held, None
        return held
