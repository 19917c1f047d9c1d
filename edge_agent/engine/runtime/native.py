"""Whether llama.cpp's native libraries can run on this box, asked of a child process.

llama-cpp-python is a wheel of shared libraries built on another machine (the wheelhouse).
Two things about it are only found on the box itself, and both used to be found by the
service failing at start, restarting every 10 s, with the reason in the journal only:

- a library it links that the box lacks: `libgomp.so.1` (OpenMP, Debian's `libgomp1`) is not
  in a minimal Debian or Ubuntu install; a CUDA build needs the CUDA runtime;
- CPU features it was compiled for that the CPU lacks: a build made with `GGML_NATIVE` on an
  AVX-512 machine dies with SIGILL on an AVX2 store box.

So the import happens in a child (`python -c 'import llama_cpp'`): a missing library is an
OSError there and a wrong CPU a signal, neither of which may take down the caller (doctor,
the role's preflight). The child reports llama.cpp's own system info (the CPU features the
build has); those are compared with /proc/cpuinfo. The libraries are also read with `ldd`
where it exists, for one loaded later than at import. This module never imports llama_cpp
itself.

`python -m edge_agent.engine.runtime.native [PYTHON]` prints one line per problem and exits
1, or one `ok` line and exits 0: what the Ansible role's preflight runs with the new venv's
Python, as the service user, before anything is started.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

NAME = "llama.cpp runtime"
_CHILD = (
    "import json, os, llama_cpp\n"
    "lib = os.path.join(os.path.dirname(llama_cpp.__file__), 'lib')\n"
    "print(json.dumps({'version': getattr(llama_cpp, '__version__', '?'), 'lib': lib,\n"
    "                  'system_info': llama_cpp.llama_print_system_info().decode()}))\n"
)
_MISSING = re.compile(r"([\w.+-]+\.so(?:\.\d+)*): cannot open shared object file")
_NOT_FOUND = re.compile(r"^\s*(\S+) => not found", re.M)

# The Debian/Ubuntu package that ships a library a llama.cpp build links.
PACKAGES: Mapping[str, str] = {
    "libgomp.so.1": "libgomp1",
    "libstdc++.so.6": "libstdc++6",
    "libgcc_s.so.1": "libgcc-s1",
    "libopenblas.so.0": "libopenblas0",
    "libvulkan.so.1": "libvulkan1",
}
_CUDA = re.compile(r"lib(cudart|cublas|cublasLt|cuda)\.so")
_FLOOR = ("build the wheelhouse with the CPU floor of this box "
          "(docs/install/wheelhouse.md)")

# llama.cpp's system-info names -> the /proc/cpuinfo flag that says the CPU has it.
CPU_FLAGS: Mapping[str, str] = {
    "SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "AVX_VNNI": "avx_vnni",
    "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8", "NEON": "asimd", "ARM_FMA": "asimd", "FP16_VA": "asimdhp",
    "DOTPROD": "asimddp", "MATMUL_INT8": "i8mm", "SVE": "sve", "SME": "sme",
}


@dataclass(frozen=True)
class Problem:
    detail: str  # what is wrong: "libgomp.so.1 missing"
    fix: str = ""  # what to do: "apt-get install libgomp1"

    def line(self) -> str:
        return f"{NAME}: {self.detail}" + (f" ({self.fix})" if self.fix else "")


@dataclass(frozen=True)
class Runtime:
    """What the child found: `problems` empty means llama.cpp loads and can run here."""

    problems: list[Problem] = field(default_factory=list)
    version: str = ""
    system_info: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def package_hint(library: str) -> str:
    """How to get `library` on a Debian/Ubuntu box, in a few words."""
    if library in PACKAGES:
        return f"apt-get install {PACKAGES[library]}"
    if _CUDA.match(library):
        return ("install the NVIDIA driver and CUDA runtime the wheel was built for, or use "
                "the CPU wheelhouse")
    return f"install the package that ships {library} (apt-file search {library})"


def built_features(system_info: str) -> set[str]:
    """The CPU features llama.cpp says it was built with (`AVX2 = 1 | …`)."""
    found = set()
    for part in system_info.replace(":", "|").split("|"):
        key, _, value = part.partition("=")
        if value.strip() == "1":
            found.add(key.strip())
    return found


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (`flags` on x86, `Features` on
    ARM)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def missing_features(system_info: str, flags: set[str]) -> list[str]:
    """The features the build uses that the CPU lacks, as llama.cpp names them (nothing
    when the CPU's flags could not be read: no guessing)."""
    if not flags:
        return []
    return sorted(f for f in built_features(system_info)
                  if f in CPU_FLAGS and CPU_FLAGS[f] not in flags)


def check(python: str = sys.executable, *, timeout_s: float = 120.0,
          cpuinfo: Path = Path("/proc/cpuinfo")) -> Runtime:
    """Imports llama_cpp with `python` in a child process and says what stops it."""
    try:
        done = subprocess.run([python, "-c", _CHILD], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Runtime([Problem(f"importing llama_cpp took over {timeout_s:.0f} s")])
    except OSError as exc:
        return Runtime([Problem(f"cannot run {python}: {exc.strerror or exc}")])
    if done.returncode != 0:
        return Runtime([_failure(done.returncode, done.stderr)])
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        lib, version, info = Path(found["lib"]), str(found["version"]), found["system_info"]
    except (ValueError, IndexError, KeyError, TypeError):
        return Runtime([Problem("llama_cpp imported but said nothing readable")])
    problems = [Problem(f"{name} missing", package_hint(name)) for name in _unresolved(lib)]
    try:
        flags = cpu_flags(cpuinfo.read_text())
    except OSError:
        flags = set()
    lacking = missing_features(info, flags)
    if lacking:
        problems.append(Problem(f"built for CPU features this CPU lacks: {', '.join(lacking)} "
                                "(it would stop with SIGILL)", _FLOOR))
    return Runtime(problems, version, info)


def _failure(returncode: int, stderr: str) -> Problem:
    if returncode == -signal.SIGILL:
        return Problem("stopped by SIGILL while loading: built for CPU features this CPU "
                       "lacks", _FLOOR)
    if returncode < 0:
        return Problem(f"stopped by signal {signal.Signals(-returncode).name} while loading")
    missing = _MISSING.search(stderr)
    if missing:
        return Problem(f"{missing.group(1)} missing", package_hint(missing.group(1)))
    if "No module named 'llama_cpp'" in stderr:
        return Problem("llama-cpp-python is not installed for this Python",
                       "install edge-agent's wheelhouse into this venv")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {returncode}"
    return Problem(f"importing llama_cpp failed: {last[:300]}")


def _unresolved(lib: Path) -> list[str]:
    """Sonames `ldd` cannot resolve for the wheel's libraries (none where ldd is absent)."""
    ldd = shutil.which("ldd")
    if ldd is None or not lib.is_dir():
        return []
    missing: set[str] = set()
    for so in sorted(lib.glob("*.so*")):
        if so.is_symlink():
            continue
        try:
            out = subprocess.run([ldd, str(so)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        missing.update(_NOT_FOUND.findall(out.stdout))
    return sorted(missing)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    found = check(args[0] if args else sys.executable)
    if found.ok:
        cpu = sorted(built_features(found.system_info) & set(CPU_FLAGS))
        print(f"{NAME}: ok (llama-cpp-python {found.version}; CPU: {' '.join(cpu) or '-'})")
        return 0
    for problem in found.problems:
        print(problem.line())
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
