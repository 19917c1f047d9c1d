"""Fewer decode threads while other processes keep cores busy (`runtime.free_cores`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.engine.runtime.free_cores import FreeCores, busy_seconds
from tests.support.fleetkit import wait_until


class _Box:
    """A fake box: the seconds every core and this process were busy, and a clock."""

    def __init__(self) -> None:
        self.busy = self.own = self.now = 0.0

    def run(self, seconds: float, *, others: float, own: float) -> None:
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own


def _cores(box: _Box, threads: int = 4) -> FreeCores:
    return FreeCores(threads, busy=lambda: box.busy, own=lambda: box.own,
                     clock=lambda: box.now)


def test_a_core_counts_taken_from_four_tenths_and_comes_back_below_a_margin() -> None:
    box = _Box()
    cores = _cores(box)
    assert cores.threads() == 4
    box.run(1.0, others=0.2, own=4.0)  # a client, the till idling
    assert cores.threads() == 4
    box.run(1.0, others=0.5, own=3.5)  # a busy process sharing a core with one of ours
    assert cores.threads() == 3 and cores.taken == 1
    box.run(1.0, others=1.0, own=3.0)  # it has its core now
    assert cores.threads() == 3
    box.run(1.0, others=0.4, own=3.0)  # less, but not 0.7 below: no flapping
    assert cores.threads() == 3
    box.run(1.0, others=2.6, own=1.4)
    assert cores.threads() == 1  # three taken
    box.run(1.0, others=9.0, own=1.0)
    assert cores.threads() == 1  # never none
    box.run(1.0, others=0.1, own=4.0)
    assert cores.threads() == 4
    box.run(0.2, others=3.0, own=1.0)  # within the interval: not sampled yet
    assert cores.threads() == 4
    box.run(1.0, others=3.0, own=1.0)
    assert cores.threads() == 1
    # A pause: another program ran flat out while this one decoded nothing; then it
    # stopped. A fresh, short window sees the box as it is now.
    box.run(30.0, others=4.0, own=0.0)
    assert cores.threads() == 1  # the baseline is taken, nothing judged yet
    box.run(0.25, others=0.1, own=4.0)
    assert cores.threads() == 4


def test_without_proc_stat_the_threads_stay_as_configured(tmp_path: Path) -> None:
    assert busy_seconds(tmp_path / "missing") is None
    cores = FreeCores(2, busy=lambda: None)
    assert cores.threads() == 2 and cores.threads() == 2
    assert busy_seconds() is not None  # this machine's


@pytest.fixture
def hog() -> Iterator[None]:
    """A process keeping one core busy, as a till or a backup would."""
    proc = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\n"
                             "while True:\n    pass\n"])
    yield
    proc.kill()
    proc.wait()


@pytest.mark.integration
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_beside_a_busy_core_the_model_decodes_with_one_thread_fewer(
        model_path: Path, hog: None) -> None:
    from edge_agent.engine.runtime.llama import LlamaModel
    from edge_agent.engine.scheduling.scheduler import ModelScheduler
    from tests.test_scheduler import _job

    threads = len(os.sched_getaffinity(0))
    sched = ModelScheduler(LlamaModel(model_path, n_gpu_layers=0), parallel=1,
                           n_ctx_seq=512, n_batch=256, n_threads=threads, embed_ctx=256,
                           max_queue=8, prefill_chunk=64, aging_s=10.0,
                           threads_follow_load=True)
    try:
        def decoding() -> bool:
            job, out = _job(sched, "The lighthouse keeper climbed", max_tokens=48)
            sched.submit(job)
            out.result()
            return sched.threads_now < threads

        assert wait_until(decoding, timeout=60)
        assert sched.free_cores is not None and sched.free_cores.others >= 0.4
    finally:
        sched.close()
