"""The benchmark's load driver, with a stand-in peer (the peers themselves are real
servers, exercised by `make bench`)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

from edge_agent.bench.peers import Sample
from edge_agent.bench.run import request_scaling, run_levels
from edge_agent.engine.catalog import ModelStore
from tests.conftest import DEFAULT_MODEL


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.active = 0
        self.peak: list[int] = []
        self._lock = threading.Lock()

    def chat(self, messages: list[dict[str, str]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> Sample:
        with self._lock:
            self.active += 1
            self.peak.append(self.active)
        sample = Sample(start=time.perf_counter())
        time.sleep(0.01)
        sample.arrivals = [time.perf_counter() + i * 1e-4 for i in range(max_tokens)]
        with self._lock:
            self.active -= 1
        return sample

    def close(self) -> None:
        pass


def test_levels_take_turns_and_each_gets_eight_requests() -> None:
    peer = _Recorder()
    loads = run_levels(peer, [1, 4, 8], 3, 2, {})
    assert {c: len(load.samples) for c, load in loads.items()} == {1: 8, 4: 8, 8: 16}
    # Bursts alternate: the first c=1 burst ran before the first c=8 burst, and the last
    # c=1 burst after it.
    ones = sorted(s.start for s in loads[1].samples)
    eights = sorted(s.start for s in loads[8].samples)
    assert ones[0] < eights[0] < ones[-1]
    assert max(peer.peak) == 8
    assert all(load.tokens_per_s > 0 for load in loads.values())


def test_request_shaped_ceiling_runs_the_real_engine(model_cache: Path) -> None:
    path = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    for cached in (0, 6):
        ratio = request_scaling(path, threads=2, rows=3, tokens=4, prefill=5, cached=cached,
                                rounds=1)
        # Three requests at once: faster in aggregate than one, never three times as fast
        # (each of their prompts costs what one alone costs).
        assert math.isfinite(ratio) and 1.0 < ratio < 3.0
