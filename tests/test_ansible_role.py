"""The Ansible role in ansible/roles/edge_agent, run for real against this machine.

A wheelhouse is built from this checkout (`pip wheel .[default-model]`: pip's cache holds the
llama-cpp-python wheel built for this machine, so nothing compiles), then `ansible-playbook`
runs the role on localhost (`ansible_connection=local`) into a scratch prefix: its paths are
variables, and the service user is the one running the tests (`edge_agent_create_user:
false`), so nothing outside the scratch directory changes. The first run converges and
`edge-agent doctor` passes; the second reports changed=0; `--check --diff` after it reports
no change either. The service part (daemon-reload, enable, start, /ready) runs only where
systemd is PID 1; elsewhere the role says why it skipped it, and that is checked.

Also: argument_specs and defaults name the same variables, the role's unit template renders
to systemd/edge-agent.service with the defaults, its drop-ins are systemd/'s, and
`ansible-lint` (production profile) passes on ansible/.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import DEFAULT_MODEL, free_port
from tests.ggufgen import write_tiny_gguf
from tests.support.certs import StoreCA

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE = ROOT / "ansible"
ROLE = ANSIBLE / "roles" / "edge_agent"
BIN = Path(sys.executable).parent
TUF_ROOT = '{"signed": {"_type": "root", "version": 1}, "signatures": []}'
BROKER_PASSWORD = "s3cret-broker-pass-1f6b"
RECAP = re.compile(r"^localhost\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+"
                   r"failed=(\d+)", re.M)


def _tool(name: str) -> str:
    found = BIN / name
    if not found.exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return str(found)


def ansible_env(home: Path) -> dict[str, str]:
    """The tools' environment: this venv first on PATH, Ansible's state in `home`, and no
    PIP_* of the machine's (the wheelhouse alone must be enough)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "ANSIBLE_"))}
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    return env


# --- the role's files ------------------------------------------------------------------------

def test_argument_specs_and_defaults_name_the_same_variables() -> None:
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert set(options) == set(defaults)
    assert all(name.startswith("edge_agent_") for name in options)
    assert all(spec.get("description") and spec.get("type") for spec in options.values())
    internal = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    assert all(name.startswith("_edge_agent_") for name in internal)


def test_the_manual_documents_every_variable() -> None:
    page = (ROOT / "docs" / "install" / "provisioning.md").read_text()
    table = page.split("## The role's variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(edge_agent_\w+)` \|", table, re.M))
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    assert documented == set(specs["argument_specs"]["main"]["options"])


def test_tasks_main_only_dispatches_the_phases_in_order() -> None:
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    assert [t["ansible.builtin.import_tasks"] for t in tasks] == [
        "preflight.yml", "install.yml", "configure.yml", "models.yml", "service.yml",
        "verify.yml"]
    assert all(t.get("tags") for t in tasks)


@pytest.mark.parametrize("dropin", ["nvidia.conf", "jetson.conf"])
def test_the_role_ships_systemds_drop_ins(dropin: str) -> None:
    assert ((ROLE / "files" / dropin).read_bytes()
            == (ROOT / "systemd" / "edge-agent.service.d" / dropin).read_bytes())


def render_unit(tmp_path: Path, *extra: str) -> str:
    """The role's unit template, rendered by Ansible's own template module with the
    defaults and `extra` (-e arguments)."""
    return render(tmp_path, "edge-agent.service.j2", tmp_path / "edge-agent.service", *extra)


def render(tmp_path: Path, template: str, out: Path, *extra: str, role: Path = ROLE) -> str:
    """One of a role's templates, rendered by Ansible's own template module with its
    defaults and `extra` (-e arguments), into `out`."""
    result = subprocess.run(
        [_tool("ansible"), "localhost", "-c", "local", "-i", "localhost,",
         "-e", f"ansible_python_interpreter={sys.executable}",
         "-e", f"@{role / 'defaults' / 'main.yml'}", "-e", f"@{role / 'vars' / 'main.yml'}",
         *(arg for value in extra for arg in ("-e", value)),
         "-m", "ansible.builtin.template",
         "-a", f"src={role / 'templates' / template} dest={out}"],
        capture_output=True, text=True, timeout=120, env=ansible_env(tmp_path / "home"),
        check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return out.read_text()


def test_the_unit_template_renders_to_systemds_unit(tmp_path: Path) -> None:
    """With the defaults, the unit the role installs is systemd/edge-agent.service byte for
    byte."""
    assert render_unit(tmp_path) == (ROOT / "systemd" / "edge-agent.service").read_text()


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("runuser") is None,
                    reason="runs the wrapper as root, which drops to another user")
