"""The controller end to end on a real Mosquitto: a plain paho publisher plays the device,
the controller stores each message once and acknowledges ranges; births and deaths move
devices online and offline; a restart (in process, and `fleet serve` killed with SIGKILL)
loses nothing; /metrics, /devices and `fleet devices` answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.config import ConfigError
from edge_agent.config.controller import ControllerSettings, load_controller_settings
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.ingest import Ingest, Rejected, inbound, status
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.service import Controller
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.protocol.envelope import merge_ranges
from edge_agent.fleet.protocol.topics import Topic
from tests.support.brokers import FLEET, Mosquitto, MQTTClient, free_port

A, B = "store-a", "store-b"
BOOT = "0123456789abcdef0123456789abcdef"


def envelope(seq: int, *, device: str = A, boot: str = BOOT, kind: str = "metrics",
             body: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"v": 1, "device": device, "boot_id": boot, "seq": seq, "kind": kind,
                       "class": "metrics" if kind == "metrics" else "audit",
                       "ts": time.time(), "body": body or {"requests": seq}},
                      separators=(",", ":")).encode()


def birth(bdseq: int, device: str = A) -> bytes:
    return json.dumps({"v": 1, "type": "birth", "device": device, "fleet": FLEET,
                       "boot_id": BOOT, "bdseq": bdseq, "ts": time.time(),
                       "agent_version": "0.1.0", "llama_cpp_version": "0.3.36",
                       "models": [{"name": "smollm2:135m", "digest": "d", "active": True}],
                       "tenants": ["default"]}).encode()


def death(bdseq: int, device: str = A) -> bytes:
    return json.dumps({"v": 1, "type": "death", "device": device, "fleet": FLEET,
                       "boot_id": BOOT, "bdseq": bdseq, "ts": time.time()}).encode()


def settings_for(broker: Mosquitto, state: Path, **flags: Any) -> ControllerSettings:
    return load_controller_settings(None, **{
        "state_dir": state, "broker.url": broker.url,
        "broker.password_file": broker.password_file("controller"),
        "http.port": free_port(), **flags})


class Acked:
    """What a device learnt from its acks: the ranges per boot, merged."""

    def __init__(self, client: MQTTClient, device: str = A) -> None:
        self.client, self.topic = client, f"edge/v1/{FLEET}/{device}/ack"

    def ranges(self, boot: str = BOOT) -> list[list[int]]:
        got: list[list[int]] = []
        for _, payload, _ in self.client.received(self.topic):
            msg = json.loads(payload)
            assert msg["v"] == 1
            got += msg["acks"].get(boot, [])
        return merge_ranges(got)

    def covers(self, first: int, last: int, timeout: float = 30.0) -> bool:
        return self.client.wait(lambda: self.ranges() == [[first, last]], timeout)


@pytest.fixture
def device(mosquitto: Mosquitto) -> Iterator[MQTTClient]:
    client = MQTTClient(mosquitto, A)
    assert not client.connect().is_failure
    client.subscribe(f"edge/v1/{FLEET}/{A}/ack")
    yield client
    client.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def controller(request: pytest.FixtureRequest, mosquitto: Mosquitto,
               tmp_path: Path) -> Iterator[Controller]:
    """A controller in this process on the session's broker, storing in SQLite, then in
    PostgreSQL (a fresh database each time)."""
    db = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    # A client id of its own, and no session left behind on the shared broker.
    running = Controller.open(settings_for(
        mosquitto, tmp_path / "ctl", db=db, **{"broker.client_id": f"ctl-{os.urandom(4).hex()}",
                                              "broker.session_expiry_s": 0}))
    running.ingest.start()
    assert running.ingest.wait_connected(10)
    yield running
    running.close()


def counter(metrics: ControllerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


# -- checks of what arrives ----------------------------------------------------------------

def test_envelopes_and_statuses_are_checked_against_their_topic() -> None:
    topic = Topic(FLEET, A, "metrics")
    assert inbound(topic, envelope(3), 1.0).seq == 3
    for bad in (b"{", b"[1]", b'{"v":1,"ts":NaN}', b"\xff",
                envelope(1, device=B), envelope(1, kind="events"), envelope(0),
                envelope(1, boot="a/b"), envelope(1).replace(b'"seq":1', b'"seq":true')):
        with pytest.raises(Rejected):
            inbound(topic, bad, 1.0)
    st = Topic(FLEET, A, "status")
    assert status(st, birth(1))["type"] == "birth"
    for bad in (b"", death(-1), birth(1, device=B), b'{"v":1,"type":"x","bdseq":1}'):
        with pytest.raises(Rejected):
            status(st, bad)


def test_settings_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "controller.toml"
    path.write_text('db = "postgresql://fleet@db/fleet"\n[broker]\nurl = "mqtts://b:8884"\n'
                    'ca_file = "/ca.pem"\n[http]\nport = 9000\n')
    settings = load_controller_settings(path, **{"http.port": 9001, "broker.username": None})
    assert (settings.broker.address, settings.http.port) == (("b", 8884, True), 9001)
    assert settings.db == "postgresql://fleet@db/fleet"
    assert settings.broker.username == "controller"
    path.write_text('[broker]\nurl = "http://b"\n')
    with pytest.raises(ConfigError, match="broker.url"):
        load_controller_settings(path)
    with pytest.raises(ConfigError, match="broker.ca_file"):
        load_controller_settings(None, **{"broker.ca_file": "/ca.pem"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_controller_settings(tmp_path / "missing.toml")


# -- the ingest on a real broker -----------------------------------------------------------

@pytest.mark.broker
def test_each_message_is_stored_once_and_acked_as_ranges(
        device: MQTTClient, controller: Controller) -> None:
    n = 600
    # Every 10th twice, the copy right after it (so the ack of n comes after every copy).
    order = [seq for s in range(1, n + 1) for seq in ([s, s] if s % 10 == 1 else [s])]
    for seq in order:
        device.client.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(seq), qos=1)
    acked = Acked(device)
    assert acked.covers(1, n), acked.ranges()
    store = controller.store
    assert store.stored_ranges(A, BOOT) == [[1, n]]
    assert store.gaps(A, BOOT) == []
    assert len(store.messages(A, limit=10 * n)) == n
    m = controller.metrics
    assert counter(m, "edge_fleet_messages_ingested_total", kind="metrics") == n
    assert counter(m, "edge_fleet_messages_duplicate_total") == n // 10
    assert counter(m, "edge_fleet_acks_sent_total") >= 1


@pytest.mark.broker
def test_what_breaks_the_protocol_is_dropped_counted_and_survived(
        mosquitto: Mosquitto, device: MQTTClient, controller: Controller) -> None:
    other = MQTTClient(mosquitto, "controller")  # only the controller user may reach these
    assert not other.connect().is_failure
    try:
        other.publish(f"edge/v1/{FLEET}/store.x/metrics", envelope(1))  # a bad id
        other.publish(f"edge/v1/{FLEET}/{A}/unknown", envelope(1))
        other.publish(f"edge/v1/{FLEET}/{A}/cmd", b"{}")  # a command: not ours to read
    finally:
        other.close()
    device.publish(f"edge/v1/{FLEET}/{A}/metrics", b"not json")
    device.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(1, device=B))
    device.publish(f"edge/v1/{FLEET}/{A}/status", b'{"v":1,"type":"birth"}')
    huge_ts = json.dumps({**json.loads(envelope(2)), "ts": 10**400}).encode()
    device.publish(f"edge/v1/{FLEET}/{A}/metrics", huge_ts)  # once raised in paho's callback
    device.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(1))
    assert Acked(device).covers(1, 1)
    m = controller.metrics
    assert controller.store.messages(A) and len(controller.store.messages(A)) == 1
    assert counter(m, "edge_fleet_messages_rejected_total", reason="topic") == 2
    assert counter(m, "edge_fleet_messages_rejected_total", reason="json") == 1
    assert counter(m, "edge_fleet_messages_rejected_total", reason="envelope") == 2
    assert counter(m, "edge_fleet_messages_rejected_total", reason="status") == 1
    assert counter(m, "edge_fleet_messages_ignored_total") == 1
    known = [d["device"] for d in controller.store.devices()]
    assert A in known and "store.x" not in known and B not in known


@pytest.mark.broker
def test_birth_and_death_with_the_bdseq_rule_and_the_will(
        mosquitto: Mosquitto, controller: Controller) -> None:
    topic = f"edge/v1/{FLEET}/{B}/status"
    store = controller.store

    def online() -> bool | None:
        found = store.device(B)
        return None if found is None else found["online"]

    def until(expected: bool | None) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if online() is expected:
                return True
            time.sleep(0.02)
        return False

    b = MQTTClient(mosquitto, B)
    assert not b.connect().is_failure
    b.publish(topic, birth(7, B), retain=True)
    assert until(True)
    b.publish(topic, death(6, B), retain=True)  # an older session's Will: ignored
    b.publish(topic, birth(8, B), retain=True)
    b.publish(f"edge/v1/{FLEET}/{B}/events", envelope(1, device=B, kind="events"))
    deadline = time.monotonic() + 10
    while (store.device(B) or {}).get("bdseq") != 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert online() is True
    b.close()
    # The Will of the session with bdseq 9, fired by an unclean end of the connection.
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    w = MQTTClient(mosquitto, B)
    w.client.will_set(topic, death(9, B), qos=1, retain=True)
    assert not w.connect().is_failure
    w.publish(topic, birth(9, B), retain=True)
    w.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT,
                                              "Disconnect with will message"))
    w.client.loop_stop()
    assert until(False)
    found = store.device(B)
    assert found is not None and found["bdseq"] == 9 and found["last_death"] is not None
    assert counter(controller.metrics, "edge_fleet_status_messages_total", type="death") >= 2
    clear = MQTTClient(mosquitto, B)  # leave no retained status on the shared broker
    assert not clear.connect().is_failure
    clear.publish(topic, b"", retain=True)
    clear.close()


@pytest.mark.broker
def test_a_controller_restart_and_a_broker_kill_lose_nothing_published_meanwhile(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    broker = mosquitto_factory().start()
    settings = settings_for(broker, tmp_path / "ctl")
    first = Controller.open(settings)
    first.ingest.start()
    assert first.ingest.wait_connected(10)  # the broker now keeps a session for it
    first.close()
    dev = MQTTClient(broker, A)
    assert not dev.connect().is_failure
    n = 1000
    for seq in range(1, n + 1):  # nobody is there to read them: the session queues them
        assert dev.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(seq)) in (0, 16)
    dev.close()
    time.sleep(2.5)  # autosave_interval 1: the queue is on disk
    broker.kill()
    broker.start()
    again = Controller.open(settings)
    again.ingest.start()
    try:
        deadline = time.monotonic() + 30
        while again.store.stored_ranges(A, BOOT) != [[1, n]] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert again.store.stored_ranges(A, BOOT) == [[1, n]]
        assert again.store.gaps(A, BOOT) == []
    finally:
        again.close()


class FlakyStore(SQLiteStore):
    """A SQLite store that can be made unreachable, or made to refuse one seq."""

    down = False
    poison: int | None = None

    def ingest(self, batch: Any) -> Any:
        if self.down:
            raise OSError("database unreachable")
        if any(m.seq == self.poison for m in batch):
            raise ValueError("a value the database refuses")
        return super().ingest(batch)

    def counts(self) -> tuple[int, int]:
        if self.down:
            raise OSError("database unreachable")
        return super().counts()


@pytest.fixture
def flaky(mosquitto: Mosquitto, tmp_path: Path) -> Iterator[tuple[Controller, FlakyStore]]:
    settings = settings_for(mosquitto, tmp_path / "ctl", **{
        "broker.client_id": f"ctl-{os.urandom(4).hex()}", "broker.session_expiry_s": 0})
    store = FlakyStore(tmp_path / "flaky.db")
    metrics = ControllerMetrics(store)
    running = Controller(settings, store, metrics, Ingest(settings, store, metrics))
    running.ingest.start()
    assert running.ingest.wait_connected(10)
    yield running, store
    running.close()


@pytest.mark.broker
def test_nothing_is_acked_while_the_store_is_down_and_all_of_it_after(
        device: MQTTClient, flaky: tuple[Controller, FlakyStore]) -> None:
    controller, store = flaky
    store.down = True
    for seq in range(1, 51):
        device.client.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(seq), qos=1)
    assert not device.wait(lambda: bool(device.received(f"edge/v1/{FLEET}/{A}/ack")), 1.5)
    assert counter(controller.metrics, "edge_fleet_store_errors_total") >= 1
    store.down = False
    assert Acked(device).covers(1, 50)
    assert store.stored_ranges(A, BOOT) == [[1, 50]]


@pytest.mark.broker
def test_a_message_the_store_refuses_does_not_hold_back_the_others(
        device: MQTTClient, flaky: tuple[Controller, FlakyStore]) -> None:
    controller, store = flaky
    store.poison = 13
    for seq in range(1, 31):
        device.client.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(seq), qos=1)
    acked = Acked(device)
    assert device.wait(lambda: acked.ranges() == [[1, 12], [14, 30]], 15), acked.ranges()
    assert store.gaps(A, BOOT) == [[13, 13]]  # lost, and the gap check says so
    assert counter(controller.metrics, "edge_fleet_messages_rejected_total", reason="store") == 1


# -- the HTTP side and the CLI ------------------------------------------------------------

def filled_store(path: Path) -> SQLiteStore:
    store = SQLiteStore(path)
    store.birth(FLEET, A, json.loads(birth(3)), time.time())
    store.ingest([Inbound(FLEET, A, "metrics", BOOT, 1, "metrics", time.time(),
                          {"requests": {"ok": 5}, "ttft_p50_ms": 80}, time.time()),
                  Inbound(FLEET, B, "events", BOOT, 1, "audit", time.time(), {"e": 1},
                          time.time())])
    return store


def test_an_operator_sees_gaps_and_duplicates_from_the_cli_and_the_api(tmp_path: Path) -> None:
    """A's boot: seqs 1 and 3 stored (2 lost), 1 sent twice. `fleet devices` flags A with
    its missing seq and names it below the table; --json and /devices/{id} have the
    ranges per boot; B (nothing lost) says none."""
    store = filled_store(tmp_path / "controller.db")
    now = time.time()
    store.ingest([Inbound(FLEET, A, "metrics", BOOT, s, "metrics", now,
                          {"outbox": {"depth": 7}} if s == 3 else {}, now) for s in (1, 3)])
    store.close()
    runner = CliRunner()
    table = runner.invoke(main, ["fleet", "devices", "--state-dir", str(tmp_path)])
    assert table.exit_code == 0, table.output
    row_a = next(line for line in table.output.splitlines() if line.startswith(A))
    row_b = next(line for line in table.output.splitlines() if line.startswith(B))
    assert "1 MISSING, 1 dup" in row_a and " 7 " in row_a
    assert "none" in row_b and "MISSING" not in row_b
    assert f"1 device(s) with gaps (messages lost): {A}" in table.output
    listed = json.loads(runner.invoke(main, ["fleet", "devices", "--json", "--state-dir",
                                             str(tmp_path)]).output)
    loss = next(d for d in listed if d["device"] == A)["loss"]
    assert loss["boots"][0]["gaps"] == [[2, 2]] and loss["boots"][0]["duplicates"] == 1
    store = SQLiteStore(tmp_path / "controller.db")
    http = TestClient(create_app(store, ControllerMetrics(store), broker_connected=lambda: True))
    assert http.get(f"/devices/{A}").json()["loss"]["missing"] == 1
    store.close()


def test_metrics_and_devices_answer(tmp_path: Path) -> None:
    store = filled_store(tmp_path / "controller.db")
    metrics = ControllerMetrics(store)
    http = TestClient(create_app(store, metrics, broker_connected=lambda: True))
    text = http.get("/metrics").text
    assert f'edge_fleet_device_up{{device="{A}",fleet="{FLEET}"}} 1.0' in text
    assert f'edge_fleet_device_up{{device="{B}",fleet="{FLEET}"}} 0.0' in text
    assert "edge_fleet_devices 2.0" in text and "edge_fleet_devices_online 1.0" in text
    assert f'edge_fleet_device_last_seen_seconds{{device="{A}"' in text
    assert "edge_fleet_store_up 1.0" in text
    devices = http.get("/devices").json()["devices"]
    assert [(d["device"], d["online"], d["active_models"]) for d in devices] == [
        (A, True, ["smollm2:135m"]), (B, False, [])]
    assert http.get(f"/devices/{A}").json()["agent_version"] == "0.1.0"
    assert http.get("/devices/nobody").status_code == 404
    assert http.get("/devices/a.b").status_code == 400
    latest = http.get(f"/devices/{A}/metrics").json()["metrics"]
    assert latest[0]["body"]["ttft_p50_ms"] == 80
    assert http.get("/healthz").json() == {"broker_connected": True, "store": "ok"}
    store.close()
    assert "edge_fleet_store_up 0.0" in http.get("/metrics").text  # closed: still answers


def test_fleet_devices_and_metrics_print_the_device(tmp_path: Path) -> None:
    filled_store(tmp_path / "controller.db").close()
    runner = CliRunner()
    result = runner.invoke(main, ["fleet", "devices", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    devices = json.loads(result.output)
    assert devices[0]["device"] == A and devices[0]["online"] is True
    table = runner.invoke(main, ["fleet", "devices", "--state-dir", str(tmp_path)])
    assert A in table.output and "online" in table.output and "smollm2:135m" in table.output
    one = runner.invoke(main, ["fleet", "metrics", A, "--json", "--state-dir", str(tmp_path)])
    assert json.loads(one.output)["metrics"]["body"]["requests"] == {"ok": 5}
    every = runner.invoke(main, ["fleet", "metrics", "--all", "--state-dir", str(tmp_path)])
    assert "requests.ok" in every.output and f"{B}: no metrics yet" in every.output
    assert runner.invoke(main, ["fleet", "metrics", "--state-dir", str(tmp_path)]).exit_code == 2
    missing = runner.invoke(main, ["fleet", "devices", "--state-dir", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "no controller store" in missing.output


# -- the real process --------------------------------------------------------------------

def _serve(broker: Mosquitto, state: Path, port: int, **env: str) -> subprocess.Popen[bytes]:
    """`edge-agent fleet serve` as its own process (its log in serve.log beside the state)."""
    with open(state.parent / "serve.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "edge_agent", "fleet", "serve", "--state-dir", str(state),
             "--broker", broker.url, "--username", "controller",
             "--password-file", str(broker.password_file("controller")), "--port", str(port),
             "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=log,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3]), **env})


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "fleet serve exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").json().get("broker_connected"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("fleet serve did not become healthy")


@pytest.mark.broker
def test_fleet_serve_killed_mid_stream_loses_nothing_and_duplicates_nothing(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    broker = mosquitto_factory().start()
    state, port = tmp_path / "state", free_port()
    state.mkdir()
    proc = _serve(broker, state, port)
    try:
        _wait_healthy(port, proc)
        dev = MQTTClient(broker, A)
        assert not dev.connect().is_failure
        dev.subscribe(f"edge/v1/{FLEET}/{A}/ack")
        dev.publish(f"edge/v1/{FLEET}/{A}/status", birth(1), retain=True)
        n = 5000
        started = time.monotonic()
        for seq in range(1, n + 1):
            dev.client.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(seq), qos=1)
            if seq == n // 3:
                # Let some of the stream reach the store, then kill the controller mid-flow.
                dev.wait(lambda: bool(Acked(dev).ranges()), 10)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                proc = _serve(broker, state, port)
        _wait_healthy(port, proc)
        assert Acked(dev).covers(1, n, timeout=60), Acked(dev).ranges()
        elapsed = time.monotonic() - started
        dups = [line for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
                if line.startswith("edge_fleet_messages_duplicate_total")]
        print(f"\n{n} messages through a controller SIGKILLed mid-stream: {elapsed:.1f} s; "
              f"after the restart: {dups}")
        devices = httpx.get(f"http://127.0.0.1:{port}/devices").json()["devices"]
        assert [(d["device"], d["online"]) for d in devices] == [(A, True)]
        assert "edge_fleet_devices_online 1.0" in httpx.get(
            f"http://127.0.0.1:{port}/metrics").text
        dev.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    store = SQLiteStore(state / "controller.db")
    try:
        assert store.stored_ranges(A, BOOT) == [[1, n]] and store.gaps(A, BOOT) == []
        assert len(store.messages(A, limit=2 * n)) == n  # once each
    finally:
        store.close()
    listed = CliRunner().invoke(main, ["fleet", "devices", "--json", "--state-dir", str(state)])
    assert json.loads(listed.output)[0]["device"] == A


@pytest.mark.broker
def test_ingest_throughput_with_acks(device: MQTTClient, controller: Controller) -> None:
    """The figure: one plain publisher, a controller storing (SQLite, FULL) and acking."""
    n = 5000
    started = time.monotonic()
    for seq in range(1, n + 1):
        device.client.publish(f"edge/v1/{FLEET}/{A}/metrics", envelope(seq), qos=1)
    assert Acked(device).covers(1, n, timeout=60)
    rate = n / (time.monotonic() - started)
    kind = type(controller.store).__name__
    print(f"\ningest with acks: {rate:.0f} msg/s ({n} messages, {kind})")
    assert rate > 300  # a floor against a regression to one commit per message


@pytest.mark.broker
def test_fleet_serve_tells_systemd_ready_pings_its_watchdog_and_says_stopping(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    """Type=notify: READY=1 only once the ingest is subscribed (the broker starts late
    here), WATCHDOG=1 at half of WATCHDOG_USEC, STOPPING=1 on SIGTERM."""
    import signal
    import socket

    broker = mosquitto_factory()
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    port = free_port()
    proc = _serve(broker, tmp_path / "state", port, NOTIFY_SOCKET=path,
                  WATCHDOG_USEC="400000")
    got: list[tuple[float, str]] = []

    def read_until(done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            try:
                got.append((time.monotonic(), sock.recv(4096).decode()))
            except TimeoutError:
                pass

    try:
        read_until(lambda: any("STATUS=starting: connecting" in m for _, m in got), 30)
        assert not any("READY=1" in m for _, m in got)  # no broker yet: not ready
        broker.start()
        read_until(lambda: any("READY=1" in m for _, m in got), 60)
        assert any("READY=1" in m for _, m in got), got
        got.clear()
        read_until(lambda: False, 2.0)
        pings = [t for t, m in got if m == "WATCHDOG=1"]
        # Every 0.2 s: about 10 in 2 s; a loaded box delays some, none stops them.
        assert 3 <= len(pings) <= 14, got
        proc.send_signal(signal.SIGTERM)
        read_until(lambda: any("STOPPING=1" in m for _, m in got), 30)
        assert any("STOPPING=1" in m for _, m in got), got
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        sock.close()
