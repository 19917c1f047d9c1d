"""A rollout's bulk work on a thread of its own at a lower CPU priority
(`fleet.background`): the result or the error comes back to the awaiting task, the work's
thread (and a child process it starts, as the GGUF precheck does) runs at the raised nice
value, and the event loop's thread and the other threads keep theirs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest

from edge_agent.fleet.background import run_niced
from edge_agent.priority import lower_thread_priority


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_work_runs_niced_and_its_child_too_the_caller_keeps_its_priority() -> None:
    before = _nice()
    if before > 9:
        pytest.skip(f"this process already runs at nice {before}")

    def work() -> tuple[int, int, str]:
        child = subprocess.run(["nice"], capture_output=True, text=True, check=True)
        return _nice(), int(child.stdout), threading.current_thread().name

    seen, child, name = asyncio.run(run_niced(10, work))
    assert (seen, child) == (before + 10, before + 10)
    assert name == "rollout-bulk"
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