def test_the_cli_on_the_path_runs_as_the_service_user_under_root(tmp_path: Path) -> None:
    """`sudo edge-agent …` on a provisioned box: the role's wrapper runs the command as the
    service's user (here `nobody`), with its arguments as given, so that root leaves no
    root-owned file in the state dir."""
    prefix = Path(tempfile.mkdtemp(prefix="edge-agent-cli-"))
    try:
        prefix.chmod(0o755)
        (prefix / "bin").mkdir(mode=0o755)
        fake = prefix / "bin" / "edge-agent"
        fake.write_text('#!/bin/sh\necho "$(id -un)" "$@"\n')
        fake.chmod(0o755)
        wrapper = prefix / "edge-agent"
        render(tmp_path, "edge-agent-cli.sh.j2", wrapper, f"edge_agent_prefix={prefix}",
               "edge_agent_user=nobody")
        wrapper.chmod(0o755)
        ran = subprocess.run([str(wrapper), "keys", "create", "--tenant", "a b"], cwd="/",
                             capture_output=True, text=True, timeout=30, check=True)
        assert ran.stdout == "nobody keys create --tenant a b\n"
    finally:
        shutil.rmtree(prefix)


def test_a_longer_drain_grace_lengthens_the_stop_timeout(tmp_path: Path) -> None:
    """[server] stop_grace_s set through edge_agent_server: the unit's TimeoutStopSec keeps
    the 60 s that follow the grace (tests/test_systemd_units.py holds those to the code)."""
    unit = render_unit(tmp_path, json.dumps({"edge_agent_server": {"stop_grace_s": 119.5}}))
    assert re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.M) == ["180"]
    default = (ROOT / "systemd" / "edge-agent.service").read_text()
    assert re.findall(r"^TimeoutStopSec=(\d+)$", default, re.M) == ["70"]


