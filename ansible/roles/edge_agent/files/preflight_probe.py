"""What the edge_agent role's preflight needs from the box, as one JSON object (`free_mb`:
the free MiB under each path given, in order).

Run by `ansible.builtin.script` with the Python the virtual environment will be made from,
so its version is the one that counts. Reads only: /proc/meminfo, /proc/cpuinfo and the
free space of the file systems under the given paths.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 0


def cpu_flags() -> list[str]:
    # x86 says "flags", arm64 "Features"; the first processor's line speaks for all.
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return value.split()
    return []


def has_venv() -> bool:
    try:
        import ensurepip  # noqa: F401  (Debian ships it in python3-venv)
        import venv  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    print(json.dumps({
        "python": list(sys.version_info[:3]),
        "venv": has_venv(),
        "machine": platform.machine(),
        "mem_total_mb": mem_total_mb(),
        "cpu_flags": cpu_flags(),
        "free_mb": [shutil.disk_usage(nearest_existing(p)).free // 2**20 for p in paths],
    }))


if __name__ == "__main__":
    main()
