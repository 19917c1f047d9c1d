from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.config import load_settings
from edge_agent.doctor import _tls
from edge_agent.engine.models.catalog import ModelStore
from tests.conftest import DEFAULT_MODEL, clone_state, free_port
from tests.support.certs import StoreCA


def _doctor(state: Path, *extra: str) -> tuple[int, list[dict[str, str]]]:
    result = CliRunner().invoke(main, ["doctor", "--json", "--state-dir", str(state), *extra],
                                env={"EDGE_AGENT_SERVER__PORT": str(free_port())})
    return result.exit_code, json.loads(result.output)


def test_doctor_passes_on_a_healthy_install(model_cache: Path, tmp_path: Path) -> None:
    code, checks = _doctor(clone_state(model_cache, tmp_path / "s"))
    assert code == 0, checks
    by_name = {c["name"]: c for c in checks}
    assert by_name[f"model {DEFAULT_MODEL}"]["status"] == "ok"
    assert by_name["state dir"]["status"] == "ok"
    assert "AVX" in by_name["llama.cpp"]["detail"] or "CPU" in by_name["llama.cpp"]["detail"]
    assert by_name["gpu"]["status"] == "ok" and by_name["port"]["status"] == "ok"


def test_doctor_fails_on_a_corrupted_blob(model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "s")
    blob = ModelStore(state).get(DEFAULT_MODEL).blob_path(state)
    data = bytearray(blob.read_bytes())
    blob.unlink()  # a hard link to the shared cache: replace, do not edit in place
    data[len(data) // 3] ^= 0x01
    blob.write_bytes(bytes(data))
    code, checks = _doctor(state)
    assert code == 1
    bad = next(c for c in checks if c["name"] == f"model {DEFAULT_MODEL}")
    assert bad["status"] == "fail" and "digest" in bad["detail"] and "models rm" in bad["fix"]


def test_doctor_fails_on_a_state_dir_it_cannot_write() -> None:
    # As root, permissions do not stop writes; procfs refuses new files to everyone.
    code, checks = _doctor(Path("/proc/self"))
    assert code == 1
    check = next(c for c in checks if c["name"] == "state dir")
    assert check["status"] == "fail" and "not writable" in check["detail"]
    assert "chown" in check["fix"]


def test_doctor_fails_on_files_another_user_left_in_the_state_dir(model_cache: Path,
                                                                  tmp_path: Path) -> None:
    """What a command run as root leaves (here a lock folder of another uid): named, with
    the chown that fixes it; the rest of the state dir is fine."""
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    state = clone_state(model_cache, tmp_path / "s")
    stray = state / "rollouts" / ".names"
    stray.mkdir(parents=True)
    (stray / "x.lock").write_text("")
    for path in (stray, stray / "x.lock"):
        os.chown(path, 4242, 4242)
    code, checks = _doctor(state)
    assert code == 1
    check = next(c for c in checks if c["name"] == "state ownership")
    assert check["status"] == "fail" and check["detail"].startswith("2 file(s) not owned by")
    assert "rollouts/.names" in check["detail"] and f"chown -R root: {state}" in check["fix"]
    for path in (stray, stray / "x.lock"):
        os.chown(path, 0, 0)
    code, checks = _doctor(state)
    assert next(c for c in checks if c["name"] == "state ownership")["status"] == "ok"


def test_doctor_fails_when_the_port_is_taken(model_cache: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(main, ["doctor", "--state-dir", str(
            clone_state(model_cache, tmp_path / "s"))], env={"EDGE_AGENT_SERVER__PORT": str(port)})
    assert result.exit_code == 1
    assert f"fail  port: 127.0.0.1:{port} is taken" in result.output


def test_doctor_checks_the_port_it_is_given_as_serve_is(model_cache: Path,
                                                        tmp_path: Path) -> None:
    """`--port` (and `--host`) as serve takes them: a second box on one machine is checked
    on its own port, not the config file's."""
    state = clone_state(model_cache, tmp_path / "s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        given = CliRunner().invoke(main, ["doctor", "--state-dir", str(state), "--host",
                                          "127.0.0.1", "--port", str(port)])
        default = CliRunner().invoke(main, ["doctor", "--state-dir", str(state), "--json"])
    assert given.exit_code == 1
    assert f"fail  port: 127.0.0.1:{port} is taken" in given.output
    assert str(port) not in default.output


def test_doctor_warns_of_a_draft_model_that_is_not_installed(model_cache: Path,
                                                              tmp_path: Path) -> None:
    config = tmp_path / "edge-agent.toml"
    config.write_text(f'[models."{DEFAULT_MODEL}"]\ndraft_model = "tiny:1m"\n'
                      '[models."other:1b"]\ndraft_model = "' + DEFAULT_MODEL + '"\n')
    code, checks = _doctor(clone_state(model_cache, tmp_path / "s"), "--config", str(config))
    assert code == 0, checks  # the model serves without guesses: a warning, not a failure
    by_name = {c["name"]: c for c in checks}
    missing = by_name[f"draft model of {DEFAULT_MODEL}"]
    assert missing["status"] == "warn" and "tiny:1m is not installed" in missing["detail"]
    assert missing["fix"] == "edge-agent models pull tiny:1m"
    assert by_name["draft model of other:1b"]["status"] == "ok"


# -- HTTPS: the certificate files as the service will load them -------------------------

def _tls_checks(state: Path, cert: Path, key: Path, **more: str) -> dict[str, dict[str, str]]:
    settings = load_settings(None, state_dir=state, **{
        "server.tls_cert_file": str(cert), "server.tls_key_file": str(key), **more})
    return {c.name: c.__dict__ for c in _tls(settings)}


def test_doctor_fails_on_an_expired_certificate(model_cache: Path, tmp_path: Path) -> None:
    ca = StoreCA(tmp_path / "ca")
    old = ca.issue("old", start_days=-60, days=-2)
    config = tmp_path / "edge-agent.toml"
    config.write_text(f'[server]\ntls_cert_file = "{old.cert}"\ntls_key_file = "{old.key}"\n')
    code, checks = _doctor(clone_state(model_cache, tmp_path / "s"), "--config", str(config))
    assert code == 1
    by_name = {c["name"]: c for c in checks}
    assert by_name["tls certificate"]["status"] == "fail"
    assert "CN=old" in by_name["tls certificate"]["detail"]
    assert "expired on" in by_name["tls certificate"]["detail"]
    assert "systemctl reload edge-agent" in by_name["tls certificate"]["fix"]
    assert by_name["tls key"]["status"] == "ok"


def test_doctor_warns_of_a_certificate_near_its_end_and_of_one_not_yet_valid(
        tmp_path: Path) -> None:
    ca = StoreCA(tmp_path / "ca")
    soon, later, fine = ca.issue("soon", days=5), ca.issue("later", start_days=2), \
        ca.issue("fine", days=90)
    checks = _tls_checks(tmp_path, soon.cert, soon.key)
    assert checks["tls certificate"]["status"] == "warn"
    assert "(5 days)" in checks["tls certificate"]["detail"]
    checks = _tls_checks(tmp_path, later.cert, later.key)
    assert checks["tls certificate"]["status"] == "fail"
    assert "is not valid before" in checks["tls certificate"]["detail"]
    checks = _tls_checks(tmp_path, fine.cert, fine.key, **{
        "server.tls_client_ca_file": str(ca.cert)})
    assert [c["status"] for c in checks.values()] == ["ok", "ok", "ok"], checks
    assert "(90 days)" in checks["tls certificate"]["detail"]
    assert checks["tls client CA"]["detail"].startswith("1 CA certificate(s)")


def test_doctor_fails_on_a_key_of_another_certificate_or_open_to_others(
        tmp_path: Path) -> None:
    ca = StoreCA(tmp_path / "ca")
    a, b = ca.issue("a"), ca.issue("b")
    checks = _tls_checks(tmp_path, a.cert, b.key)
    assert checks["tls key"]["status"] == "fail"
    assert checks["tls key"]["detail"] == f"{b.key} is not the key of {a.cert}"
    assert checks["tls certificate"]["status"] == "ok"
    a.key.chmod(0o640)
    checks = _tls_checks(tmp_path, a.cert, a.key)
    assert checks["tls key"]["status"] == "fail"
    assert "0640, open to other users" in checks["tls key"]["detail"]
    assert "chmod 600" in checks["tls key"]["fix"]
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate\n")
    checks = _tls_checks(tmp_path, bogus, a.key)
    assert checks["tls certificate"]["status"] == "fail"
    assert "holds no PEM certificate" in checks["tls certificate"]["detail"]


def test_doctor_fails_on_a_key_the_service_user_cannot_read(tmp_path: Path) -> None:
    """The service user is the state dir's owner: a key left root's and 0600 (copied in
    as root) stops its start, though root, running doctor, reads it."""
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    ca = StoreCA(tmp_path / "ca")
    pair = ca.issue("box")
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 4242, 4242)
    checks = _tls_checks(state, pair.cert, pair.key)
    assert checks["tls key"]["status"] == "fail"
    assert "is not readable by 4242, the service user" in checks["tls key"]["detail"]
    assert checks["tls key"]["fix"].startswith(f"chown 4242 {pair.key}")
    for path in (pair.cert, pair.key):
        os.chown(path, 4242, 4242)
    assert {c["status"] for c in _tls_checks(state, pair.cert, pair.key).values()} == {"ok"}


def test_doctor_warns_of_a_lan_address_without_tls(tmp_path: Path) -> None:
    lan = {c.name: c for c in _tls(load_settings(None, state_dir=tmp_path, **{
        "server.host": "0.0.0.0"}))}
    assert lan["tls"].status == "warn" and "served in clear" in lan["tls"].detail
    local = {c.name: c for c in _tls(load_settings(None, state_dir=tmp_path))}
    assert local["tls"].status == "info"
