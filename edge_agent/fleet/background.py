"""A rollout's bulk work — the download with its running sha256, the verification and the
install's hashing copy, the GGUF precheck's child process — runs on a thread of its own at
a lower CPU priority (`fleet.rollout_nice`, +10 by default), so the box's own requests keep
their cores while a release arrives.

Measured on two cores (`edge-agent bench rollout`): at the default priority the longest
interval without a token of a running stream reached 0.7–0.9 s while a release downloaded
and verified; the decode threads and the rollout's hashing shared the cores equally.

Linux keeps a nice value per thread, and a child process starts with its creator's, so
raising it on this thread covers the precheck's child too. Never on a shared pool thread
(`asyncio.to_thread`'s): the raised value would stay with the thread for the next, unrelated
job. Raising one's own nice needs no privilege; a platform without per-thread priorities
runs the work at the normal priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
MAX_NICE = 19


def lower_priority(increment: int) -> int | None:
    """Raises the calling thread's nice value by `increment` (capped at 19); the new value,
    or None where it cannot (no per-thread priorities)."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return None
    try:
        tid = threading.get_native_id()
        value = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, value)
        return value
    except OSError:
        return None


async def run_niced(increment: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread whose nice value is raised by `increment`;
    awaited like `asyncio.to_thread` (a cancelled wait leaves the thread to finish, as
    to_thread does: the work itself checks for a stop)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return  # the waiter was cancelled
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        lower_priority(increment)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting task, never lost here
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, None, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    # Not a daemon: the interpreter waits for it at exit, as it does for to_thread's pool
    # (a download stops at its next progress report once the runner is stopping).
    threading.Thread(target=work, name="rollout-bulk", daemon=False).start()
    return await done
