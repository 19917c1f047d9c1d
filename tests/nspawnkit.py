"""A real systemd for the tests that need one: a minimal Debian 12 root booted with
`systemd-nspawn -b` as PID 1 of its own container.

What it owns:
- the root, built once with `debootstrap --variant=minbase bookworm` and the few packages of
  `PACKAGES` (what a freshly installed store box has, and nothing the role must install), in
  `CACHE` (outside the checkout), under a name keyed on everything that goes into it;
- each booted box: a fresh overlay of that root (so every boot starts clean), a cgroup
  folder of its own under the hybrid hierarchies (else nspawn writes `payload/` and
  `supervisor/` at the host hierarchy's root), and the nspawn process, started in a session
  of its own so that it, and only it, can be ended;
- commands in a box: `nsenter` into the namespaces of the box's PID 1, and HTTP through its
  network namespace only (the box has `--private-network`: its own loopback, no way out);
- a network of their own for hosts that must reach each other (`network`): a bridge in a
  namespace of its own and, for each member, a namespace with a link to it and an address,
  which a box boots into (`booted(network=…)`) and a desk runs commands in; nothing of it
  reaches the host's own network.

It never touches the host's services, never waits without a bound, and takes everything it
made down again (mounts, cgroup folders, processes) when a box is left, a failed test
included; what a killed test run left behind is removed by the next one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.machinecache import built_once

SUITE = "bookworm"
VARIANT = "minbase"
MIRROR = os.environ.get("EDGE_AGENT_TEST_MIRROR", "http://deb.debian.org/debian")
# A store box as installed: no libgomp1 (the role must bring it), no curl, no sshd.
PACKAGES = ("systemd", "dbus", "python3", "python3-venv", "sudo")
CACHE = Path(os.environ.get("EDGE_AGENT_TEST_CACHE", "/var/cache/edge-agent-tests"))
BOXES = Path(os.environ.get("EDGE_AGENT_TEST_BOXES", "/var/tmp/edge-agent-test-boxes"))
CGROUP_ROOTS = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
CGROUP_PREFIX = "edge-agent-test-"
BUILD_TIMEOUT_S = 900
BOOT_TIMEOUT_S = 90
POWEROFF_TIMEOUT_S = 30
NSENTER = ("-m", "-u", "-i", "-n", "-p", "-C")
TOOLS = ("debootstrap", "systemd-nspawn", "nsenter", "mount", "umount", "ip")
NETNS = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` binds NETNS_ETC/NS/hosts over /etc/hosts
NETNS_PREFIX = "ea"
SUBNET = "10.77.0"  # private to the network's namespaces: no host route ever sees it


def unavailable() -> str | None:
    """Why no box can be booted here, or None when one can."""
    if os.geteuid() != 0:
        return "booting a box with systemd-nspawn needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (`make system-deps` installs the Debian "
                "packages debootstrap and systemd-container)")
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay file system"
    if not all(root.is_dir() for root in CGROUP_ROOTS) and not Path(
            "/sys/fs/cgroup/cgroup.controllers").exists():
        return "no cgroup hierarchy to put the container in"
    return None


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.5,
             what: str = "") -> Any:
    """The predicate's first truthy value, polled until `timeout`; TimeoutError after."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what or predicate}")
        time.sleep(interval)


# --- the cached root -------------------------------------------------------------------------

def root_name(packages: Sequence[str] = PACKAGES) -> str:
    key = json.dumps([SUITE, VARIANT, MIRROR, sorted(packages)]).encode()
    return f"{SUITE}-{VARIANT}-{hashlib.sha256(key).hexdigest()[:12]}"


def base_root(packages: Sequence[str] = PACKAGES) -> tuple[Path, float]:
    """The root for `packages`, and the seconds spent building it (0 when cached). Built
    once per machine (`machinecache.built_once`): a half-built root is never used."""
    took = 0.0

    def bootstrap(staging: Path) -> None:
        nonlocal took
        started = time.monotonic()
        result = subprocess.run(
            ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(packages)}", SUITE,
             str(staging), MIRROR],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"debootstrap failed:\n{(result.stdout + result.stderr)[-4000:]}")
        # Nothing in the root may tell boxes apart: each boot makes its own machine id.
        # Written last: it marks the root complete.
        (staging / "etc" / "machine-id").write_text("")
        took = time.monotonic() - started

    root = built_once(CACHE / root_name(packages), "etc/machine-id", bootstrap)
    return root, took


