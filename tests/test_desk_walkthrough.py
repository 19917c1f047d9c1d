"""The manual's central-team walk-through (docs/fleet/controller.md, "6. From a desk"), run as
its readers run it: the admin's block on the controller host, Vic's and Olivia's blocks at
a desk in a network namespace of their own, which reaches the controller only over a veth
link, by name (`controller.example`, in the namespace's own /etc/hosts), over HTTPS with
the site's CA. The blocks are read from the page, not copied here.

What a tester must change is changed, each change checked to apply: the port (a free one
for 9464), the release (a tiny generated GGUF as `simmodel:1b` for gemma3:270m, pushed from
the desk, which alone holds the targets key), a 1 s soak for 10 s, and `--config` on the
host's commands (the page's host uses the default file). The controller is a real `fleet
serve` (HTTPS on the veth address, its rollout engine on a real Mosquitto) and two
simulated boxes (the agent's own link code) take the rollout.

Needs root (network namespaces): skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from edge_agent.engine.models.catalog import packaged_catalog_dir, read_catalog
from edge_agent.fleet.sim.testbed import make_tls
from edge_agent.names import ModelName
from tests.conftest import free_port
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import Mosquitto
from tests.support.fleetkit import wait_until
from tests.support.releasekit import make_repo
from tests.support.rolloutkit import ENV, ROOT, controller_config, serving
from tests.support.rolloutsim import LinkFleet

pytestmark = [pytest.mark.broker]

PAGE = ROOT / "docs" / "fleet" / "controller.md"
SECTION = "## 6. From a desk: the central team's walk-through"
BOXES = ("sim-000", "sim-001")
RELEASE = "simmodel:1b"


def section_blocks() -> list[str]:
    page = PAGE.read_text()
    assert SECTION in page, f"{PAGE.name}: no {SECTION!r}"
    section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^```sh\n(.*?)^```", section, re.S | re.M)]


def changed(text: str, old: str, new: str) -> str:
    assert old in text, f"the walk-through no longer says {old!r}"
    return text.replace(old, new)


@dataclass
class Desk:
    """A network namespace with a veth link to the host: `host_ip` is the host's end."""

    name: str
    host_ip: str
    folder: Path

    def run(self, command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.name, "bash", "-c", command],
                              cwd=self.folder, env=env, capture_output=True, text=True,
                              timeout=300)


