"""The controller host's role (ansible/roles/fleet_controller) under a real systemd: a minimal
Debian 12 box booted with `systemd-nspawn -b` (tests/nspawnkit.py), provisioned from the
example inventory as the central team's administrator would, at its console, as root.

The box is what the box role's test starts from: `debootstrap --variant=minbase bookworm`
with systemd, dbus, python3, python3-venv and sudo; no Mosquitto, no PostgreSQL and no
network (`--private-network`). So the wheelhouse carries, besides this checkout's wheels,
the .deb files of Mosquitto and PostgreSQL and everything they need that the box lacks,
downloaded once against the box's own package lists (the manual's `apt-get download` step,
done for the closure) and kept in the test cache (tests/support/controllerhost.py). The
inventory is the example's, changed
as the manual tells a site to: the host in `controllers`, the broker's certificate in `pki/`
and its key in `group_vars/controllers/vault.yml` (made with `ansible-vault`).

`ansible-playbook playbook.yml --limit fleet-test -c local --vault-password-file …`
converges on the first run; after one more store in `hosts.yml` the second gives that store
a password and keeps every other one (each still logs in at the broker), reloading the
broker rather than restarting it; the third, with nothing new, changes nothing. Then:
Mosquitto, PostgreSQL and `fleet serve` run under systemd, `fleet serve` as `Type=notify`
with its watchdog, its store in PostgreSQL, its API answering the operators the role made
(and refusing who has no token), the release server (`fleet serve-releases`, the boxes'
artifacts URL) serving the repository read-only with its metadata `no-cache`,
`systemd-analyze security` of both loaded units at most 2.0, and the public halves the
stores need fetched into `pki/`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests import nspawnkit
from tests.support.ansiblebox import (
    CONTROLLER_LIB,
    Run,
    build_wheelhouse,
    readable,
    site_packages,
)
from tests.support.certs import StoreCA
from tests.support.controllerhost import (
    ANSIBLE,
    API,
    PACKAGES,
    ROOT,
    WHEELHOUSE_IN_BOX,
    ControllerHost,
    controller_debs,
    prepare,
    write_vault,
)

HOST = "fleet-test"
MAX_EXPOSURE = 2.0
RELEASES = "http://127.0.0.1:9465"  # the role's release server, on every address
NEW_STORE = "store-0099"
EXAMPLE = yaml.safe_load((ANSIBLE / "inventory" / "group_vars" / "controllers" / "main.yml")
                         .read_text())

pytestmark = [
    pytest.mark.provision,
    pytest.mark.skipif(nspawnkit.unavailable() is not None,
                       reason=f"no systemd box here: {nspawnkit.unavailable()}"),
]


@dataclass
class Central:
    """The provisioned controller host, its runs, and the CA its broker's certificate is
    from."""

    host: ControllerHost
    ca: StoreCA
    runs: dict[str, Run] = field(default_factory=dict)
    passwords: dict[str, dict[str, str]] = field(default_factory=dict)
    broker_pids: dict[str, str] = field(default_factory=dict)

    @property
    def box(self) -> nspawnkit.Box:
        return self.host.box

    @property
    def site(self) -> Path:
        return self.host.site

    def state(self, unit: str) -> dict[str, str]:
        return self.host.state(unit)

    def login(self, user: str, password: str) -> str:
        return self.host.login(user, password, self.ca.cert)


def _prepare(root: Path, ca: StoreCA) -> None:
    """Before the boot: the site's changes to the example inventory (the host in
    `controllers`, the broker's certificate in `pki/` and its key in the vault)."""
    broker = ca.issue("broker")
    prepare(root, host=HOST, pki={"broker.pem": broker.cert.read_bytes(),
                                  "fleet-ca.pem": ca.cert.read_bytes()},
            edit_hosts=lambda hosts: None)
    write_vault(root, {"vault_broker_tls_key": broker.key.read_text()})


def _add_store(central: Central, store: str) -> None:
    """What a site does for a new store: its name in a region of hosts.yml."""
    hosts_file = central.site / "inventory" / "hosts.yml"
    hosts = yaml.safe_load(hosts_file.read_text())
    hosts["stores"]["children"]["region_north"]["hosts"][store] = None
    hosts_file.write_text(yaml.safe_dump(hosts, sort_keys=False))


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("controller-wheelhouse")
    root, _ = nspawnkit.base_root()
    took = build_wheelhouse(where, str(ROOT))
    for deb in controller_debs(root):
        (where / deb.name).write_bytes(deb.read_bytes())
    readable(where)
    print(f"wheelhouse: {len(list(where.glob('*.whl')))} wheels and "
          f"{len(list(where.glob('*.deb')))} .deb files in {took:.0f} s")
    return where