# --- a booted box ----------------------------------------------------------------------------

@dataclass
class Box:
    """One booted container: run commands in it, reach its loopback, read its files."""

    name: str
    workdir: Path
    nspawn: subprocess.Popen[bytes]
    pid1: int = 0
    cgroups: list[Path] = field(default_factory=list)

    @property
    def root(self) -> Path:
        """The box's root file system seen from the host (not its own mounts: /tmp, /run)."""
        return self.workdir / "merged"

    def run(self, *argv: str, timeout: float = 120, check: bool = True,
            input: str | None = None, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """`argv` in all of the box's namespaces, as its root, with a clean environment."""
        environ = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "LANG": "C.UTF-8", "HOME": "/root", **(env or {})}
        result = subprocess.run(
            ["nsenter", "-t", str(self.pid1), *NSENTER, "--", "/usr/bin/env", "-i",
             *(f"{k}={v}" for k, v in environ.items()), *argv],
            capture_output=True, text=True, timeout=timeout, input=input, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"in {self.name}: {' '.join(argv)} exited {result.returncode}"
                                 f"\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def sh(self, script: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("/bin/sh", "-c", script, **kwargs)

    def as_user(self, user: str, script: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """`script` in a login shell of `user` (its home, its groups, its PATH)."""
        return self.run("/usr/sbin/runuser", "-l", user, "-c", script, **kwargs)

    def net(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """A host program (this Python, say) in the box's network namespace only: it sees
        the box's loopback and nothing else, and the host's files."""
        return subprocess.Popen(["nsenter", "-t", str(self.pid1), "-n", "--", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **kwargs)

    def http(self, method: str, url: str, body: Any = None, *,
             headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
        """(status, body) of one request to the box's loopback; status 0: no answer."""
        proc = self.net([sys.executable, "-c", _HTTP_CLIENT, method, url,
                         json.dumps(body) if body is not None else "",
                         json.dumps(headers or {}), str(timeout)])
        out, err = proc.communicate(timeout=timeout + 10)
        status, _, text = out.partition("\n")
        return (int(status) if status.strip().isdigit() else 0), text or err

    def stream(self, url: str, body: Any, *, headers: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.Popen[str]:
        """A streamed request: the child prints each line of the body as it arrives."""
        return self.net([sys.executable, "-u", "-c", _HTTP_CLIENT, "STREAM", url,
                         json.dumps(body), json.dumps(headers or {}), str(timeout)])

    def journal(self, unit: str, lines: int = 80) -> str:
        return self.run("journalctl", "--no-pager", "-o", "short-monotonic", "-u", unit,
                        "-n", str(lines), check=False).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


_HTTP_CLIENT = """\
import json, sys, urllib.error, urllib.request
method, url, body, headers, timeout = sys.argv[1:6]
data = body.encode() if body else None
req = urllib.request.Request(url, data=data, method="POST" if method == "STREAM" else method,
                             headers={"content-type": "application/json", **json.loads(headers)})
try:
    with urllib.request.urlopen(req, timeout=float(timeout)) as resp:
        if method == "STREAM":
            for line in resp:
                print(line.decode().rstrip("\\n"), flush=True)
        else:
            print(resp.status)
            print(resp.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code)
    print(exc.read().decode())
except OSError as exc:
    print(0)
    print(repr(exc))
"""


# --- a network of their own ------------------------------------------------------------------

@dataclass
class Network:
    """Members on one bridge, each in a network namespace of its own with one address."""

    tag: str
    addresses: dict[str, str]

    def namespace(self, member: str) -> str:
        return f"{self.tag}-{member}"

    def path(self, member: str) -> Path:
        """What a box boots into (`booted(network=…)`)."""
        return NETNS / self.namespace(member)

    def hosts(self, names: dict[str, Sequence[str]]) -> str:
        """An /etc/hosts giving each member (by key) its names."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.addresses[m]} {' '.join(aliases)}" for m, aliases in names.items()]
        return "\n".join(lines) + "\n"

    def resolve(self, member: str, hosts: str) -> None:
        """The names `member`'s commands see (`run`), as a site's DNS would give them."""
        folder = NETNS_ETC / self.namespace(member)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts)

    def run(self, member: str, argv: Sequence[str], **kwargs: Any
            ) -> subprocess.CompletedProcess[str]:
        """A host program in `member`'s network namespace (and its /etc/hosts)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(member), *argv],
                              capture_output=True, text=True, check=False, **kwargs)


@contextlib.contextmanager
def network(members: Sequence[str]) -> Iterator[Network]:
    """A bridge in a namespace of its own and a namespace per member linked to it
    (addresses SUBNET.1, .2, … in order); all of it removed on leaving."""
    remove_leftovers()
    tag = f"{NETNS_PREFIX}{os.getpid()}"
    net = Network(tag, {m: f"{SUBNET}.{i}" for i, m in enumerate(members, 1)})
    lan = f"{tag}-lan"
    made = [lan]
    try:
        _check(["ip", "netns", "add", lan])
        _check(["ip", "-n", lan, "link", "add", "br0", "type", "bridge"])
        _check(["ip", "-n", lan, "link", "set", "br0", "up"])
        for i, member in enumerate(members):
            ns = net.namespace(member)
            _check(["ip", "netns", "add", ns])
            made.append(ns)
            _check(["ip", "-n", lan, "link", "add", f"v{i}", "type", "veth", "peer", "name",
                    "eth0", "netns", ns])
            _check(["ip", "-n", lan, "link", "set", f"v{i}", "master", "br0", "up"])
            _check(["ip", "-n", ns, "addr", "add", f"{net.addresses[member]}/24", "dev", "eth0"])
            _check(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _check(["ip", "-n", ns, "link", "set", "lo", "up"])
        yield net
    finally:
        for ns in reversed(made):
            _remove_netns(ns)


def _remove_netns(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


@contextlib.contextmanager
def booted(name: str, base: Path, *, ro_binds: Sequence[tuple[Path, str]] = (),
           prepare: Callable[[Path], None] | None = None,
           network: Path | None = None) -> Iterator[Box]:
    """A fresh overlay of `base`, `prepare`d through the host's view of it, booted until
    `systemctl is-system-running` answers; powered off and removed on leaving. Alone on its
    own loopback, or in the `network` namespace given (a member of `network(…)`)."""
    remove_leftovers()
    BOXES.mkdir(parents=True, exist_ok=True)
    workdir = BOXES / f"{os.getpid()}-{name}"
    if workdir.exists():
        _remove_workdir(workdir)
    for part in ("upper", "work", "merged"):
        (workdir / part).mkdir(parents=True)
    merged = workdir / "merged"
    _check(["mount", "-t", "overlay", "overlay", "-o",
            f"lowerdir={base},upperdir={workdir / 'upper'},workdir={workdir / 'work'}",
            str(merged)])
    box: Box | None = None
    cgroups: list[Path] = []
    try:
        if prepare is not None:
            prepare(merged)
        cgroups = _make_cgroups(f"{CGROUP_PREFIX}{os.getpid()}-{name}")
        join = "".join(f'echo $$ > "{c}/cgroup.procs"; ' for c in cgroups)
        argv = ["systemd-nspawn", "-b", "-D", str(merged), f"--machine=ea-{name}",
                "--register=no", "--keep-unit",
                f"--network-namespace-path={network}" if network else "--private-network",
                "--console=pipe",
                "--resolv-conf=off", "--timezone=off", "--link-journal=no",
                *(f"--bind-ro={src}:{dst}" for src, dst in ro_binds)]
        log = open(workdir / "console.log", "wb")  # noqa: SIM115 (closed with the box)
        nspawn = subprocess.Popen(["/bin/sh", "-c", join + 'exec "$@"', "sh", *argv],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  start_new_session=True)
        log.close()
        box = Box(name, workdir, nspawn, cgroups=cgroups)
        box.pid1 = wait_for(lambda: _container_init(nspawn), 30, 0.1,
                            f"the systemd of {name} to start")
        # Until PID 1 has made /run/systemd/system and its private socket, systemctl says
        # "offline" or nothing.
        booting = wait_for(lambda: _asked(box), BOOT_TIMEOUT_S, 0.1,
                           f"the systemd of {name} to answer")
        if booting not in ("running", "degraded"):
            raise AssertionError(f"{name} did not boot: {booting}\n{console(box)}")
        yield box
    finally:
        if box is not None:
            _power_off(box)
        _remove_cgroups(cgroups)
        _remove_workdir(workdir)


def _asked(box: Box) -> str:
    state = box.run("systemctl", "is-system-running", "--wait", timeout=BOOT_TIMEOUT_S,
                    check=False).stdout.strip()
    return "" if state in ("", "offline") else state


def console(box: Box) -> str:
    with contextlib.suppress(OSError):
        return (box.workdir / "console.log").read_text(errors="replace")[-4000:]
    return ""


def _container_init(nspawn: subprocess.Popen[bytes]) -> int:
    if nspawn.poll() is not None:
        raise AssertionError(f"systemd-nspawn exited {nspawn.returncode}")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            status = dict(line.split(":\t", 1) for line in
                          (entry / "status").read_text().splitlines() if ":\t" in line)
            if int(status["PPid"]) == nspawn.pid and status["Name"].strip() == "systemd":
                return int(entry.name)
    return 0


def _power_off(box: Box) -> None:
    """SIGTERM to nspawn asks the box's systemd to power off; SIGKILL to whatever is left."""
    if box.nspawn.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            box.nspawn.send_signal(signal.SIGTERM)
        try:
            box.nspawn.wait(POWEROFF_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(box.nspawn.pid, signal.SIGKILL)
            box.nspawn.wait(10)
    _kill_cgroup_members(box.cgroups)


def _make_cgroups(name: str) -> list[Path]:
    made = []
    roots = [r for r in CGROUP_ROOTS if r.is_dir()] or [Path("/sys/fs/cgroup")]
    for root in roots:
        folder = root / name
        folder.mkdir(exist_ok=True)
        made.append(folder)
    return made


def _kill_cgroup_members(cgroups: Sequence[Path]) -> None:
    for _ in range(20):
        pids = {int(pid) for folder in cgroups if folder.is_dir()
                for procs in folder.rglob("cgroup.procs")
                for pid in _read(procs).split()}
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.25)


def _remove_cgroups(cgroups: Sequence[Path]) -> None:
    _kill_cgroup_members(cgroups)
    for folder in cgroups:
        if not folder.is_dir():
            continue
        for sub in sorted((p for p in folder.rglob("*") if p.is_dir()),
                          key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            folder.rmdir()


def _remove_workdir(workdir: Path) -> None:
    merged = workdir / "merged"
    mounted = [line.split()[4] for line in _read(Path("/proc/self/mountinfo")).splitlines()
               if line.split()[4] == str(merged) or line.split()[4].startswith(f"{merged}/")]
    for point in sorted(mounted, key=len, reverse=True):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    if not any(line.split()[4] == str(merged)
               for line in _read(Path("/proc/self/mountinfo")).splitlines()):
        shutil.rmtree(workdir, ignore_errors=True)


def remove_leftovers() -> None:
    """Boxes of test runs that are gone (their process id is dead): processes, cgroup
    folders, mounts and overlays."""
    def dead(folder_name: str, prefix: str = "") -> bool:
        pid = folder_name.removeprefix(prefix).split("-", 1)[0]
        return pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists()

    for root in [*CGROUP_ROOTS, Path("/sys/fs/cgroup")]:
        if root.is_dir():
            stale = [f for f in root.glob(f"{CGROUP_PREFIX}*") if dead(f.name, CGROUP_PREFIX)]
            _remove_cgroups(stale)
    if BOXES.is_dir():
        for workdir in BOXES.iterdir():
            if dead(workdir.name):
                _remove_workdir(workdir)
    if NETNS.is_dir():
        for ns in NETNS.iterdir():
            if ns.name.startswith(NETNS_PREFIX) and dead(ns.name, NETNS_PREFIX):
                _remove_netns(ns.name)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _check(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
