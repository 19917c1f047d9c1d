"""`edge_agent.priority`: one thread's nice value raised — the calling thread's or another's
by its id (as the scheduler does for its worker) — capped at 19, the others untouched; and
`run_niced`: work on a thread of its own at a raised nice value (and a child process it
starts, as the GGUF probe does), its result or error back to the awaiting task, the event
loop's thread keeping its own value; `call_niced`, the same for a thread that waits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest

from edge_agent.priority import MAX_NICE, call_niced, lower_thread_priority, run_niced


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


def test_the_work_runs_niced_and_its_child_too_the_caller_keeps_its_priority() -> None:
    before = _nice()
    if before > 9:
        pytest.skip(f"this process already runs at nice {before}")

    def work() -> tuple[int, int, str]:
        child = subprocess.run(["nice"], capture_output=True, text=True, check=True)
        return _nice(), int(child.stdout), threading.current_thread().name

    seen, child, name = asyncio.run(run_niced(10, work))
    assert (seen, child) == (before + 10, before + 10)
    assert name == "niced"
    assert _nice() == before  # the loop's thread is untouched


def test_an_error_reaches_the_awaiting_task() -> None:
    def fails() -> None:
        raise ValueError("bad release")

    with pytest.raises(ValueError, match="bad release"):
        asyncio.run(run_niced(10, fails))


def test_arguments_pass_through_and_zero_leaves_the_priority() -> None:
    before = _nice()
    assert asyncio.run(run_niced(0, lambda a, *, b: (a, b, _nice()), 1, b=2)) == (1, 2, before)
    assert lower_thread_priority(0) is None


def test_a_cancelled_wait_leaves_the_work_to_finish_quietly() -> None:
    finished = threading.Event()
    release = threading.Event()

    def slow() -> int:
        release.wait(5)
        finished.set()
        return 1

    async def main() -> None:
        task = asyncio.create_task(run_niced(10, slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert await asyncio.to_thread(finished.wait, 5)
        await asyncio.sleep(0.05)  # its result arrives after the cancel: dropped

    asyncio.run(main())


def test_a_waiting_thread_gets_the_niced_work_back_and_keeps_its_priority() -> None:
    """`call_niced`, as the fleet link's command worker hashes a model for model.verify."""
    before = _nice()
    if before > 9:
        pytest.skip(f"this process already runs at nice {before}")

    def work(a: int, *, b: int) -> tuple[int, int, int, str]:
        child = subprocess.run(["nice"], capture_output=True, text=True, check=True)
        return a, b, _nice(), threading.current_thread().name + f":{int(child.stdout)}"

    assert call_niced(10, work, 1, b=2) == (1, 2, before + 10, f"niced:{before + 10}")
    assert _nice() == before

    def fails() -> None:
        raise ValueError("blob gone")

    with pytest.raises(ValueError, match="blob gone"):
        call_niced(10, fails)
    assert _nice() == before
