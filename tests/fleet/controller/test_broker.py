"""`fleet broker-config` and what it gives a real Mosquitto: each device its own tree and
its fleet's commands, the controller everything, nobody else anything."""

from __future__ import annotations

import base64
import hashlib
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from click.testing import CliRunner
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.cli import main
from edge_agent.config import ConfigError
from edge_agent.fleet.controller.broker import (
    BrokerPlan,
    acl_text,
    hash_password,
    read_devices,
    write_broker_config,
)
from edge_agent.fleet.sim.testbed import find_mosquitto, free_port, wait_port
from tests.support.brokers import FLEET, Mosquitto, MQTTClient

A, B = "store-a", "store-b"


def test_a_bad_id_refuses_the_whole_run_naming_its_line(tmp_path: Path) -> None:
    devices = tmp_path / "devices.txt"
    devices.write_text("# the stores\nstore-1\n\nstoreB/x\nstore-3\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["fleet", "broker-config", "--devices", str(devices),
                                       "--out", str(out), "--fleet", "f1"])
    assert result.exit_code == 2, result.output
    assert f"{devices}:4:" in result.output and "'/'" in result.output
    assert not out.exists()


@pytest.mark.parametrize(("text", "why"), [
    ("a\nb\na\n", "repeats line 1"), ("a\nall\n", "reserved"), ("# none\n", "no device"),
    ("a\nb+c\n", "'+'"),
])
def test_the_devices_file_is_checked(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "devices.txt"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_devices(path)
    assert why in str(info.value)


def test_a_bad_fleet_or_controller_user_is_refused(tmp_path: Path) -> None:
    devices = tmp_path / "devices.txt"
    devices.write_text("store-1\n")
    runner = CliRunner()
    for extra in (["--fleet", "f/1"], ["--controller-user", "store-1"],
                  ["--controller-user", "a#"]):
        result = runner.invoke(main, ["fleet", "broker-config", "--devices", str(devices),
                                      "--out", str(tmp_path / "out"), *extra])
        assert result.exit_code == 2, (extra, result.output)
    assert not (tmp_path / "out").exists()


def test_files_are_private_and_a_rerun_keeps_the_passwords(tmp_path: Path) -> None:
    devices = tmp_path / "devices.txt"
    devices.write_text("store-1\nstore-2\n")
    out = tmp_path / "out"
    args = ["fleet", "broker-config", "--devices", str(devices), "--out", str(out),
            "--fleet", "f1", "--json"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    for path in (out / "passwd", out / "credentials" / "store-1.txt",
                 out / "credentials" / "controller.txt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    password = (out / "credentials" / "store-1.txt").read_text().strip()
    assert len(password) >= 32
    devices.write_text("store-1\nstore-2\nstore-3\n")
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert '"store-3"' in again.output.split('"new_passwords"')[1]
    assert (out / "credentials" / "store-1.txt").read_text().strip() == password
    users = [line.split(":")[0] for line in (out / "passwd").read_text().splitlines()]
    assert users == ["store-1", "store-2", "store-3", "controller"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left


def test_the_acl_lets_a_device_send_only_what_devices_send() -> None:
    text = acl_text(BrokerPlan(fleet="f1", devices=("d1", "d2")))
    assert "pattern" not in text  # explicit lines: no %u to reach through
    block = text.split("user d1\n")[1].split("\n\n")[0]
    assert block.splitlines() == [
        "topic write edge/v1/f1/d1/cmd/result", "topic write edge/v1/f1/d1/events",
        "topic write edge/v1/f1/d1/ledger", "topic write edge/v1/f1/d1/metrics",
        "topic write edge/v1/f1/d1/rollout", "topic write edge/v1/f1/d1/status",
        "topic read edge/v1/f1/d1/ack", "topic read edge/v1/f1/d1/cmd",
        "topic read edge/v1/f1/all/cmd"]
    assert "user controller\ntopic readwrite edge/v1/#" in text


def test_our_hash_is_mosquittos_pbkdf2_format() -> None:
    salt = bytes(range(12))
    got = hash_password("secret", salt=salt)
    _, kind, rounds, salt64, key64 = got.split("$")
    assert (kind, rounds) == ("7", "101")
    assert base64.b64decode(salt64) == salt
    assert base64.b64decode(key64) == hashlib.pbkdf2_hmac("sha512", b"secret", salt, 101, 64)


def test_the_conf_has_persistence_and_the_tls_listener(tmp_path: Path) -> None:
    from edge_agent.fleet.controller.broker import TLSFiles

    plan = BrokerPlan(fleet="f1", devices=("d1",), tls=TLSFiles(Path("/c.pem"), Path("/k.pem")),
                      data_dir=tmp_path / "data", conf_dir=Path("/etc/mosquitto/edge"))
    files = write_broker_config(plan, tmp_path / "out", use_tool=False)
    conf = files.conf.read_text()
    for line in ("per_listener_settings false", "allow_anonymous false", "persistence true",
                 "password_file /etc/mosquitto/edge/passwd", "listener 1883 127.0.0.1",
                 "listener 8883", "certfile /c.pem", "keyfile /k.pem",
                 f"persistence_location {tmp_path / 'data'}/"):
        assert line in conf.splitlines(), line


# -- on a real Mosquitto ---------------------------------------------------------------



@pytest.fixture
def connect(mosquitto: Mosquitto) -> Iterator[Callable[..., MQTTClient]]:
    made: list[MQTTClient] = []

    def make(user: str | None, **kwargs: object) -> MQTTClient:
        client = MQTTClient(mosquitto, user, **kwargs)  # type: ignore[arg-type]
        made.append(client)
        reason = client.connect()
        assert not reason.is_failure, reason
        return client

    yield make
    for client in made:
        client.close()


@pytest.mark.broker
def test_a_device_cannot_read_another_devices_topics(
        mosquitto: Mosquitto, connect: Callable[..., MQTTClient]) -> None:
    a, b, controller = connect(A), connect(B), connect("controller")
    a.subscribe(f"edge/v1/{FLEET}/{B}/#", "edge/v1/#", f"edge/v1/{FLEET}/{A}/#")
    assert b.publish(f"edge/v1/{FLEET}/{B}/metrics", b"b-secret") in (0, 16)
    controller.publish(f"edge/v1/{FLEET}/{B}/cmd", b"b-command")
    controller.publish(f"edge/v1/{FLEET}/{B}/ack", b"b-ack")
    # A marker on A's own topic, published after: once it is there, anything of B routed
    # to A would have arrived before it.
    controller.publish(f"edge/v1/{FLEET}/{A}/cmd", b"marker")
    assert a.wait(lambda: any(p == b"marker" for _, p, _ in a.received()))
    assert [t for t, _, _ in a.received() if f"/{B}/" in t] == []


@pytest.mark.broker
def test_a_device_cannot_publish_into_another_devices_topics(
        connect: Callable[..., MQTTClient]) -> None:
    a, controller = connect(A), connect("controller")
    controller.subscribe("edge/v1/#")
    assert a.publish(f"edge/v1/{FLEET}/{B}/metrics", b"forged") == 0x87
    assert a.publish(f"edge/v1/{FLEET}/{B}/status", b"forged", retain=True) == 0x87
    assert a.publish(f"edge/v1/other/{A}/metrics", b"forged") == 0x87  # another fleet
    assert a.client.is_connected()  # refused, not disconnected
    assert a.publish(f"edge/v1/{FLEET}/{A}/metrics", b"mine") in (0, 16)
    assert controller.wait(lambda: bool(controller.received(f"edge/v1/{FLEET}/{A}/")))
    assert all(p != b"forged" for _, p, _ in controller.received())


@pytest.mark.broker
@pytest.mark.parametrize("kind", ["ack", "cmd"])
def test_a_device_cannot_publish_an_ack_or_a_command_even_on_its_own_topics(
        kind: str, connect: Callable[..., MQTTClient]) -> None:
    """A second client with a box's own credentials forging the controller's side: the
    broker refuses it (MQTT 5 PUBACK 0x87) and delivers nothing to the box."""
    a, box = connect(A), connect(A, client_id="the-box")
    box.subscribe(f"edge/v1/{FLEET}/{A}/ack", f"edge/v1/{FLEET}/{A}/cmd")
    forged = b'{"v":1,"acks":{"' + b"0" * 32 + b'":[[1,1000000]]}}'
    assert a.publish(f"edge/v1/{FLEET}/{A}/{kind}", forged) == 0x87
    assert a.client.is_connected()
    assert a.publish(f"edge/v1/{FLEET}/{A}/metrics", b"mine") in (0, 16)  # still a device
    controller = connect("controller")
    controller.publish(f"edge/v1/{FLEET}/{A}/{kind}", b"marker")
    assert box.wait(lambda: any(p == b"marker" for _, p, _ in box.received()))
    assert all(p != forged for _, p, _ in box.received())


@pytest.mark.broker
def test_a_device_reads_its_fleets_commands_but_cannot_send_them(
        connect: Callable[..., MQTTClient]) -> None:
    a, controller = connect(A), connect("controller")
    a.subscribe(f"edge/v1/{FLEET}/all/cmd")
    assert a.publish(f"edge/v1/{FLEET}/all/cmd", b"forged") == 0x87
    controller.publish(f"edge/v1/{FLEET}/all/cmd", b"everyone")
    assert a.wait(lambda: bool(a.received(f"edge/v1/{FLEET}/all/cmd")))
    assert [p for _, p, _ in a.received()] == [b"everyone"]


@pytest.mark.broker
def test_the_controller_reads_everything(connect: Callable[..., MQTTClient]) -> None:
    a, b, controller = connect(A), connect(B), connect("controller")
    controller.subscribe("edge/v1/+/+/#")
    a.publish(f"edge/v1/{FLEET}/{A}/events", b"a")
    b.publish(f"edge/v1/{FLEET}/{B}/cmd/result", b"b")
    assert controller.wait(lambda: len(controller.received()) >= 2)
    assert sorted(t for t, _, _ in controller.received()) == [
        f"edge/v1/{FLEET}/{A}/events", f"edge/v1/{FLEET}/{B}/cmd/result"]


@pytest.mark.broker
@pytest.mark.parametrize(("user", "password"), [
    (A, "wrong"), ("nobody", "x"), (None, None), (A, ""),
])
def test_a_wrong_password_an_unknown_user_or_none_is_refused(
        mosquitto: Mosquitto, user: str | None, password: str | None) -> None:
    client = MQTTClient(mosquitto, user, password=password)
    try:
        reason = client.connect()
        assert reason.is_failure and reason.value in (0x86, 0x87), reason
    finally:
        client.close()


@pytest.mark.broker
def test_the_tls_listener_works_with_the_generated_ca(
        mosquitto: Mosquitto, connect: Callable[..., MQTTClient]) -> None:
    a = connect(A, tls=True)
    a.subscribe(f"edge/v1/{FLEET}/{A}/cmd")
    connect("controller", tls=True).publish(f"edge/v1/{FLEET}/{A}/cmd", b"over tls")
    assert a.wait(lambda: bool(a.received()))


@pytest.mark.broker
def test_the_tls_listener_refuses_a_client_that_does_not_trust_its_ca(
        mosquitto: Mosquitto, tmp_path: Path) -> None:
    from tests.support.brokers import make_tls

    other = make_tls(tmp_path / "other")
    client = MQTTClient(mosquitto, A, tls=True, ca=other.ca_cert)
    with pytest.raises(Exception, match="(?i)certificate"):
        client.connect(timeout=5)
    client.client.loop_stop()


def test_a_client_ca_makes_the_tls_listener_ask_for_certificates(tmp_path: Path) -> None:
    from edge_agent.fleet.controller.broker import TLSFiles

    plan = BrokerPlan(fleet="f1", devices=("d1",), data_dir=tmp_path / "data",
                      tls=TLSFiles(Path("/c.pem"), Path("/k.pem"), Path("/ca.pem")))
    lines = write_broker_config(plan, tmp_path / "out", use_tool=False).conf.read_text(
    ).splitlines()
    assert "cafile /ca.pem" in lines and "require_certificate true" in lines


@pytest.mark.broker
def test_with_a_client_ca_a_box_needs_its_certificate_and_its_password(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    """`broker-config --ca`: the TLS listener takes a box that shows a certificate of the
    fleet CA (`fleet pki issue NAME --kind box`) and its password; one without a
    certificate, with another CA's, or with a wrong password is refused."""
    from edge_agent.fleet.controller.pki import FleetCA
    from tests.support.brokers import make_tls

    broker = mosquitto_factory(tls=True, client_certs=True).start()
    assert broker.ca is not None
    fleet_ca = FleetCA(broker.ca.ca_cert.parent)
    fleet_ca.issue(A, "box")
    mine = (fleet_ca.folder / f"{A}.pem", fleet_ca.folder / f"{A}.key")
    good = MQTTClient(broker, A, tls=True, client_cert=mine)
    try:
        assert not good.connect(timeout=10).is_failure
    finally:
        good.close()
    make_tls(tmp_path / "other")  # another CA, its own box certificate
    other = FleetCA(tmp_path / "other")
    other.issue(A, "box")
    for cert in (None, (other.folder / f"{A}.pem", other.folder / f"{A}.key")):
        client = MQTTClient(broker, A, tls=True, client_cert=cert)
        try:
            # The handshake fails, or (TLS 1.3) the broker drops the line before a CONNACK.
            with pytest.raises((OSError, TimeoutError)):
                reason = client.connect(timeout=5)
                assert not reason.is_failure
                raise AssertionError("connected without the fleet's certificate")
        finally:
            client.client.loop_stop()
    wrong = MQTTClient(broker, A, tls=True, client_cert=mine, password="wrong")
    try:
        assert wrong.connect(timeout=10).is_failure
    finally:
        wrong.close()


@pytest.mark.broker
def test_the_broker_accepts_our_own_hashes_without_mosquitto_passwd(
        mosquitto_factory: Callable[..., Mosquitto]) -> None:
    broker = mosquitto_factory(passwd_tool=False).start()
    assert "$7$101$" in broker.files.passwd.read_text()
    good = MQTTClient(broker, A)
    bad = MQTTClient(broker, A, password="wrong")
    try:
        assert not good.connect().is_failure
        assert bad.connect().is_failure
    finally:
        good.close()
        bad.close()


@pytest.mark.broker
def test_a_rerun_keeps_a_broker_running_as_its_own_user_reading_its_files(
        request: pytest.FixtureRequest) -> None:
    """The manual's procedure as root: broker-config, `chown mosquitto:` on passwd and acl,
    Mosquitto started as root dropping to `mosquitto`; then a device is added (broker-config
    again) and the broker reloaded with SIGHUP. Every device, old and new, logs in after,
    and the files still belong to the broker's user."""
    if os.geteuid() != 0:
        pytest.skip("needs root: Mosquitto drops to its own user only when started as root")
    try:
        broker_user = pwd.getpwnam("mosquitto")
    except KeyError:
        pytest.skip("no mosquitto user (apt-get install mosquitto creates it)")
    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    # A folder the broker's user can walk into (pytest's own are 0700 all the way up).
    tmp_path = Path(tempfile.mkdtemp(prefix="edge-broker-"))
    tmp_path.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    devices, out, data = tmp_path / "devices.txt", tmp_path / "edge", tmp_path / "data"
    devices.write_text("store-1\nstore-2\n")
    port = free_port()
    args = ["fleet", "broker-config", "--devices", str(devices), "--out", str(out),
            "--fleet", FLEET, "--port", str(port), "--data-dir", str(data)]
    assert CliRunner().invoke(main, args).exit_code == 0
    data.mkdir()
    for path in (out / "passwd", out / "acl", data):
        os.chown(path, broker_user.pw_uid, broker_user.pw_gid)
    conf = tmp_path / "run.conf"
    conf.write_text((out / "mosquitto.conf").read_text() + "user mosquitto\n"
                    f"log_dest file {tmp_path / 'mosquitto.log'}\n")
    (tmp_path / "mosquitto.log").touch()
    os.chown(tmp_path / "mosquitto.log", broker_user.pw_uid, broker_user.pw_gid)
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 15, proc)
        assert _login(port, "store-1", out) == 0
        devices.write_text("store-1\nstore-2\nstore-3\n")
        again = CliRunner().invoke(main, args)
        assert again.exit_code == 0, again.output
        assert "kill -HUP" in again.output
        for name in ("passwd", "acl"):
            st = (out / name).stat()
            assert (st.st_uid, st.st_gid) == (broker_user.pw_uid, broker_user.pw_gid), name
        assert stat.S_IMODE((out / "passwd").stat().st_mode) == 0o600
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)  # the reload is asynchronous; a refused login would not recover
        assert proc.poll() is None, (tmp_path / "mosquitto.log").read_text()
        for user in ("store-1", "store-2", "store-3", "controller"):
            assert _login(port, user, out) == 0, (user, (tmp_path / "mosquitto.log").read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _login(port: int, user: str, out: Path) -> int:
    """The CONNACK reason code of a login with the credentials broker-config wrote."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"login-{user}",
                         protocol=mqtt.MQTTv5)
    client.username_pw_set(user, (out / "credentials" / f"{user}.txt").read_text().strip())
    codes: list[int] = []
    client.on_connect = lambda c, u, f, reason, p: codes.append(reason.value)
    client.connect("127.0.0.1", port)
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        client.loop(0.1)
    client.disconnect()
    return codes[0] if codes else -1
