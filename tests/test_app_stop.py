"""A stop waits for the worker threads the app set going before the stores close.

A thread cannot be cancelled: when a start failed early (a taken port), the lifespan's stop
cancelled the preload task and closed the model store while `ensure_default_model` was still
querying it on its thread, and sqlite3 took the process down. `_in_thread` is the seam every
such piece of work goes through; these hold its promise without a server.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from edge_agent import app


def test_a_cancelled_wait_ends_only_after_its_thread_has() -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        release.wait(30)
        finished.set()

    async def main() -> None:
        task = asyncio.ensure_future(app._in_thread(work))
        assert await asyncio.to_thread(started.wait, 30)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.3)
        assert not done, "the cancellation went on while the thread was still running"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()

    asyncio.run(main())


def test_an_uncancelled_wait_returns_the_threads_result_and_raises_its_error() -> None:
    def fail() -> None:
        raise OSError("disk full")

    async def main() -> None:
        assert await app._in_thread(sum, [1, 2, 3]) == 6
        with pytest.raises(OSError, match="disk full"):
            await app._in_thread(fail)

    asyncio.run(main())
