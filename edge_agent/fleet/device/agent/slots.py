"""Agent versions side by side in `fleet.agent_releases_dir`, and the `current` link.

    0.2.0/            python -m venv, then pip install --no-index from the release's
                      verified wheelhouse; `.installed` written last
    .wheelhouse-0.2.0/  the wheelhouse unpacked for the install, removed after it
    current -> 0.2.0  replaced by rename (a new link beside it, then `os.replace`): every
                      reader sees the old target or the new one

A directory without `.installed` is an install a kill cut: removed and done again, never
run. The base install (the role's prefix) is no directory here: `current` absent means it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from edge_agent.fleet.protocol.agent_release import AgentManifest

CURRENT = "current"
MARKER = ".installed"
PIP_TIMEOUT_S = 1800.0
CHECK_TIMEOUT_S = 300.0


class InstallFailed(Exception):
    """The release did not install or llama.cpp does not load there; the message says
    which step and its last lines."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step


class Slots:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, version: str) -> Path:
        return self.root / version

    def installed(self, version: str) -> bool:
        return (self.path(version) / MARKER).is_file()

    def current(self) -> str | None:
        """The version `current` names (None: the base install)."""
        try:
            return os.readlink(self.root / CURRENT)
        except OSError:
            return None

    def switch(self, version: str | None) -> None:
        """`current` → `version` (None: removed, the base install runs), atomically."""
        link = self.root / CURRENT
        if version is None:
            link.unlink(missing_ok=True)
        else:
            tmp = self.root / f".{CURRENT}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            os.symlink(version, tmp)
            os.replace(tmp, link)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def running(self) -> str | None:
        """The version this process runs (None: not one of these)."""
        prefix = Path(sys.prefix).resolve()
        return prefix.name if prefix.parent == self.root.resolve() else None

    def install(self, tar: Path, manifest: AgentManifest, *,
                python: str | None = None) -> Path:
        """The release installed in its own venv and checked there (llama.cpp imported
        by its Python, as the role checks a first install); InstallFailed naming the step.
        Idempotent: an install already finished is kept, one a kill cut is redone."""
        version = manifest.version
        dest = self.path(version)
        if self.installed(version):
            return dest
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        wheels = self.root / f".wheelhouse-{version}"
        shutil.rmtree(wheels, ignore_errors=True)
        try:
            wheels.mkdir(mode=0o700)
            _unpack(tar, wheels)
            base = python or _base_python()
            _run("venv", [base, "-m", "venv", str(dest)], CHECK_TIMEOUT_S)
            env = {**os.environ, "PIP_CONFIG_FILE": os.devnull,
                   "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
            _run("pip install", [str(dest / "bin" / "python"), "-I", "-m", "pip", "install",
                                 "--no-index", "--no-cache-dir", "--find-links", str(wheels),
                                 "--quiet", manifest.requirement], PIP_TIMEOUT_S, env)
            # -I: this venv's own packages only (not the working directory's, nor
            # PYTHONPATH's): what the service will import there.
            _run("llama.cpp check", [str(dest / "bin" / "python"), "-I", "-m",
                                     "edge_agent.engine.runtime.native"], CHECK_TIMEOUT_S)
            (dest / MARKER).write_text(version + "\n", encoding="utf-8")
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(wheels, ignore_errors=True)
        return dest

    def prune(self, keep: set[str | None]) -> list[str]:
        """Versions installed here other than `keep` removed (and what a kill left)."""
        gone: list[str] = []
        if not self.root.is_dir():
            return gone
        for entry in self.root.iterdir():
            if entry.name == CURRENT or entry.is_symlink() or entry.name in keep:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                gone.append(entry.name)
        return gone


def _unpack(tar: Path, dest: Path) -> None:
    """The wheelhouse's files into `dest`: plain files with plain names only (what
    `add-agent` packs), anything else refused; by hand, as Python before 3.11.4 (Debian
    12's) has no extraction filter."""
    try:
        with tarfile.open(tar) as archive:
            for member in archive:
                name = member.name
                if not member.isfile() or "/" in name or name.startswith(".") or not name:
                    raise InstallFailed("unpack", f"{name[:80]!r} is not a wheel's plain "
                                        "file name")
                source = archive.extractfile(member)
                assert source is not None
                with source, (dest / name).open("xb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    except (tarfile.TarError, OSError) as exc:
        raise InstallFailed("unpack", str(exc)[:300]) from None


def _base_python() -> str:
    """The interpreter the running venv was made from (a venv of a venv would point its
    `home` at the first one's bin, which a later prune removes)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _run(step: str, argv: list[str], timeout_s: float,
         env: dict[str, str] | None = None) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallFailed(step, str(exc)[:300]) from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-4:]
        raise InstallFailed(step, " | ".join(tail)[:500] or f"exit {done.returncode}")