@pytest.fixture
def desk(tmp_path: Path) -> Iterator[Desk]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"ead{random.randrange(16**6):06x}"
    net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    host_if, desk_if = f"h{tag}", f"d{tag}"
    hosts = Path("/etc/netns") / tag
    steps = [["ip", "netns", "add", tag],
             ["ip", "link", "add", host_if, "type", "veth", "peer", "name", desk_if],
             ["ip", "link", "set", desk_if, "netns", tag],
             ["ip", "addr", "add", f"{net}.1/30", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "netns", "exec", tag, "ip", "addr", "add", f"{net}.2/30", "dev", desk_if],
             ["ip", "netns", "exec", tag, "ip", "link", "set", desk_if, "up"],
             ["ip", "netns", "exec", tag, "ip", "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=30)
        hosts.mkdir(parents=True, exist_ok=True)  # `ip netns exec` binds it over /etc/hosts
        (hosts / "hosts").write_text(f"127.0.0.1 localhost\n{net}.1 controller.example\n")
        folder = tmp_path / "desk"
        folder.mkdir()
        yield Desk(tag, f"{net}.1", folder)
    finally:
        subprocess.run(["ip", "netns", "del", tag], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        shutil.rmtree(hosts, ignore_errors=True)


def test_the_central_team_works_from_a_desk(desk: Desk,
                                            mosquitto_factory: Callable[..., Mosquitto],
                                            tmp_path: Path) -> None:
    admin_block, viewer_block, operator_block = section_blocks()
    changed(viewer_block, "controller.example:9464", "")  # the port replaced below is there
    broker = mosquitto_factory(devices=BOXES, passwd_tool=False).start()
    repo = make_repo(tmp_path)
    # The release is signed at the desk: the targets key goes there and leaves the host,
    # with the release root the boxes have and the model file.
    keys = desk.folder / "release-keys"
    keys.mkdir()
    for name in ("targets.pem", "targets.pub.pem"):
        shutil.copy(repo.keys.path / name, keys / name)
    repo.keys.private("targets").unlink()
    shutil.copy(repo.root_file, desk.folder / "root.json")
    write_tiny_gguf(desk.folder / "gemma3-270m.gguf")
    tls = make_tls(tmp_path / "tls", hostname="controller.example")
    port = free_port()
    config = controller_config(
        tmp_path / "controller.toml", state=tmp_path / "state",
        key=repo.keys.private("command"), broker=broker,
        http=f'host = "{desk.host_ip}"\nport = {port}\ntls_cert_file = "{tls.server_cert}"\n'
             f'tls_key_file = "{tls.server_key}"')
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    # The admin, on the controller host: tokens made before the first start (which an
    # exposed controller refuses without one).
    host = tmp_path / "host"
    host.mkdir()
    admin = changed(admin_block, "--role viewer > vic.token",
                    f"--role viewer --config {config} > vic.token")
    admin = changed(admin, "--role operator > olivia.token",
                    f"--role operator --config {config} > olivia.token")
    made = subprocess.run(["bash", "-e", "-c", admin], cwd=host, env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    for token in ("vic.token", "olivia.token"):  # handed over to the desk
        shutil.copy(host / token, desk.folder / token)
    shutil.copy(tls.ca_cert, desk.folder / "fleet-ca.pem")  # the site's CA certificate

    with serving(config, tmp_path / "serve.log", env) as serve:
        def up() -> bool:
            try:
                return httpx.get(f"https://{desk.host_ip}:{port}/healthz", verify=False,
                                 timeout=2).status_code == 401  # exposed: tokens only
            except httpx.HTTPError:
                return serve.poll() is not None
        assert wait_until(up, 60, 0.2) and serve.poll() is None, \
            (tmp_path / "serve.log").read_text()[-3000:]
        fleet = LinkFleet(broker, repo.keys.public_file("command"), BOXES, tmp_path / "sim",
                          step_s=0.2).connect()
        try:
            walk(desk, env, port, viewer_block, operator_block, host, config)
        finally:
            fleet.close()


def walk(desk: Desk, env: dict[str, str], port: int, viewer_block: str, operator_block: str,
         host: Path, config: Path) -> None:
    """Vic's and Olivia's blocks at the desk, against the running controller."""
    auth = {"Authorization": f"Bearer {(host / 'vic.token').read_text().strip()}"}
    # The test's own probe (by address, so not checking the name): both boxes known.
    assert wait_until(lambda: len(httpx.get(
        f"https://{desk.host_ip}:{port}/devices", verify=False, headers=auth).json()[
            "devices"]) == len(BOXES), 60, 0.2)

    # The desk: the page's blocks, one command at a time, the exports carried along.
    desk_env = dict(env)
    outputs: list[tuple[str, subprocess.CompletedProcess[str]]] = []
    for block in (viewer_block, operator_block):
        block = block.replace("controller.example:9464", f"controller.example:{port}")
        block = block.replace("gemma3:270m@2", f"{RELEASE}@2").replace("--soak 10s",
                                                                      "--soak 1s")
        block = block.replace("--name gemma3:270m ", f"--name {RELEASE} ")
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line.startswith("export "):
                key, _, value = line.removeprefix("export ").partition("=")
                desk_env[key] = value
                continue
            done = desk.run(line, desk_env)
            outputs.append((line, done))
            if "# refused" in line:
                assert done.returncode == 1, (line, done.stdout, done.stderr)
                assert "is a viewer" in done.stderr and "needs operator" in done.stderr
            else:
                assert done.returncode == 0, (line, done.stdout, done.stderr)

    by_command = {line.split("#")[0].strip(): done for line, done in outputs}
    devices = by_command["edge-agent fleet devices"].stdout
    assert all(box in devices and "online" in devices for box in BOXES), devices
    final = json.loads(by_command["edge-agent fleet rollout status ro-desk-1 --watch "
                                  "--json"].stdout)
    assert final["state"] == "COMPLETED", final
    assert sorted((d["device"], d["state"]) for d in final["devices"]) == \
        [(box, "ACTIVE") for box in BOXES]
    assert [(a["operator"], a["action"], a["status"]) for a in final["actions"]] == \
        [("olivia", "rollout.start", 200)]
    pushed = by_command["edge-agent fleet release push gemma3-270m.gguf --name "
                        f"{RELEASE} --version 2 --template gemma.jinja --parameters "
                        "params.json --keys ./release-keys --root ./root.json"]
    assert f"published {RELEASE}@2" in pushed.stdout and "verified from root.json" in \
        pushed.stdout, pushed.stdout
    # A base model's release carries the catalog's template and stop strings, printed at
    # the desk (which installs no model): a box serving chats would roll it back without.
    shown = subprocess.run(
        [sys.executable, "-m", "edge_agent", "fleet", "release", "show", f"{RELEASE}@2",
         "--json", "--config", str(config)], capture_output=True, text=True, timeout=60,
        env=env, check=True)
    manifest = json.loads(shown.stdout)["manifest"]
    catalog = read_catalog(packaged_catalog_dir())[ModelName.parse("gemma3:270m")]
    assert manifest["chat_template"] == catalog.chat_template
    assert manifest["parameters"]["stop"] == catalog.parameters["stop"]
    assert final["actions"][0]["source"] == f"{desk.host_ip[:-1]}2"  # from the desk
    audit = by_command["edge-agent fleet audit --target ro-desk-1"].stdout
    assert "olivia" in audit and "rollout.start" in audit and "done" in audit

