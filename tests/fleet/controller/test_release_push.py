"""`fleet release push` from a desk: the targets key at the desk only, a real `fleet serve`
over HTTPS, an operator's token and the release root. The release is signed on top of
metadata verified from the root, published through the API, verified again, and a box's
view of the repository (the same chain, then the file) finds it; a viewer, a second push of
the same version and a root from another repository are refused."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from edge_agent.fleet.controller.releases.push import trusted_targets
from edge_agent.fleet.sim.testbed import make_tls
from tests.support.brokers import Mosquitto, free_port
from tests.support.fleetkit import wait_until
from tests.support.releasekit import sized_gguf
from tests.support.rolloutkit import ENV, ROOT, cli

pytestmark = [pytest.mark.broker]


def test_a_desk_pushes_a_release_it_signed_and_a_box_finds_it_verified(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    broker = mosquitto_factory().start()
    ca = make_tls(tmp_path / "tls")
    port, state = free_port(), tmp_path / "ctl"
    config = tmp_path / "controller.toml"
    config.write_text(
        f'state_dir = "{state}"\n[broker]\nurl = "{broker.url}"\n'
        f'username = "controller"\npassword_file = "{broker.password_file("controller")}"\n'
        f'[http]\nhost = "0.0.0.0"\nport = {port}\ntls_cert_file = "{ca.server_cert}"\n'
        f'tls_key_file = "{ca.server_key}"\n')
    host = ["--config", str(config)]
    cli("fleet", "keygen", *host)
    cli("fleet", "release", "init", *host)
    # The targets key goes to the desk and leaves the controller's host.
    desk = tmp_path / "desk"
    desk.mkdir()
    for name in ("targets.pem", "targets.pub.pem"):
        shutil.copy(state / "keys" / name, desk / name)
    (state / "keys" / "targets.pem").unlink()
    root = shutil.copy(state / "releases" / "metadata" / "root.json", desk / "root.json")
    tokens = {}
    for name, role in (("desk-op", "operator"), ("desk-view", "viewer")):
        tokens[name] = desk / f"{name}.token"
        tokens[name].write_text(cli("fleet", "operators", "create", name, "--role", role,
                                    *host).stdout)
    gguf = sized_gguf(tmp_path / "model.gguf", 0.5)
    url = f"https://127.0.0.1:{port}"

    def push(token: str, *extra: str, version: str = "2", root_file: Path = root
             ) -> subprocess.CompletedProcess[str]:
        return cli("fleet", "release", "push", str(gguf), "--name", "simmodel:1b",
                   "--version", version, "--keys", str(desk), "--root", str(root_file),
                   "--controller", url, "--token-file", str(tokens[token]), "--ca-file",
                   str(ca.ca_cert), *extra, check=False)

    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "fleet", "serve", *host],
                            env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=url, verify=str(ca.ca_cert), timeout=10) as box:
            def up() -> bool:
                try:
                    return box.get("/releases/metadata/root.json").status_code == 200
                except httpx.HTTPError:
                    return proc.poll() is not None
            assert wait_until(up, 60, 0.2) and proc.poll() is None, \
                (tmp_path / "serve.log").read_text()

            viewer = push("desk-view")
            assert viewer.returncode == 1 and "operator 'desk-view' is a viewer: PUT " \
                "/release-files/" in viewer.stderr, viewer.stderr
            local = cli("fleet", "release", "push", str(gguf), "--name", "simmodel:1b",
                        "--version", "2", "--keys", str(desk), "--root", str(root), *host,
                        check=False)
            assert local.returncode == 2 and "--controller https://HOST:PORT" in local.stderr

            pushed = push("desk-op", "--json")
            assert pushed.returncode == 0, pushed.stdout + pushed.stderr
            answer = json.loads(pushed.stdout)
            sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
            assert answer["verified_targets_version"] == answer["targets_version"] == 2
            assert [(r["name"], r["version"], r["sha256"]) for r in answer["releases"]] == [
                ("simmodel:1b", "2", sha)]
            assert answer["uploaded"] == {"sha256": sha, "length": gguf.stat().st_size,
                                          "stored": True}

            # A box's view: the chain from root over HTTPS, then the file by its path.
            work = tmp_path / "box"
            work.mkdir()
            found = trusted_targets(box, root.read_bytes(), work).signed.targets
            info = found["simmodel/1b/2/model.gguf"]
            served = box.get(f"/releases/targets/{info.get_prefixed_paths()[0]}")
            assert hashlib.sha256(served.content).hexdigest() == info.hashes["sha256"] == sha

            again = push("desk-op")
            assert again.returncode == 1 and "release simmodel:1b@2 exists" in again.stderr
            other = tmp_path / "other"  # a root from another repository: nothing signed
            cli("fleet", "keygen", "--out", str(other / "keys"), "--state-dir", str(other))
            cli("fleet", "release", "init", "--keys", str(other / "keys"), "--state-dir",
                str(other))
            stranger = push("desk-op", version="3",
                            root_file=other / "releases" / "metadata" / "root.json")
            assert stranger.returncode == 1 and "does not verify from" in stranger.stderr

            listed = json.loads(cli("fleet", "release", "list", "--json", *host).stdout)
            assert [(e["name"], e["version"], e["sha256"]) for e in listed] == [
                ("simmodel:1b", "2", sha)]
            audit = json.loads(cli("fleet", "audit", "--json", *host).stdout)
            assert [(a["operator"], a["action"], a["status"]) for a in audit
                    if a["action"].startswith(("release.", "PUT"))] == [
                ("desk-view", f"PUT /release-files/{sha}", 403),
                ("desk-op", "release.upload", 200),
                ("desk-op", "release.publish", 200)]

            # An agent release signed at the same desk (`add-agent --controller`).
            house = tmp_path / "house"
            house.mkdir()
            for name in ("edge_agent_appliance-0.2.0-py3-none-any.whl",
                         "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"):
                (house / name).write_bytes(name.encode())
            agent = cli("fleet", "release", "add-agent", "0.2.0", "--wheelhouse", str(house),
                        "--keys", str(desk), "--root", str(root), "--controller", url,
                        "--token-file", str(tokens["desk-op"]), "--ca-file",
                        str(ca.ca_cert), "--json", check=False)
            assert agent.returncode == 0, agent.stdout + agent.stderr
            added = json.loads(agent.stdout)["releases"]
            assert [(r["kind"], r["version"], r["target"]) for r in added] == [
                ("agent", "0.2.0", "agent/0.2.0/wheelhouse.tar")]
            work = tmp_path / "box-agent"
            work.mkdir()
            found = trusted_targets(box, root.read_bytes(), work).signed.targets
            assert found["agent/0.2.0/wheelhouse.tar"].custom["platform"] == "linux_x86_64"
            agents = json.loads(cli("fleet", "release", "agents", "--json", *host).stdout)
            assert [a["version"] for a in agents] == ["0.2.0"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in text, text[-3000:]
