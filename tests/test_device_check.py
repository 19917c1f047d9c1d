"""`make device-check` on a machine without an NVIDIA GPU: it says so and succeeds."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_without_an_nvidia_gpu_the_device_check_says_so_and_succeeds(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices were found' >&2\nexit 9\n")
    smi.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "tools" / "device_check.sh")], text=True,
                         capture_output=True, timeout=60, cwd=tmp_path, check=False,
                         env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
                              "OUT": str(tmp_path / "out")})
    assert out.returncode == 0, out.stderr
    assert "no NVIDIA GPU on this machine" in out.stdout
    assert not (ROOT / ".device-build").exists()  # nothing built