@pytest.fixture(scope="module")
def central(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Central]:
    root, _ = nspawnkit.base_root()
    ca = StoreCA(tmp_path_factory.mktemp("fleet-ca"), "fleet CA")
    with nspawnkit.booted("controller", root, prepare=lambda r: _prepare(r, ca),
                          ro_binds=[(wheelhouse, WHEELHOUSE_IN_BOX),
                                    (site_packages(), CONTROLLER_LIB)]) as box:
        found = Central(ControllerHost(box, HOST), ca)
        try:
            # From scratch; with one more store in the inventory; then with nothing new.
            for name in ("first", "more", "again"):
                if name == "more":
                    _add_store(found, NEW_STORE)
                run = found.runs[name] = found.host.playbook()
                found.passwords[name] = found.host.credentials()
                found.broker_pids[name] = box.show("mosquitto.service", "MainPID")["MainPID"]
                print(f"ansible-playbook, {name} run: {run.seconds:.1f} s, ok={run.ok} "
                      f"changed={run.changed} failed={run.failed}")
                assert run.rc == 0 and run.failed == 0, run.output[-8000:] + found.host.logs()
            yield found
        finally:
            print(found.host.logs())


def test_the_first_run_installs_broker_and_database_and_converges(central: Central) -> None:
    first = central.runs["first"]
    assert first.changed > 0
    root, _ = nspawnkit.base_root()
    # The box started without them (its root has neither): the role installed them.
    assert not (root / "usr" / "sbin" / "mosquitto").exists()
    assert not list((root / "usr" / "lib").glob("postgresql/*/bin/postgres"))
    for package in PACKAGES:
        status = central.box.run("dpkg-query", "--show", "--showformat=${db:Status-Abbrev}",
                                 package).stdout.strip()
        assert status == "ii", (package, status)


def test_a_run_on_a_converged_host_changes_nothing(central: Central) -> None:
    again = central.runs["again"]
    assert again.changed == 0, again.output[-6000:]
    assert central.passwords["again"] == central.passwords["more"]
    assert central.broker_pids["again"] == central.broker_pids["more"]


def test_one_more_store_gets_a_password_and_every_other_keeps_its_own(central: Central) -> None:
    before, after = central.passwords["first"], central.passwords["more"]
    assert NEW_STORE not in before and NEW_STORE in after
    assert set(after) == set(before) | {NEW_STORE}
    assert {d: after[d] for d in before} == before
    assert central.runs["more"].changed > 0
    # Reloaded, not restarted: no box was disconnected to add one.
    assert central.broker_pids["more"] == central.broker_pids["first"]
    assert "Reloaded mosquitto.service" in central.box.journal("mosquitto.service", 40)
    for device, password in after.items():
        assert central.login(device, password) == "Success", device
    assert central.login(next(iter(before)), "not-its-password") != "Success"


def test_the_devices_are_every_store_of_the_inventory(central: Central) -> None:
    hosts = yaml.safe_load((central.site / "inventory" / "hosts.yml").read_text())
    stores = {h for region in hosts["stores"]["children"].values() for h in region["hosts"]}
    assert set(central.passwords["again"]) == stores
    assert EXAMPLE["fleet_controller_fleet_id"] in central.box.root.joinpath(
        "etc/mosquitto/edge-fleet/acl").read_text()
    # The controller expects each of them: no box reported here, each is never seen.
    token = next((central.site / "keys").glob(f"{HOST}.operator.*.token")).read_text()
    status, body = central.box.http("GET", f"{API}/devices", headers={
        "authorization": f"Bearer {token.strip()}"})
    assert status == 200, body
    listed = {d["device"]: d for d in json.loads(body)["devices"]}
    assert set(listed) == stores
    assert all(d["never_seen"] and d["fleet"] == EXAMPLE["fleet_controller_fleet_id"]
               and d["registered"]["by"] == "local:edge-agent-fleet" for d in listed.values())


def test_the_controller_runs_as_a_notify_unit_with_a_watchdog(central: Central) -> None:
    state = central.state("edge-agent-fleet.service")
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert state["Type"] == "notify"
    assert state["WatchdogUSec"] == "30s"
    for unit in ("mosquitto.service", "postgresql@15-main.service"):
        assert central.box.show(unit, "ActiveState")["ActiveState"] == "active", unit
    status, body = central.box.http("GET", f"{API}/healthz")
    assert status == 200, body


def test_the_release_timestamp_is_resigned_by_its_timer(central: Central) -> None:
    timer = central.box.show("edge-agent-fleet-timestamp.timer", "ActiveState",
                             "UnitFileState")
    assert timer == {"ActiveState": "active", "UnitFileState": "enabled"}, timer
    stamp = central.box.root / "var/lib/edge-agent-fleet/releases/metadata/timestamp.json"
    before = json.loads(stamp.read_text())["signed"]["version"]
    central.box.run("systemctl", "start", "edge-agent-fleet-timestamp.service")
    assert json.loads(stamp.read_text())["signed"]["version"] == before + 1
    done = central.box.show("edge-agent-fleet-timestamp.service", "Result", "ExecMainStatus")
    assert done == {"Result": "success", "ExecMainStatus": "0"}, \
        central.box.journal("edge-agent-fleet-timestamp.service")
    assert stamp.stat().st_uid == (central.box.root / "var/lib/edge-agent-fleet").stat().st_uid


