"""`edge_agent.engine.runtime.native`: llama.cpp's libraries and CPU features, asked of a child.

The real wheel is checked as it is installed here. The failures are made for real too: a
shared library compiled here that links a library which is then removed (the dynamic
loader's own error, as for a box without libgomp1), a child killed by SIGILL, a build
claiming CPU features a /proc/cpuinfo lacks. A stand-in `llama_cpp` package on PYTHONPATH
plays the wheel in those cases: the seam is the child's import, nothing in the check is
replaced.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.engine.runtime import native

INFO = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 1 | OPENMP = 1 | "


def _python_with(tmp_path: Path, init: str) -> str:
    """A Python whose `import llama_cpp` runs `init` (a wrapper script: the check takes an
    interpreter, as the role gives it the new venv's)."""
    package = tmp_path / "fake" / "llama_cpp"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _linked_to_a_missing_library(lib: Path) -> Path:
    """`lib/libneeds.so`, linked against `libedgeprobe.so.1`, which is then removed."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the probe libraries")
    src = lib / "probe.c"
    src.write_text("int probe(void) { return 1; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libedgeprobe.so.1", "-o",
                    str(lib / "libedgeprobe.so.1"), str(src)], check=True)
    (lib / "libedgeprobe.so").symlink_to("libedgeprobe.so.1")
    (lib / "needs.c").write_text("int probe(void);\nint needs(void) { return probe(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib / "libneeds.so"),
                    str(lib / "needs.c"), f"-L{lib}", "-ledgeprobe"], check=True)
    for name in ("libedgeprobe.so.1", "libedgeprobe.so", "probe.c", "needs.c"):
        (lib / name).unlink()
    return lib / "libneeds.so"


def test_the_installed_wheel_loads_and_runs_on_this_cpu() -> None:
    found = native.check()
    assert found.ok, [p.line() for p in found.problems]
    assert found.version and ("AVX" in found.system_info or "NEON" in found.system_info)
    done = subprocess.run([sys.executable, "-m", "edge_agent.engine.runtime.native"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("llama.cpp runtime: ok (llama-cpp-python ")


def test_a_library_the_box_lacks_is_named_with_its_package(tmp_path: Path) -> None:
    python = _python_with(tmp_path, "import ctypes, os\n"
                          "ctypes.CDLL(os.path.join(os.path.dirname(__file__), 'lib', "
                          "'libneeds.so'))\n")
    _linked_to_a_missing_library(tmp_path / "fake" / "llama_cpp" / "lib")
    found = native.check(python)
    assert [p.detail for p in found.problems] == ["libedgeprobe.so.1 missing"]
    assert "apt-file search libedgeprobe.so.1" in found.problems[0].fix
    done = subprocess.run([sys.executable, "-m", "edge_agent.engine.runtime.native", python],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [found.problems[0].line()]


def test_a_library_loaded_later_than_the_import_is_found_by_ldd(tmp_path: Path) -> None:
    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    python = _python_with(tmp_path, f"__version__ = '0.0'\n"
                          f"def llama_print_system_info():\n    return {INFO!r}.encode()\n")
    _linked_to_a_missing_library(tmp_path / "fake" / "llama_cpp" / "lib")
    found = native.check(python, cpuinfo=Path("/proc/cpuinfo"))
    assert "libedgeprobe.so.1 missing" in [p.detail for p in found.problems]


def test_the_known_libraries_name_their_debian_package() -> None:
    assert native.package_hint("libgomp.so.1") == "apt-get install libgomp1"
    assert native.package_hint("libstdc++.so.6") == "apt-get install libstdc++6"
    assert "CUDA runtime" in native.package_hint("libcudart.so.12")


def test_a_build_for_features_the_cpu_lacks_is_refused(tmp_path: Path) -> None:
    python = _python_with(tmp_path, f"__version__ = '0.0'\n"
                          f"def llama_print_system_info():\n    return {INFO!r}.encode()\n")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 pni ssse3 avx avx2 fma\n")
    found = native.check(python, cpuinfo=cpuinfo)
    assert [p.detail for p in found.problems] == [
        "built for CPU features this CPU lacks: AVX512 (it would stop with SIGILL)"]
    cpuinfo.write_text("flags\t\t: fpu pni ssse3 avx avx2 fma avx512f\n")
    assert native.check(python, cpuinfo=cpuinfo).ok


def test_a_child_stopped_by_sigill_says_so(tmp_path: Path) -> None:
    python = _python_with(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    found = native.check(python)
    assert len(found.problems) == 1
    assert found.problems[0].detail.startswith("stopped by SIGILL while loading")
    assert "wheelhouse" in found.problems[0].fix


def test_an_interpreter_that_cannot_run_is_said_plainly() -> None:
    found = native.check("/nonexistent/python")
    assert found.problems[0].detail.startswith("cannot run /nonexistent/python")


def test_doctor_names_a_missing_runtime_library_and_goes_on(tmp_path: Path) -> None:
    """The doctor itself never imports llama_cpp first: it reports the failure as a
    check and finishes the others (exit 1)."""
    _python_with(tmp_path, "import ctypes, os\n"
                 "ctypes.CDLL(os.path.join(os.path.dirname(__file__), 'lib', 'libneeds.so'))\n")
    _linked_to_a_missing_library(tmp_path / "fake" / "llama_cpp" / "lib")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    done = subprocess.run([sys.executable, "-m", "edge_agent", "doctor", "--state-dir",
                           str(tmp_path / "state")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert ("fail  llama.cpp runtime: libedgeprobe.so.1 missing — fix: install the package "
            "that ships libedgeprobe.so.1 (apt-file search libedgeprobe.so.1)") in lines
    assert any(line.split(":")[0].endswith(" ledger") for line in lines)  # the rest ran
    assert "Traceback" not in done.stderr
