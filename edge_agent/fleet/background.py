"""A rollout's bulk work — the download with its running sha256, the verification and the
install's hashing copy, the GGUF precheck's child process — runs on a thread of its own at
a lower CPU priority (`fleet.rollout_nice`, +10 by default), so the box's own requests keep
their cores while a release arrives.

The generation threads run `runtime.compute_nice` (5) steps nicer than the rest of the
process, so a rollout's work at the usual priority outranks them (about 3 to 1 for the
CPU): on two cores the longest interval without a token of a running stream reached
0.7–0.9 s while a release downloaded and verified (`edge-agent bench rollout`). At +10 it
is the generation threads that get about 3 parts in 4.

Linux keeps a nice value per thread (`edge_agent.priority`), and the precheck's child
starts with its creator's, so it is covered too. Never on a shared pool thread
(`asyncio.to_thread`'s): the raised value would stay with that thread for the next,
unrelated job.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from edge_agent.priority import lower_thread_priority

T = TypeVar("T")


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
        lower_thread_priority(increment)
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
