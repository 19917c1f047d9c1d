"""`edge_agent.priority`: one thread's nice value raised — the calling thread's or another's
by its id (as the scheduler does for its worker) — capped at 19, the others untouched."""

from __future__ import annotations

import os
import threading

import pytest

from edge_agent.priority import MAX_NICE, lower_thread_priority


def _nice(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


def test_another_thread_by_id_and_the_caller_keeps_its_value() -> None:
    base = _nice()
    if base > 15:
        pytest.skip(f"this process already runs at nice {base}")
    seen: list[int] = []
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(5)
        seen.append(_nice())
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    assert t.native_id is not None
    assert lower_thread_priority(3, t.native_id) == base + 3
    go.set()
    assert done.wait(5)
    t.join()
    assert seen == [base + 3] and _nice() == base


def test_capped_at_19_and_zero_changes_nothing() -> None:
    result: list[int | None] = []
    t = threading.Thread(target=lambda: result.extend(
        [lower_thread_priority(0), lower_thread_priority(100), _nice()]))
    t.start()
    t.join()
    assert result == [None, MAX_NICE, MAX_NICE]