@pytest.mark.provision
def test_ansible_lint_production_profile_passes(tmp_path: Path) -> None:
    result = subprocess.run([_tool("ansible-lint"), "--profile", "production", "--offline"],
                            cwd=ANSIBLE, capture_output=True, text=True, timeout=600,
                            env=ansible_env(tmp_path / "home"), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


def test_pipelining_is_on_for_every_connection(tmp_path: Path) -> None:
    """In [connection], which the local connection reads too (not only [ssh_connection]):
    a sudo user's become_user tasks then need no temporary file the service user must read
    (setfacl, absent on a minimal box). tests/test_systemd_box.py runs the role so."""
    result = subprocess.run([_tool("ansible-config"), "dump", "--only-changed", "-t",
                             "connection"], capture_output=True, text=True, timeout=120,
                            env=ansible_env(tmp_path / "home"), check=False)
    assert result.returncode == 0, result.stderr
    plugins = dict(re.findall(r"^(\w+):\n_+\n((?:.+\n)+)", result.stdout, re.M))
    for connection in ("ssh", "local"):
        assert re.search(r"^pipelining\(.*ansible\.cfg\) = True$", plugins.get(connection, ""),
                         re.M), result.stdout


# --- the wheelhouse's CPU floor ----------------------------------------------------------------

def _fake_llama_wheel(where: Path, instruction: str) -> Path:
    """A llama-cpp-python wheel whose libggml-cpu.so holds one `instruction`."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("objdump") is None:
        pytest.skip("needs a C compiler and objdump (binutils)")
    source = where / "kernel.s"
    source.write_text(f".text\n.globl kernel\nkernel:\n  {instruction}\n  ret\n")
    library = where / "libggml-cpu.so"
    subprocess.run([cc, "-shared", "-nostdlib", "-o", str(library), str(source)], check=True,
                   capture_output=True, timeout=60)
    wheel = where / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("libggml-cpu.so", "libggml-cpu.so.0"):
            archive.write(library, f"llama_cpp/lib/{name}")
    return wheel


@pytest.mark.parametrize(("instruction", "refused"), [
    ("vpaddd %ymm1, %ymm2, %ymm3", False),  # AVX2
    ("vfmadd231ps %ymm1, %ymm2, %ymm3", False),  # FMA
    ("vpaddd %zmm1, %zmm2, %zmm3", True),  # AVX-512F
    ("vpaddd %ymm17, %ymm18, %ymm19", True),  # AVX-512VL: EVEX-only registers
    ("kmovw %k1, %eax", True),  # an opmask register
])
def test_the_wheelhouse_check_refuses_avx512_for_the_avx2_floor(
        tmp_path: Path, instruction: str, refused: bool) -> None:
    _fake_llama_wheel(tmp_path, instruction)
    result = subprocess.run([sys.executable, str(ANSIBLE / "wheelhouse_check.py"),
                             str(tmp_path), "--floor", "avx2"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == (1 if refused else 0), result.stdout + result.stderr
    if refused:
        assert "instructions above the avx2 floor (AVX-512)" in result.stdout
        assert result.stdout.count("libggml-cpu.so") == 1  # one report per library, not name
    else:
        assert "1 libraries within the avx2 floor" in result.stdout


def test_the_wheelhouse_check_on_this_machines_wheel(wheelhouse: Path) -> None:
    """Printed, not asserted: pip's cached llama-cpp-python here may be a native build, which
    is what the check exists to catch before a wheelhouse leaves the build machine."""
    result = subprocess.run([sys.executable, str(ANSIBLE / "wheelhouse_check.py"),
                             str(wheelhouse)], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    print(result.stdout.strip()[:400])


# --- the role run against this machine --------------------------------------------------------

@dataclass
class Run:
    output: str
    seconds: float
    ok: int = 0
    changed: int = 0
    failed: int = 0

    @classmethod
    def of(cls, result: subprocess.CompletedProcess[str], seconds: float) -> Run:
        output = result.stdout + result.stderr
        recap = RECAP.search(output)
        assert result.returncode == 0 and recap, output[-6000:]
        ok, changed, unreachable, failed = map(int, recap.groups())
        assert unreachable == 0
        return cls(output, seconds, ok, changed, failed)


@dataclass
class Provisioned:
    scratch: Path
    vars: dict[str, object]
    runs: dict[str, Run] = field(default_factory=dict)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.scratch / "opt" / "bin" / "edge-agent"), *args, "--config",
             str(self.scratch / "etc" / "config.toml")],
            capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """edge-agent's wheel and all its dependencies, as a technician carries them."""
    where = tmp_path_factory.mktemp("wheelhouse")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet",
                             "--disable-pip-version-check", f"{ROOT}[default-model]", "-w",
                             str(where)],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"wheelhouse: pip wheel took {time.monotonic() - started:.1f} s")
    assert list(where.glob("edge_agent_appliance-*.whl"))  # the distribution's name
    assert list(where.glob("llama_cpp_python-*.whl"))
    return where


def test_the_manual_says_what_a_fresh_wheelhouse_holds(wheelhouse: Path) -> None:
    wheels = list(wheelhouse.glob("*.whl"))
    size_mb = sum(w.stat().st_size for w in wheels) / 1e6
    page = (ROOT / "docs" / "install" / "wheelhouse.md").read_text()
    said = re.search(r"gives (\d+) wheels, (\d+) MB", page)
    assert said, "docs/install/wheelhouse.md: 'gives N wheels, M MB'"
    print(f"a fresh wheelhouse: {len(wheels)} wheels, {size_mb:.0f} MB")
    assert int(said.group(1)) == len(wheels)
    assert abs(int(said.group(2)) - size_mb) <= 0.1 * size_mb


