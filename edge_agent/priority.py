"""Lowering one thread's CPU priority: the generation threads (`runtime.compute_nice`, so
the HTTP side keeps a core) and a rollout's bulk work (`fleet.rollout_nice`, so requests
keep theirs while a release arrives).

Linux keeps a nice value per thread, and a thread (or process) started from one begins at
its creator's value — the llama.cpp threads a generation thread starts, the GGUF precheck's
child a rollout's thread starts. Raising one's own nice value needs no privilege; a
platform without per-thread priorities, or a sandbox that refuses, runs at the usual one.
"""

from __future__ import annotations

import os
import threading

MAX_NICE = 19


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
