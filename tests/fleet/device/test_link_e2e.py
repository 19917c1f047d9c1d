"""The fleet link in real processes: `edge-agent serve` with the real default model killed
with SIGKILL (the broker publishes its Will), a producing link killed mid-flush and
restarted (nothing lost, duplicates dropped by the controller), and a box whose broker is
not there (it serves as if it had no link; doctor says why)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from edge_agent.config import load_settings
from edge_agent.doctor import run_checks
from tests.conftest import DEFAULT_MODEL, clone_state, free_port, start_server
from tests.support.brokers import FLEET, Mosquitto, MQTTClient
from tests.support.fleetkit import Controller, statuses, wait_until

DEV = "store-x"
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "256",
       "EDGE_AGENT_TELEMETRY__HARDWARE": "false", "EDGE_AGENT_RUNTIME__THREADS": "1"}


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV,)).start()


@pytest.fixture
def controller(broker: Mosquitto, tmp_path: Path) -> Iterator[Controller]:
    ctl = Controller(broker, tmp_path / "controller").start()
    yield ctl
    ctl.close()


def fleet_toml(broker_url: str, password_file: Path) -> str:
    return (f'[fleet]\nenabled = true\nbroker = "{broker_url}"\nfleet_id = "{FLEET}"\n'
            f'device_id = "{DEV}"\nusername = "{DEV}"\npassword_file = "{password_file}"\n'
            "reconnect_min_s = 0.2\nreconnect_max_s = 1.0\nkeepalive_s = 10\n")


def serve(config: Path, state: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--config",
                             str(config), "--state-dir", str(state), "--port", str(port)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.broker
def test_a_serving_agent_killed_with_sigkill_gets_its_will_with_the_births_bdseq(
        broker: Mosquitto, controller: Controller, model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    config = tmp_path / "config.toml"
    config.write_text(fleet_toml(broker.url, broker.password_file(DEV)))
    watcher = MQTTClient(broker, "controller")
    watcher.connect()
    watcher.subscribe(f"edge/v1/{FLEET}/{DEV}/status")
    port = free_port()
    proc = serve(config, state, port)
    try:
        assert wait_until(lambda: statuses(watcher, DEV), 15)
        birth = statuses(watcher, DEV)[0]
        n = birth["bdseq"]
        assert birth["type"] == "birth"
        assert [m["name"] for m in birth["models"] if m["active"]] == [DEFAULT_MODEL]
        assert all(len(m["digest"]) == 64 for m in birth["models"])
        assert wait_until(lambda: (controller.store.device(DEV) or {}).get("online"), 10)

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: len(statuses(watcher, DEV)) >= 2, 10)
        will = statuses(watcher, DEV)[1]
        assert will["type"] == "death" and will["bdseq"] == n
        assert will["boot_id"] == birth["boot_id"]
        assert wait_until(lambda: not controller.store.device(DEV)["online"], 10)

        proc = serve(config, state, port)
        assert wait_until(lambda: len(statuses(watcher, DEV)) >= 3, 15)
        again = statuses(watcher, DEV)[2]
        assert again["type"] == "birth" and again["bdseq"] == n + 1
        assert again["boot_id"] != birth["boot_id"]

        proc.send_signal(signal.SIGTERM)  # a clean stop: the agent publishes its death
        # uvicorn shuts down gracefully, then raises the signal again: -15 after a clean stop.
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert wait_until(lambda: len(statuses(watcher, DEV)) >= 4, 10)
        death = statuses(watcher, DEV)[3]
        assert death["type"] == "death" and death["bdseq"] == n + 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        watcher.close()


def producer(broker: Mosquitto, state: Path, count: int, rate: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.fleet_producer", broker.url, DEV,
         str(broker.password_file(DEV)), str(state), str(count), str(rate)],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def read_until(proc: subprocess.Popen[str], done: Callable[[str], bool],
               timeout: float = 30) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if done(lines[-1]):
            return lines
    raise AssertionError(f"the producer said: {lines[-5:]}")


@pytest.mark.broker
def test_a_link_killed_mid_flush_resends_its_old_boot_and_leaves_no_gap(
        broker: Mosquitto, controller: Controller, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = producer(broker, state, 100_000, 3000)
    old_boot = read_until(first, lambda line: line.startswith("boot"))[-1].split()[1]
    read_until(first, lambda line: line == "emitted 2000")

    def committed_rows() -> int:
        with sqlite3.connect(f"{(state / 'outbox.db').as_uri()}?mode=ro", uri=True) as conn:
            row = conn.execute("SELECT last_seq FROM boots WHERE boot_id = ?",
                               [old_boot]).fetchone()
        return int(row[0]) if row else 0

    # Emitted is not yet committed: beside a load the outbox's writer trails the producer.
    deadline = time.monotonic() + 120
    while committed_rows() < 1000:
        assert time.monotonic() < deadline and first.poll() is None, committed_rows()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)  # committing and publishing as fast as it can
    first.wait(10)
    with sqlite3.connect(f"{(state / 'outbox.db').as_uri()}?mode=ro", uri=True) as conn:
        (committed,) = conn.execute("SELECT last_seq FROM boots WHERE boot_id = ?",
                                    [old_boot]).fetchone()
        (unacked,) = conn.execute("SELECT COUNT(*) FROM outbox").fetchone()
    assert committed >= 1000 and unacked > 0  # killed with rows the controller lacked

    second = producer(broker, state, 200, 1000)
    new_boot = read_until(second, lambda line: line.startswith("boot"))[-1].split()[1]
    read_until(second, lambda line: line == "drained")
    assert second.wait(15) == 0

    stored = controller.stored(DEV)
    assert set(stored) == {old_boot, new_boot}
    assert stored[old_boot] == [[1, committed]]  # all the old boot committed, once each
    assert stored[new_boot] == [[1, stored[new_boot][0][1]]] and stored[new_boot][0][1] >= 200
    assert controller.gaps(DEV) == {}
    assert controller.count(DEV) == sum(b - a + 1 for r in stored.values() for a, b in r)
    with sqlite3.connect(state / "outbox.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM outbox").fetchone() == (0,)


@pytest.mark.integration
def test_with_the_broker_unreachable_the_box_serves_and_doctor_says_why(
        model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    password = tmp_path / "password"
    password.write_text("secret\n")
    nowhere = f"mqtt://127.0.0.1:{free_port()}"
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 256,
        "fleet.enabled": True, "fleet.broker": nowhere, "fleet.fleet_id": FLEET,
        "fleet.device_id": DEV, "fleet.username": DEV, "fleet.password_file": password})
    started = time.monotonic()
    live = start_server(settings)  # returns once /ready says the model is loaded
    try:
        link = live.app.state.fleet_link
        assert link is not None and not link.connected
        r = httpx.post(f"{live.base_url}/api/generate", timeout=60, json={
            "model": DEFAULT_MODEL, "prompt": "Hi", "stream": False,
            "options": {"num_predict": 4}})
        assert r.status_code == 200 and r.json()["done"]
        assert time.monotonic() - started < 60
        assert link.counts.get("connect_failures", 0) >= 1
        checks = {c.name: c for c in run_checks(settings)}
        broker = checks["fleet broker"]
        assert broker.status == "warn" and "connection refused" in broker.detail
        assert "serves without the link" in broker.detail and broker.fix
        assert checks["fleet files"].status == "ok"
    finally:
        stop_started = time.monotonic()
        live.stop()
        assert time.monotonic() - stop_started < 15
