"""Ansible inside a booted box (tests/nspawnkit.py), as an administrator at its console runs
it: the project's own ansible-core, bound in read-only from this checkout's environment and
run by the box's Python; the wheelhouse the manual builds; the play recap of each run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Where the box sees this environment's site-packages (bound in read-only).
CONTROLLER_LIB = "/opt/ansible-site-packages"


def site_packages() -> Path:
    """This environment's site-packages: ansible-core and what it imports."""
    return next(Path(sys.prefix).glob("lib/python3*/site-packages"))


def install_ansible(root: Path) -> None:
    """Before the boot, through the host's view of the box: a Python environment that uses
    the bound-in ansible-core, and `ansible-playbook` on the PATH."""
    subprocess.run(["chroot", str(root), "/usr/bin/python3", "-m", "venv", "--without-pip",
                    "/opt/ansible"], capture_output=True, timeout=120, check=True)
    lib = next((root / "opt" / "ansible" / "lib").glob("python3*/site-packages"))
    (lib / "ansible-core.pth").write_text(CONTROLLER_LIB + "\n")
    launcher = root / "usr" / "local" / "bin" / "ansible-playbook"
    launcher.write_text("#!/opt/ansible/bin/python\nimport sys\n"
                        "from ansible.cli.playbook import main\nsys.exit(main())\n")
    launcher.chmod(0o755)


def vault_encrypt(path: Path, password_file: Path) -> None:
    """`ansible-vault encrypt` of `path` in place, with this environment's ansible-vault."""
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-vault"), "encrypt",
                           "--vault-password-file", str(password_file), str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def build_wheelhouse(where: Path, requirement: str) -> float:
    """`pip wheel` of this checkout (`requirement`: its path, with extras) into `where`,
    readable by anyone in the box (pytest makes its folders 0700); the seconds it took.
    pip's cache holds llama-cpp-python built for this machine, so nothing compiles."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet",
                             "--disable-pip-version-check", requirement, "-w", str(where)],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return time.monotonic() - started


def readable(where: Path) -> None:
    where.chmod(0o755)
    for item in where.iterdir():
        item.chmod(0o644)


@dataclass
class Run:
    """One `ansible-playbook` run: its output, seconds, exit code and the host's recap."""

    output: str
    seconds: float
    rc: int
    ok: int = 0
    changed: int = 0
    failed: int = 0

    @classmethod
    def of(cls, result: subprocess.CompletedProcess[str], seconds: float, host: str) -> Run:
        output = result.stdout + result.stderr
        recap = re.search(rf"^{re.escape(host)}\s+: ok=(\d+)\s+changed=(\d+)\s+"
                          r"unreachable=(\d+)\s+failed=(\d+)", output, re.M)
        run = cls(output, seconds, result.returncode)
        if recap:
            run.ok, run.changed, _, run.failed = map(int, recap.groups())
        return run
