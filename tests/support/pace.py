"""How fast a live server generates right now, and the time bounds sized from it.

`make test` always runs beside other work, and a box with more runnable threads than cores
generates many times slower than an idle one: two cores under a load of 8 to 10 take about
60 times as long per token (the generation threads are niced, so they lose most of the CPU
to the load). A bound on something that waits for generated tokens is therefore a multiple
of the pace measured on the test's own server, never a constant chosen on an idle box; and
never less than the constant it replaces (its floor), so that on an idle box it is what it
was, and a server that hangs still ends the test.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

from tests.conftest import DEFAULT_MODEL, NO_EOS

# How much slower than measured the box may turn before a bound fires: the load moves while
# a test runs (another module's servers start, a fuzz run begins), and the measured request
# is the cheapest kind (one sequence, a short prompt, no grammar).
SLACK = 20
# The measuring request's own bound, per read: no pace is known yet, so minutes.
MEASURE_TIMEOUT_S = 600.0
PROMPT = "Count to one hundred:"
# The bound of a wait that returns as soon as its condition holds, on work that is not
# generation (a rollout over paper models, a file verified): it only ends a test that
# hangs. Rollout work runs niced (`fleet.rollout_nice`), so beside a load it gets a sliver
# of the CPU, and what takes a tenth of a second on an idle box can take minutes.
SETTLE_S = 300.0


@dataclass(frozen=True)
class Pace:
    """A server's speed as measured: a request's wait for its first token, then each next."""

    first_s: float
    token_s: float

    @classmethod
    def of(cls, start: float, arrivals: Sequence[float]) -> Pace:
        """From a stream's start and its tokens' arrival times (two at least)."""
        if len(arrivals) < 2:
            raise ValueError(f"a pace takes two tokens at least, got {len(arrivals)}")
        return cls(arrivals[0] - start,
                   (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))

    def seconds(self, tokens: int = 1, requests: int = 1) -> float:
        """How long `requests` requests generating `tokens` tokens in all take at this pace,
        one after another (requests that share steps take less)."""
        return requests * self.first_s + tokens * self.token_s

    def bound(self, floor: float, tokens: int = 1, requests: int = 1) -> float:
        """A wait for `requests` requests and `tokens` tokens: SLACK times as long as they
        take at this pace, and `floor` (the bound for an idle box) at least."""
        return max(floor, SLACK * self.seconds(tokens, requests))


def measure(base_url: str, *, tokens: int = 16, model: str = DEFAULT_MODEL,
            headers: Mapping[str, str] | None = None,
            verify: ssl.SSLContext | bool = True) -> Pace:
    """Times one streamed completion (OpenAI dialect) of exactly `tokens` tokens: no
    end-of-generation token can be drawn, so it never ends early. One request of the
    server's open tenant (or of the key in `headers`), written to its ledger like any."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "stream": True, "logit_bias": NO_EOS}
    arrivals: list[float] = []
    start = time.monotonic()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                      headers=dict(headers or {}), verify=verify,
                      timeout=MEASURE_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    arrivals.append(time.monotonic())
    return Pace.of(start, arrivals)
