"""`fleet serve` off loopback: HTTPS from `[http] tls_cert_file`/`tls_key_file`, refused in
clear or without an operator, its certificate reloaded on SIGHUP; an operator's desk
reaching it with only the controller's CA, a token and the URL."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from edge_agent.config import ConfigError
from edge_agent.config.controller import load_controller_settings
from edge_agent.fleet.controller.audit import local_operator
from edge_agent.fleet.controller.service import exposure_checked
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.sim.testbed import make_tls
from edge_agent.tls import fingerprint, served_certificate
from tests.support.brokers import Mosquitto, free_port
from tests.support.fleetkit import wait_until
from tests.support.rolloutkit import ENV, ROOT, cli


def test_an_exposed_controller_needs_tls_and_an_operator(tmp_path: Path) -> None:
    ca = make_tls(tmp_path / "tls")
    store = SQLiteStore(tmp_path / "controller.db")
    try:
        def check(**http: object) -> object:
            return exposure_checked(load_controller_settings(None, **{
                "state_dir": tmp_path, **{f"http.{k}": v for k, v in http.items()}}), store)

        assert check() is None  # loopback, plain HTTP: as before
        with pytest.raises(ConfigError, match="is not loopback: the API would carry"):
            check(host="0.0.0.0")
        tls = {"tls_cert_file": ca.server_cert, "tls_key_file": ca.server_key}
        with pytest.raises(ConfigError, match="no operator exists: create one first"):
            check(host="0.0.0.0", **tls)
        store.operators.create_operator("root", "admin", 1.0)
        served = check(host="0.0.0.0", **tls)
        assert served is not None and served.fingerprint == fingerprint(ca.server_cert)
        ca.server_key.chmod(0o644)
        with pytest.raises(ConfigError, match="http.tls_cert_file / tls_key_file: .*owner"):
            check(**tls)
        with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
            check(tls_cert_file=ca.server_cert)
    finally:
        store.close()


@pytest.mark.broker
def test_a_desk_reaches_the_controller_over_https_and_a_reload_keeps_it_up(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    broker = mosquitto_factory().start()
    ca = make_tls(tmp_path / "tls")
    live_cert, live_key = tmp_path / "live.pem", tmp_path / "live.key"
    shutil.copy(ca.server_cert, live_cert)
    shutil.copy(ca.server_key, live_key)
    live_key.chmod(0o600)
    port = free_port()
    config = tmp_path / "controller.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "ctl"}"\n[broker]\nurl = "{broker.url}"\n'
        f'username = "controller"\npassword_file = "{broker.password_file("controller")}"\n'
        f'[http]\nhost = "0.0.0.0"\nport = {port}\ntls_cert_file = "{live_cert}"\n'
        f'tls_key_file = "{live_key}"\n')
    serve = [sys.executable, "-m", "edge_agent", "fleet", "serve", "--config", str(config)]
    refused = subprocess.run(serve, env=ENV, cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "no operator exists: create one first" in refused.stderr
    token = cli("fleet", "operators", "create", "desk", "--role", "viewer", "--config",
                str(config)).stdout.strip()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(serve, env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        with httpx.Client(verify=str(ca.ca_cert), timeout=10) as desk:
            def up() -> bool:
                try:
                    return desk.get(f"{url}/healthz", headers=auth).status_code == 200
                except httpx.HTTPError:
                    return proc.poll() is not None  # ended: stop waiting, fail below
            assert wait_until(up, 60, 0.2) and proc.poll() is None, \
                (tmp_path / "serve.log").read_text()
            assert desk.get(f"{url}/devices", headers=auth).json() == {"devices": []}
            assert desk.get(f"{url}/devices").status_code == 401  # not loopback: tokens
            # The same commands from the desk: the URL, the CA and a token file, no store.
            token_file = tmp_path / "desk.token"
            token_file.write_text(token + "\n")
            remote = ["--controller", url, "--token-file", str(token_file), "--ca-file",
                      str(ca.ca_cert)]
            assert json.loads(cli("fleet", "devices", "--json", *remote).stdout) == []
            desk_file = tmp_path / "desk.toml"  # or a desk's own file, with no flag
            desk_file.write_text(f'[controller]\nurl = "{url}"\ntoken_file = "{token_file}"\n'
                                 f'ca_file = "{ca.ca_cert}"\n')
            assert json.loads(cli("fleet", "devices", "--json", "--config",
                                  str(desk_file)).stdout) == []
            refused = cli("fleet", "rollout", "start", "x:1b@1", "--waves", "100%", *remote,
                          check=False)
            assert refused.returncode == 1 and "edge-agent: operator 'desk' is a viewer: " \
                "POST /rollouts needs operator" in refused.stderr
            signing = cli("fleet", "send", "store-a", "ping", "--key", str(ca.server_key),
                          *remote, check=False)
            assert signing.returncode == 2 and "--key: through --controller, the controller " \
                "signs" in signing.stderr
            untrusted = cli("fleet", "devices", "--controller", url, "--token-file",
                            str(token_file), check=False)  # the system CAs do not know it
            assert untrusted.returncode == 1 and "cannot reach the controller" in \
                untrusted.stderr
            audit = json.loads(cli("fleet", "audit", "--json", *remote).stdout)
            assert [(a["operator"], a["action"], a["status"]) for a in audit] == [
                (local_operator(), "operators.create", 200),
                ("desk", "POST /rollouts", 403)]  # a write its role does not allow
            assert desk.get(f"{url}/metrics").status_code == 401
            with pytest.raises(httpx.HTTPError):  # no plain HTTP on the port
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)

            renewed = make_tls(tmp_path / "tls2")  # the CA renews the certificate
            shutil.copy(renewed.server_cert, live_cert)
            shutil.copy(renewed.server_key, live_key)
            proc.send_signal(signal.SIGHUP)
            wanted = fingerprint(renewed.server_cert)
            assert wait_until(lambda: (der := served_certificate("127.0.0.1", port))
                              is not None and fingerprint(der) == wanted, 20, 0.2)
            assert proc.poll() is None  # SIGHUP reloads; it does not end the controller
        with httpx.Client(verify=str(renewed.ca_cert), timeout=10) as desk:
            assert desk.get(f"{url}/devices", headers=auth).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    assert "TLS certificate reloaded" in (tmp_path / "serve.log").read_text()