def test_a_desk_installs_this_project_from_the_wheelhouse(wheelhouse: Path,
                                                         tmp_path: Path) -> None:
    """The manual's desk install, run as it stands: the distribution's own name, from the
    wheelhouse alone (`--no-index`: the index's `edge-agent` is another project)."""
    page = (ROOT / "docs" / "install" / "wheelhouse.md").read_text()
    block = re.search(r"## At a desk\n.*?```sh\n(.*?)```", page, re.S)
    assert block, "docs/install/wheelhouse.md: the desk's install block"
    base = getattr(sys, "_base_executable", sys.executable)  # the wheels were built for it
    script = block.group(1).replace("~/edge-agent", str(tmp_path / "desk")).replace(
        "wheelhouse/x86_64-cpu", str(wheelhouse)).replace("python3 -m venv", f"{base} -m venv")
    done = subprocess.run(["bash", "-e", "-c", script],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "edge-agent, version " + \
        _project_version()
    listed = subprocess.run([str(tmp_path / "desk" / "bin" / "python"), "-m", "pip", "list",
                             "--format", "json"], capture_output=True, text=True, check=True)
    names = {d["name"] for d in json.loads(listed.stdout)}
    assert "edge-agent-appliance" in names and "edge-agent" not in names


def _project_version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture(scope="module")
def provisioned(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Provisioned:
    scratch = tmp_path_factory.mktemp("box")
    (scratch / "cache").mkdir()
    (scratch / "bin").mkdir()  # as /usr/local/bin: there already
    tiny = write_tiny_gguf(scratch / "cache" / "tiny.gguf", context_length=128)
    ca = StoreCA(scratch / "pki")
    pair = ca.issue("box")
    # The base interpreter, as a box's /usr/bin/python3: the wheels were built for it.
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    systemd_is_pid1 = Path("/run/systemd/system").is_dir()
    variables: dict[str, object] = {
        "edge_agent_wheelhouse": str(wheelhouse),
        "edge_agent_python": str(python),
        "edge_agent_prefix": str(scratch / "opt"),
        "edge_agent_cli_path": str(scratch / "bin" / "edge-agent"),
        "edge_agent_config_dir": str(scratch / "etc"),
        "edge_agent_state_dir": str(scratch / "state"),
        "edge_agent_systemd_dir": str(scratch / "systemd"),
        "edge_agent_key_drop_dir": str(scratch / "keys"),
        # The user running the tests, existing already: nothing is created outside scratch.
        "edge_agent_user": _whoami(), "edge_agent_group": _group(),
        "edge_agent_create_user": False,
        "edge_agent_port": free_port(),
        "edge_agent_gpu": "none",
        "edge_agent_min_free_disk_mb": 256,
        "edge_agent_catalog_models": [DEFAULT_MODEL],
        "edge_agent_models": [{"name": "tiny:1", "src": str(tiny)}],
        "edge_agent_tenants": {"shop": {"models": ["*"], "max_output_tokens": 256}},
        "edge_agent_fleet_id": "f1",
        "edge_agent_fleet_broker": "mqtts://broker.example:8883",
        "edge_agent_fleet_username": "box1",
        "edge_agent_fleet_password": BROKER_PASSWORD,
        "edge_agent_fleet_ca_cert": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
        "edge_agent_fleet_command_key":  # the old name, still read
            "-----BEGIN PUBLIC KEY-----\nMCow\n-----END PUBLIC KEY-----",
        "edge_agent_fleet_tuf_root": TUF_ROOT,
        "edge_agent_fleet_artifacts_url": "http://controller.example:9464/releases/",
        "edge_agent_tls_cert": pair.cert.read_text(),
        "edge_agent_tls_key": pair.key.read_text(),
        "edge_agent_tls_client_ca": ca.cert.read_text(),
        # Where systemd runs, the test still must not start a service on the machine: that
        # takes a disposable VM. Where it does not, the role itself skips and says why.
        **({"edge_agent_service_enabled": False} if systemd_is_pid1 else {}),
    }
    (scratch / "vars.json").write_text(json.dumps(variables))
    _install_former_name(python, scratch / "opt", scratch / "former")
    (scratch / "inventory").write_text(
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    (scratch / "play.yml").write_text(
        "- name: Provision this machine into a scratch prefix\n"
        "  hosts: all\n  roles:\n    - role: edge_agent\n")
    env = ansible_env(scratch / "ansible-home")
    box = Provisioned(scratch, variables)
    for name, extra in [("first", []), ("second", []), ("check", ["--check", "--diff"])]:
        started = time.monotonic()
        result = subprocess.run(
            [_tool("ansible-playbook"), "-i", str(scratch / "inventory"),
             str(scratch / "play.yml"), "-e", f"@{scratch / 'vars.json'}", *extra],
            capture_output=True, text=True, timeout=900, env=env, check=False)
        box.runs[name] = Run.of(result, time.monotonic() - started)
        print(f"ansible-playbook, {name} run: {box.runs[name].seconds:.1f} s, "
              f"ok={box.runs[name].ok} changed={box.runs[name].changed}")
    return box


FORMER_MARKER = "edge_agent_former_name.py"


def _install_former_name(python: Path, prefix: Path, where: Path) -> None:
    """A box upgraded from a release whose distribution was still named `edge-agent`: the
    venv holds a wheel of that name (one file of its own, to see it removed)."""
    subprocess.run([str(python), "-m", "venv", str(prefix)], check=True, timeout=300)
    where.mkdir()
    info = "edge_agent-0.0.9.dist-info"
    files = {FORMER_MARKER: "",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: edge-agent\nVersion: 0.0.9\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    wheel = where / "edge_agent-0.0.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(name, text)
    subprocess.run([str(prefix / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    "--no-index", "--disable-pip-version-check", str(wheel)], check=True,
                   timeout=300, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})


def _whoami() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def _group() -> str:
    return grp.getgrgid(os.getgid()).gr_name


@pytest.mark.provision
def test_the_first_run_converges_and_doctor_passes(provisioned: Provisioned) -> None:
    first = provisioned.runs["first"]
    assert first.failed == 0 and first.changed > 0
    assert "doctor: " in first.output
    assert "llama.cpp runtime: ok" in first.output  # checked before anything is configured
    doctor = provisioned.cli("doctor", "--json")
    checks = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and not [c for c in checks if c["status"] == "fail"], checks
    models = {m["name"]: m for m in json.loads(provisioned.cli("models", "list", "--json").stdout)
              if m["installed"]}
    assert set(models) == {DEFAULT_MODEL, "tiny:1"}
    tiny = provisioned.scratch / "cache" / "tiny.gguf"
    assert models["tiny:1"]["digest"] == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert not list((provisioned.scratch / "state" / "incoming").iterdir())


@pytest.mark.provision
def test_the_distributions_former_name_is_removed(provisioned: Provisioned) -> None:
    """The venv held `edge-agent` (the former name): the first run removed it, then
    installed `edge-agent-appliance`."""
    opt = provisioned.scratch / "opt"
    listed = subprocess.run([str(opt / "bin" / "python"), "-m", "pip", "list", "--format",
                             "json", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True, timeout=120)
    names = {d["name"] for d in json.loads(listed.stdout)}
    assert "edge-agent-appliance" in names and "edge-agent" not in names
    assert not list(opt.glob(f"lib/python*/site-packages/{FORMER_MARKER}"))
    assert "Remove the distribution's former name" in provisioned.runs["first"].output


@pytest.mark.provision
def test_edge_agent_is_on_the_path(provisioned: Provisioned) -> None:
    wrapper = provisioned.scratch / "bin" / "edge-agent"
    assert stat.S_IMODE(wrapper.stat().st_mode) == 0o755
    assert f"{provisioned.scratch / 'opt' / 'bin' / 'edge-agent'}" in wrapper.read_text()


@pytest.mark.provision
def test_the_second_run_changes_nothing(provisioned: Provisioned) -> None:
    second = provisioned.runs["second"]
    assert second.changed == 0, [line for line in second.output.splitlines()
                                 if line.startswith("changed:")]


@pytest.mark.provision
def test_check_diff_after_it_reports_no_change(provisioned: Provisioned) -> None:
    check = provisioned.runs["check"]
    assert check.changed == 0, check.output[-4000:]
    assert "--- before" not in check.output


@pytest.mark.provision
def test_one_key_per_tenant_dropped_once_mode_0600(provisioned: Provisioned) -> None:
    keys = json.loads(provisioned.cli("keys", "list", "--json").stdout)
    assert [(k["tenant"], k["revoked"]) for k in keys] == [("shop", None)]
    dropped = provisioned.scratch / "keys" / "localhost.shop.key"
    assert stat.S_IMODE(dropped.stat().st_mode) == 0o600
    key = dropped.read_text().strip()
    assert keys[0]["prefix"] in key
    for run in provisioned.runs.values():  # shown once: in the file, nowhere in the logs
        assert key not in run.output and BROKER_PASSWORD not in run.output


@pytest.mark.provision
def test_the_secrets_are_readable_by_the_service_group_only(provisioned: Provisioned) -> None:
    etc = provisioned.scratch / "etc"
    assert stat.S_IMODE((etc / "config.toml").stat().st_mode) == 0o640
    assert stat.S_IMODE((etc / "fleet").stat().st_mode) == 0o750
    assert (etc / "fleet" / "password").read_text() == BROKER_PASSWORD + "\n"
    for name in ("password", "ca.pem", "command.pub.pem", "tuf-root.json"):
        assert stat.S_IMODE((etc / "fleet" / name).stat().st_mode) == 0o640
    assert (etc / "fleet" / "tuf-root.json").read_text().strip() == TUF_ROOT
    assert not (etc / "fleet" / "client.key").exists()
    config = (etc / "config.toml").read_text()
    assert f'password_file = "{etc}/fleet/password"' in config
    assert f'tuf_root_file = "{etc}/fleet/tuf-root.json"' in config
    assert f'command_public_key_file = "{etc}/fleet/command.pub.pem"' in config
    assert 'artifacts_url = "http://controller.example:9464/releases/"' in config
    assert BROKER_PASSWORD not in config


@pytest.mark.provision
def test_the_tls_files_are_the_service_users_only(provisioned: Provisioned) -> None:
    """Certificate, key and client CA written 0600 in a 0700 folder of the service user's,
    [server] pointed at them; the key in no log. doctor (in the first run's test) passed
    on them: in date, the key the certificate's own and owner-only."""
    tls = provisioned.scratch / "etc" / "tls"
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700 and tls.stat().st_uid == os.getuid()
    for name, var in [("server.pem", "edge_agent_tls_cert"), ("server.key", "edge_agent_tls_key"),
                      ("client-ca.pem", "edge_agent_tls_client_ca")]:
        path = tls / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
        assert path.read_text() == str(provisioned.vars[var]).strip() + "\n"
    config = (provisioned.scratch / "etc" / "config.toml").read_text()
    for setting, name in [("tls_cert_file", "server.pem"), ("tls_key_file", "server.key"),
                          ("tls_client_ca_file", "client-ca.pem")]:
        assert f'{setting} = "{tls}/{name}"' in config
    key_body = str(provisioned.vars["edge_agent_tls_key"]).splitlines()[1]
    for run in provisioned.runs.values():
        assert key_body not in run.output
    checks = {c["name"]: c for c in json.loads(provisioned.cli("doctor", "--json").stdout)}
    assert checks["tls key"]["status"] == "ok" and checks["tls client CA"]["status"] == "ok"


@pytest.mark.provision
def test_the_service_part_runs_only_under_systemd(provisioned: Provisioned) -> None:
    unit = (provisioned.scratch / "systemd" / "edge-agent.service").read_text()
    assert f"ExecStart={provisioned.scratch}/opt/bin/edge-agent serve --config " in unit
    assert f"ReadWritePaths={provisioned.scratch}/state" in unit
    assert not (provisioned.scratch / "systemd" / "edge-agent.service.d").exists()
    said = re.search(r'"msg": "(service not managed: [^"]*)"', provisioned.runs["first"].output)
    assert said, "the role must say why it did not manage the service"
    print(said.group(1))
    if not Path("/run/systemd/system").is_dir():
        assert "not systemd (systemd is not PID 1)" in said.group(1)


def test_gitignore_keeps_the_technicians_material_out() -> None:
    ignored = (ANSIBLE / ".gitignore").read_text().split()
    assert {"keys/", "wheelhouse/", "models/", "pki/"} <= set(ignored)
    assert shutil.which("git") is None or not subprocess.run(
        ["git", "ls-files", "ansible/keys", "ansible/wheelhouse"], cwd=ROOT,
        capture_output=True, text=True, check=False).stdout
