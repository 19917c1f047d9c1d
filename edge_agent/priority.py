"""Lowering one thread's CPU priority: the generation threads (`runtime.compute_nice`, so
the HTTP side keeps a core), and work that must not take the cores from them — a
rollout's download, verification and precheck (`fleet.rollout_nice`), a load's digest check
and GGUF probe (`run_niced`), a `model.verify`'s hash on the fleet link's command worker
(`call_niced`).

The generation threads run `compute_nice` (5) steps nicer than the rest of the process, so
work at the usual priority outranks them about 3 to 1 for the CPU: on two cores the longest
interval without a token of a running stream reached 0.7–0.9 s while a release downloaded
and verified at the usual priority (`edge-agent bench rollout`). At +10 the generation
threads get about 3 parts in 4.

Linux keeps a nice value per thread, and a thread (or process) started from one begins at
its creator's value — the llama.cpp threads a generation thread starts, the GGUF probe's
child a niced thread starts. So `run_niced` uses a thread of its own, never a shared pool
thread (`asyncio.to_thread`'s): the raised value would stay with that thread for the next,
unrelated job; and never for work that starts long-lived threads (a model's scheduler),
which would keep the value. Raising one's own nice value needs no privilege; a platform
without per-thread priorities, or a sandbox that refuses, runs at the usual one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

MAX_NICE = 19
BACKGROUND_NICE = 10  # checks that may wait: a load's digest and probe
T = TypeVar("T")


def lower_thread_priority(increment: int, tid: int | None = None) -> int | None:
    """Raises thread `tid`'s (default: the calling thread's) nice value by `increment`,
    capped at 19. The new value; None if `increment` is 0 or it cannot be done."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return None
    thread = threading.get_native_id() if tid is None else tid
    try:
        value = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, thread) + increment)
        os.setpriority(os.PRIO_PROCESS, thread, value)
    except OSError:
        return None
    return value


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
    threading.Thread(target=work, name="niced", daemon=False).start()
    return await done


def call_niced(increment: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`run_niced` for a caller on a thread of its own that waits anyway (the fleet link's
    command worker): `fn` on a new thread whose nice value is raised by `increment`, and
    its result or its exception here once it is done. The caller's thread keeps its own
    value for the work it does next."""
    outcome: list[tuple[T | None, BaseException | None]] = []

    def work() -> None:
        lower_thread_priority(increment)
        try:
            outcome.append((fn(*args, **kwargs), None))
        except BaseException as exc:  # raised again on the caller's thread
            outcome.append((None, exc))

    thread = threading.Thread(target=work, name="niced", daemon=False)
    thread.start()
    thread.join()
    result, error = outcome[0]
    if error is not None:
        raise error
    return cast(T, result)
