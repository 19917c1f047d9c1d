"""Checks that the llama.cpp in a wheelhouse keeps to the CPU floor it is meant for.

A llama-cpp-python wheel compiled without `-DGGML_NATIVE=OFF`, or taken from pip's wheel cache
(which does not key on CMAKE_ARGS) after a native build, uses every instruction of the machine
that built it: built on an AVX-512 machine, it stops with SIGILL on an AVX2 store box, and
nothing in its name says so. This reads the shared libraries of the wheelhouse's
llama-cpp-python wheel with `objdump -d` and, for the floor `avx2`, refuses any AVX-512
instruction: a zmm register, an opmask register (k0-k7) or xmm/ymm 16-31 (which only the
AVX-512 encoding reaches). Libraries of a build with one CPU backend per CPU kind
(`libggml-cpu-<kind>.so`, chosen at run time by the CPU's features) are left out.

    python3 wheelhouse_check.py WHEELHOUSE [--floor avx2]

Exit status 0: within the floor; 1: instructions above it (counted per library); 2: no
llama-cpp-python wheel in WHEELHOUSE, or no objdump (Debian: binutils). Standard library
only: it runs where the wheelhouse is built.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Per floor: what an instruction may not use, as objdump (AT&T syntax) writes it.
ABOVE_FLOOR = {
    "avx2": re.compile(r"%zmm\d+|%k[0-7]\b|%[xy]mm(?:1[6-9]|2\d|3[01])\b"),
}
_VARIANT = re.compile(r"libggml-cpu-[\w-]+\.so")


def scan(library: Path, floor: str, objdump: str) -> tuple[int, str]:
    """How many instructions of `library` are above `floor`, and the first of them."""
    pattern = ABOVE_FLOOR[floor]
    count, first = 0, ""
    with subprocess.Popen([objdump, "-d", "--no-show-raw-insn", str(library)],
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if pattern.search(line):
                count += 1
                first = first or " ".join(line.split()[1:])
    return count, first


def check(wheelhouse: Path, floor: str) -> int:
    objdump = shutil.which("objdump")
    wheels = sorted(wheelhouse.glob("llama_cpp_python-*.whl"))
    if objdump is None or not wheels:
        print(f"wheelhouse check: {'no objdump (apt-get install binutils)' if objdump is None else f'no llama_cpp_python wheel in {wheelhouse}'}")
        return 2
    worst = 0
    for wheel in wheels:
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
            # A wheel holds each library under its three names (no symlinks): read one copy.
            copies: dict[tuple[int, int], str] = {}
            for info in archive.infolist():
                name = Path(info.filename).name
                if re.search(r"\.so(\.\d+)*$", name) and not _VARIANT.match(name):
                    copies.setdefault((info.CRC, info.file_size), info.filename)
            names = sorted(copies.values(), key=len)
            for name in names:
                library = Path(archive.extract(name, tmp))
                count, first = scan(library, floor, objdump)
                if count:
                    worst = 1
                    print(f"wheelhouse check: {wheel.name}: {Path(name).name}: {count} "
                          f"instructions above the {floor} floor (AVX-512), e.g. `{first}`: "
                          "rebuild with docs/install/wheelhouse.md's CMAKE_ARGS and --no-cache-dir")
            if not worst:
                print(f"wheelhouse check: {wheel.name}: {len(names)} libraries within the "
                      f"{floor} floor")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheelhouse", type=Path)
    parser.add_argument("--floor", choices=sorted(ABOVE_FLOOR), default="avx2")
    args = parser.parse_args(argv)
    return check(args.wheelhouse, args.floor)


if __name__ == "__main__":
    sys.exit(main())
