"""The controller host as the central team's administrator makes it: a booted box
(tests/nspawnkit.py) that starts without Mosquitto or PostgreSQL, the project's `ansible/` in
root's home with a site's changes to the example inventory, and the role
(ansible/roles/fleet_controller) run at its console (`-c local`).

The wheelhouse carries, besides this checkout's wheels, the .deb files of Mosquitto and
PostgreSQL and everything they need that the box lacks, downloaded once against the box's
own package lists (the manual's `apt-get download` step, done for the closure) and kept in
the test cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests import nspawnkit
from tests.support.ansiblebox import Run, install_ansible, vault_encrypt
from tests.support.machinecache import built_once

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = ROOT / "ansible"
ADMIN_HOME = "/root"
SITE = f"{ADMIN_HOME}/ansible"
WHEELHOUSE_IN_BOX = f"{SITE}/wheelhouse/x86_64-cpu"
VAULT_PASSWORD = "vault-9b1f-central"
PACKAGES = ("mosquitto", "postgresql")
API = "http://127.0.0.1:9464"
STATE_DIR = "/var/lib/edge-agent-fleet"
BROKER_TLS_PORT = 8883


def controller_debs(root: Path) -> list[Path]:
    """The .deb files of PACKAGES and what they need that `root` lacks, from `root`'s own
    apt sources and resolved against its own dpkg status, kept in the test cache (made
    once per machine: another test run may be fetching them at the same time)."""
    def fetch(staging: Path) -> None:
        work = staging / "apt"
        for sub in ("lists/partial", "cache/archives/partial"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        options = [f"-oDir::State::status={root}/var/lib/dpkg/status",
                   f"-oDir::Etc::sourcelist={root}/etc/apt/sources.list",
                   "-oDir::Etc::sourceparts=/nonexistent", f"-oDir::State::Lists={work}/lists",
                   f"-oDir::Cache={work}/cache", f"-oDir::Cache::archives={work}/cache/archives",
                   "-oDebug::NoLocking=1"]
        for args in (["update"], ["install", "-y", "--no-install-recommends", "--download-only",
                                  *PACKAGES]):
            result = subprocess.run(["apt-get", "-q", *options, *args], capture_output=True,
                                    text=True, timeout=600, check=False)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        for deb in (work / "cache" / "archives").glob("*.deb"):
            deb.rename(staging / deb.name)
        shutil.rmtree(work)
        (staging / "complete").touch()

    where = built_once(nspawnkit.CACHE / f"debs-{root.name}-controller", "complete", fetch)
    return sorted(where.glob("*.deb"))


def prepare(root: Path, *, host: str, pki: dict[str, bytes],
            edit_hosts: Callable[[dict[str, Any]], None]) -> Path:
    """Before the boot, through the host's view of the box: Ansible, the project's ansible/
    in root's home (`ADMIN_HOME`) with the site's inventory (`edit_hosts` changes
    `hosts.yml`; `host` is put in `controllers`) and `pki/` holding `pki`, and the vault
    password in a file. The site's folder, as the host sees it."""
    install_ansible(root)
    site = root / SITE.lstrip("/")
    subprocess.run(["cp", "-a", str(ANSIBLE), str(site)], check=True, timeout=60)
    for leftover in ("keys", "wheelhouse", "pki", "credentials", ".ansible"):
        subprocess.run(["rm", "-rf", str(site / leftover)], check=True, timeout=60)
    (site / "wheelhouse" / "x86_64-cpu").mkdir(parents=True)
    inventory = site / "inventory"
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    hosts["controllers"]["hosts"].setdefault(host, None)
    edit_hosts(hosts)
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    (site / "pki").mkdir()
    for name, data in pki.items():
        (site / "pki" / name).write_bytes(data)
    password_file = root / ADMIN_HOME.lstrip("/") / "vault-pass"
    password_file.write_text(VAULT_PASSWORD + "\n")
    password_file.chmod(0o600)
    return site


def write_vault(root: Path, secrets: dict[str, str]) -> None:
    """`group_vars/controllers/vault.yml`, encrypted with the site's vault password."""
    vault = root / SITE.lstrip("/") / "inventory" / "group_vars" / "controllers" / "vault.yml"
    vault.write_text(yaml.safe_dump(secrets))
    vault_encrypt(vault, root / ADMIN_HOME.lstrip("/") / "vault-pass")


@dataclass
class ControllerHost:
    """The booted controller host and its playbook runs."""

    box: nspawnkit.Box
    host: str
    runs: dict[str, Run] = field(default_factory=dict)

    @property
    def site(self) -> Path:
        return self.box.root / SITE.lstrip("/")

    def playbook(self, options: str = "") -> Run:
        """The role's run at the host's console; `options`, the command line after
        `playbook.yml` (by default the host alone, locally, the vault's password from its
        file)."""
        options = options or (f"--limit {self.host} -c local "
                              f"--vault-password-file {ADMIN_HOME}/vault-pass")
        started = time.monotonic()
        result = self.box.sh(f"cd {SITE} && ansible-playbook playbook.yml {options}",
                             timeout=900, check=False)
        return Run.of(result, time.monotonic() - started, self.host)

    def credentials(self) -> dict[str, str]:
        """Each device's broker password, as the role fetched them for the stores' vault."""
        return {p.stem: p.read_text().strip()
                for p in sorted((self.site / "credentials").glob("*.txt"))}

    def token(self, operator: str) -> str:
        return (self.site / "keys" / f"{self.host}.operator.{operator}.token").read_text().strip()

    def state(self, unit: str) -> dict[str, str]:
        return self.box.show(unit, "ActiveState", "SubState", "Type", "WatchdogUSec",
                             "NRestarts", "MainPID")

    def logs(self) -> str:
        return "".join(f"\n--- {unit} ---\n{self.box.journal(unit, 30)}"
                       for unit in ("edge-agent-fleet.service", "mosquitto.service",
                                    "edge-agent-fleet-releases.service"))

    def login(self, user: str, password: str, ca: Path) -> str:
        """The reason code the broker's TLS listener gives `user` (paho, in the host's
        network namespace, trusting `ca` as the boxes do)."""
        proc = self.box.net([sys.executable, "-c", _LOGIN, str(ca), user, password,
                             str(BROKER_TLS_PORT)])
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        return out.strip()


_LOGIN = """\
import sys, threading
import paho.mqtt.client as mqtt
ca, user, password, port = sys.argv[1:5]
got = threading.Event()
said = []
def on_connect(client, userdata, flags, reason, properties):
    said.append(str(reason))
    got.set()
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"login-{user}",
                     protocol=mqtt.MQTTv5)
client.username_pw_set(user, password)
client.tls_set(ca_certs=ca)
client.on_connect = on_connect
client.connect("127.0.0.1", int(port))
client.loop_start()
got.wait(20)
client.loop_stop()
print(said[0] if said else "no answer")
"""
