"""Stopping the processes a test started, in the order that leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop_in_reverse(procs: Iterable[subprocess.Popen[bytes] | subprocess.Popen[str]]) -> None:
    """SIGTERM each, the last started first (a controller before its broker, so it does not
    spend its drain reconnecting); one that has not left within 30 s is killed."""
    for proc in reversed(list(procs)):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
