"""How many of its cores the box's other software leaves the model: the threads a decode
should use.

llama.cpp's threads meet at a barrier after every operation of a pass; with OpenMP's
default policy each one that arrives first spins there. On a store's PC other software
(the till, a backup) takes a core now and then: a compute thread that shares its core
with it is descheduled for a time slice while its partner spins, and the pass takes
slices instead of microseconds. On a 2-core box with one core kept busy by another process,
`llama-bench -t 2 -n 32` on the default model gave 66 tokens/s, against 207 quiet; with one
thread, 180 (measured quiet: 177). OpenMP's passive wait policy (the spinning threads
sleep) gave 104 beside the busy core but 58 quiet, and short spin counts
(`GOMP_SPINCOUNT` 1,000 to 100,000) 46-66 beside it: only fewer threads than cores taken
keeps decode in proportion to the CPU left.

So before each pass the scheduler asks `threads`: the configured threads less the cores
other processes kept busy over the last second or so (all CPU time on the box, from
/proc/stat, less this process's own), never fewer than one. After a pause in decoding the
window starts again, a quarter of a second long the first time: what others did while
this process was idle (a second server answering in turn, a batch job in the night) is no
measure of what they take from it now. A core counts as taken from
0.4 of it on (a busy process sharing a core with one of ours gets only about half of it),
and given back once the others use 0.7 of a core less than was counted taken, so the
count does not flap around a boundary. Where /proc/stat cannot be read, the threads stay
as configured.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

# The share of a core other processes must keep busy for it to count as taken, and the
# margin below the count they must fall to for a core to be given back.
TAKEN_FROM = 0.4
GIVEN_BACK_BELOW = 0.7
INTERVAL_S = 1.0
# After a pause the first sample comes this share of an interval after the baseline, and
# a pause is a gap of this many intervals between two calls.
FIRST_SAMPLE = 0.25
IDLE_AFTER = 2


def busy_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds spent busy on every core since boot (user, nice, system, irq, softirq,
    steal: all but idle and iowait), or None where /proc/stat cannot be read."""
    try:
        with stat.open() as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class FreeCores:
    """The threads a decode should use now (see the module's docstring). Read by the
    scheduler's worker thread only; `taken` is for anyone to read."""

    def __init__(self, threads: int, *, interval_s: float = INTERVAL_S,
                 busy: Callable[[], float | None] = busy_seconds,
                 own: Callable[[], float] = own_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.configured = threads
        self.taken = 0  # cores counted as taken by other processes
        self.others = 0.0  # their cores' worth of CPU over the last interval
        self._interval = interval_s
        self._busy, self._own, self._clock = busy, own, clock
        self._last: tuple[float, float, float] | None = None
        self._due = 0.0  # when the next sample is taken

    def threads(self) -> int:
        now = self._clock()
        if self._last is not None and now - self._last[0] > IDLE_AFTER * self._interval:
            # Back from a pause (no decode asked): what the others did meanwhile, while
            # this process did not compete, says nothing of now. Measure afresh, briefly.
            self._last = None
        if self._last is None:
            self._sample(now)
            self._due = now + FIRST_SAMPLE * self._interval
        elif now >= self._due:
            self._sample(now)
            self._due = now + self._interval
        return max(1, self.configured - self.taken)

    def _sample(self, now: float) -> None:
        busy = self._busy()
        if busy is None:
            return
        own = self._own()
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
        self.others = others
        taken = min(self.configured - 1, math.floor(others + 1 - TAKEN_FROM))
        if taken > self.taken or others <= self.taken - GIVEN_BACK_BELOW:
            self.taken = max(0, taken)
