"""`fleet serve-releases`: the controller's release repository read-only to the boxes, on a
listener of its own over HTTPS from the fleet's CA. A box looks a release up (TUF) and
downloads it through it, trusting only `fleet.artifacts_ca_file`; the fresh metadata is
`no-cache`; nothing of the controller's API is there; a write is refused."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from edge_agent.fleet.controller.pki import FleetCA
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.release.source import Pace, ReleaseSource
from tests.support.brokers import free_port, wait_port
from tests.support.releasekit import device_settings, make_repo, sized_gguf
from tests.support.rolloutkit import ENV, ROOT


def test_a_box_looks_up_and_downloads_a_release_over_https_from_the_release_server(
        tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "ctl")
    entry = repo.add(sized_gguf(tmp_path / "m.gguf", 2), "shop:1", "1")
    ca = FleetCA.init(tmp_path / "pki")
    ca.issue("releases", "releases", dns=["localhost"], ips=["127.0.0.1"])
    port = free_port()
    config = tmp_path / "controller.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "ctl" / "state"}"\n[releases]\nhost = "127.0.0.1"\n'
        f'port = {port}\ntls_cert_file = "{ca.folder / "releases.pem"}"\n'
        f'tls_key_file = "{ca.folder / "releases.key"}"\n')
    log = (tmp_path / "releases.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "fleet", "serve-releases",
                             "--config", str(config)], env=ENV, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}/releases/"
    try:
        wait_port(port, 120, proc)
        device = tmp_path / "device"
        settings = device_settings(device, repo.root_file, url,
                                   **{"fleet.artifacts_ca_file": str(ca.cert_file)})
        release = ReleaseSource(settings.fleet, device).lookup("shop:1", "1")
        path = transfer.download(release, transfer.downloads_dir(device),
                                 pace=Pace.of(settings.fleet))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
        with httpx.Client(verify=str(ca.cert_file), timeout=30) as http:
            for fresh in ("metadata/timestamp.json", "metadata/1.root.json"):
                got = http.get(url + fresh)
                assert got.status_code == 200, fresh
                if fresh.endswith("timestamp.json"):
                    assert got.headers["cache-control"] == "no-cache"
            for path_ in ("/devices", "/console/login", "/metrics", "/openapi.json",
                          "/releases/repo.json", "/releases/../controller.db"):
                missing = http.get(f"https://127.0.0.1:{port}{path_}")
                assert missing.status_code == 404, path_
                assert set(missing.json()) == {"error"}, path_
            write = http.put(url + "metadata/timestamp.json", content=b"{}")
            assert write.status_code == 405 and set(write.json()) == {"error"}
        # Without the fleet's CA the box trusts nothing it serves.
        untrusted = device_settings(tmp_path / "other", repo.root_file, url)
        with pytest.raises(Exception, match="(?i)certificate|unreachable"):
            ReleaseSource(untrusted.fleet, tmp_path / "other").lookup("shop:1", "1")
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert proc.returncode in (0, -15), (tmp_path / "releases.log").read_text()
