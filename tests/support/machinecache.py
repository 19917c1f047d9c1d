"""What the tests install or fetch once per machine, outside any checkout (client
libraries' environments, .deb files for the booted boxes).

Two test runs on one machine (two clones, each running `make test`) share these folders.
Each is built in a side folder and renamed when complete, under a lock: the second run waits
for the first's build and then uses it, rather than building its own and removing the one
the first is running from.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def root() -> Path:
    """The machine's cache of test environments (XDG_CACHE_HOME, or ~/.cache)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edge-agent-tests"


def built_once(home: Path, complete: str, build: Callable[[Path], None]) -> Path:
    """`home`, made by `build(staging)` unless a complete one is there already; `complete`
    is the path (within it) a finished build holds, and `build` must leave it last."""
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.with_name(f"{home.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / complete).exists():
            staging = home.with_name(f"{home.name}.{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            build(staging)
            shutil.rmtree(home, ignore_errors=True)
            staging.rename(home)
    return home