def test_the_store_is_postgresql_on_the_local_socket(central: Central) -> None:
    tables = central.box.run("runuser", "-u", "postgres", "--", "psql", "-XtA", "-d",
                             "edge_fleet", "-c", "SELECT tablename FROM pg_tables "
                             "WHERE tableowner = 'edge-agent-fleet'").stdout.split()
    assert {"operators", "devices"} <= set(tables), tables
    assert not list(central.box.root.joinpath("var/lib/edge-agent-fleet").glob("*.db"))


def test_the_operators_tokens_work_and_nothing_else_does(central: Central) -> None:
    tokens = {p.name: p for p in (central.site / "keys").glob(f"{HOST}.operator.*.token")}
    assert set(tokens) == {f"{HOST}.operator.{name}.token"
                           for name in EXAMPLE["fleet_controller_operators"]}
    for path in tokens.values():
        assert path.stat().st_mode & 0o777 == 0o600
        status, body = central.box.http("GET", f"{API}/devices", headers={
            "authorization": f"Bearer {path.read_text().strip()}"})
        assert status == 200, body
    status, body = central.box.http("GET", f"{API}/devices")
    assert status == 401, body


def test_the_stores_get_the_public_halves_in_pki(central: Central) -> None:
    pki = central.site / "pki"
    state = central.box.root / "var/lib/edge-agent-fleet"
    assert (pki / "command.pub.pem").read_bytes() == \
        (state / "keys" / "command.pub.pem").read_bytes()
    root = json.loads((pki / "root.json").read_text())
    assert root["signed"]["_type"] == "root"


def test_the_release_server_serves_the_repository_read_only(central: Central) -> None:
    """The role's release server (`fleet serve-releases`, the boxes' artifacts URL) runs as
    a notify unit with a watchdog; the metadata a box must see fresh is `no-cache`, and
    nothing is written through it."""
    state = central.state("edge-agent-fleet-releases.service")
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert state["Type"] == "notify" and state["WatchdogUSec"] == "30s"
    fetch = ("import sys, urllib.request as u; r = u.urlopen(sys.argv[1], timeout=30); "
             "print(r.status, r.headers['Cache-Control']); sys.stdout.write(r.read().decode())")
    out = central.box.run("python3", "-c", fetch,
                          f"{RELEASES}/releases/metadata/root.json").stdout
    head, _, body = out.partition("\n")
    assert head == "200 no-cache", head
    served = central.box.root / "var/lib/edge-agent-fleet/releases/metadata/root.json"
    assert json.loads(body) == json.loads(served.read_text())
    status, text = central.box.http("PUT", f"{RELEASES}/releases/metadata/root.json", {})
    assert status == 405, text
    status, text = central.box.http("GET", f"{RELEASES}/devices")
    assert status == 404 and "only /releases/" in text, text  # no API there


@pytest.mark.parametrize("unit", ["edge-agent-fleet.service",
                                  "edge-agent-fleet-releases.service"])
def test_exposure_of_the_loaded_unit_is_at_most_two(
        central: Central, record_property: pytest.RecordProperty, unit: str) -> None:
    result = central.box.run("systemd-analyze", "security", "--no-pager", unit, check=False)
    found = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+\.\d+)",
                      result.stdout)
    assert found, result.stdout + result.stderr
    score = float(found.group(1))
    print(f"systemd-analyze security (running system): {unit}: {score}")
    record_property("exposure", score)
    assert score <= MAX_EXPOSURE, result.stdout


def test_a_reload_keeps_the_controller_running(central: Central) -> None:
    """`systemctl reload edge-agent-fleet` (the API's certificate read again) on a host
    without /bin/kill."""
    before = central.state("edge-agent-fleet.service")
    central.box.run("systemctl", "reload", "edge-agent-fleet.service")
    after = central.state("edge-agent-fleet.service")
    assert after["MainPID"] == before["MainPID"] and after["ActiveState"] == "active", after
    assert after["NRestarts"] == before["NRestarts"]


def test_the_watchdog_restarts_a_stopped_controller(central: Central) -> None:
    box = central.box
    pid = int(central.state("edge-agent-fleet.service")["MainPID"])
    box.sh(f"kill -STOP {pid}")  # the shell's kill: the host has no /bin/kill
    nspawnkit.wait_for(
        lambda: int(central.state("edge-agent-fleet.service")["MainPID"]) not in (0, pid)
        and central.state("edge-agent-fleet.service")["ActiveState"] == "active",
        120, 1.0, "edge-agent-fleet to be restarted by its watchdog")
    assert "Watchdog timeout" in box.journal("edge-agent-fleet.service", 80)
    status, body = box.http("GET", f"{API}/healthz")
    assert status == 200, body
