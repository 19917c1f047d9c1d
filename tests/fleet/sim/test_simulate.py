"""The fleet simulator (`edge_agent.fleet.sim.fleet`) against a real Mosquitto and the real
controller: its devices connect as their own broker users, are born, publish metrics and
lose nothing across a broker restart; scripted command outcomes come back as results; and
`edge-agent bench fleet` prints its figures (their values are the bench's business, not a
test's)."""

from __future__ import annotations

import json
import math
import selectors
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.cli import main
from edge_agent.fleet.controller import commands
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.envelope import AUDIT
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.signing import generate_keypair, load_private, load_public
from edge_agent.fleet.sim.device import SimDevice
from edge_agent.fleet.sim.fleet import SimOptions, Simulator
from tests.conftest import clone_state
from tests.support.brokers import FLEET, Mosquitto
from tests.support.fleetkit import Controller, fast_options, wait_until

pytestmark = pytest.mark.broker
FAST = SimOptions(reconnect_min_s=0.2, reconnect_max_s=1.0, sweep_s=2.0, stop_wait_s=3.0,
                  link=fast_options())


def ids(n: int) -> tuple[str, ...]:
    return tuple(f"sim-{i:03d}" for i in range(n))


@pytest.fixture
def controller_for(tmp_path: Path) -> Iterator[Callable[[Mosquitto], Controller]]:
    made: list[Controller] = []

    def make(broker: Mosquitto, key: Ed25519PrivateKey | None = None) -> Controller:
        ctl = Controller(broker, tmp_path / "controller", key=key).start()
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.close()


def test_simulated_devices_are_born_publish_and_lose_nothing_across_a_broker_restart(
        mosquitto_factory: Callable[..., Mosquitto],
        controller_for: Callable[[Mosquitto], Controller], tmp_path: Path) -> None:
    devices = ids(60)
    broker = mosquitto_factory(devices=devices).start()
    ctl = controller_for(broker)
    sim = Simulator(broker.url, fleet=FLEET, devices=devices,
                    password_file=broker.password_file, root=tmp_path / "sim", options=FAST)
    try:
        sim.start()
        assert sim.wait_connected(30), f"{sim.connected()} of 60 connected"
        assert wait_until(lambda: ctl.store.counts() == (60, 60), 15), ctl.store.counts()
        born = ctl.store.device("sim-007")
        assert born is not None and born["agent_version"] == "sim" and born["online"]

        sim.produce(0.5)  # 120 messages a second in all
        assert wait_until(lambda: min(d.ticks for d in sim.devices.values()) >= 2, 15)
        broker.kill()  # SIGKILL: no goodbye to anyone
        assert ctl.ingest is not None
        wait_until(lambda: sim.connected() == 0 and not ctl.ingest.connected, 10)
        broker.start()
        assert sim.wait_connected(30), f"{sim.connected()} of 60 reconnected"
        assert ctl.ingest.wait_connected(30)
        # Two more messages each once the controller is subscribed again: what a device
        # sent before that may have found no subscriber (the broker's last autosave can
        # predate the subscription), and goes again at the device's next ack.
        mark = {name: d.ticks for name, d in sim.devices.items()}
        assert wait_until(lambda: all(d.ticks >= mark[n] + 2 for n, d in sim.devices.items()),
                          15)
        sim.pause()
        assert sim.wait_drained(60), f"{sim.depth()} messages still in outboxes"

        for name, (boot, last) in sim.expected().items():
            # Every seq the device gave (metrics, link events) stored once, none missing.
            assert ctl.stored(name) == {boot: [[1, last]]}, name
            assert ctl.gaps(name) == {}
            assert ctl.count(name, "metrics") == sim.devices[name].ticks
        assert sim.counts()["loop_errors"] == 0
    finally:
        sim.stop()  # clean: each publishes its death
    assert wait_until(lambda: ctl.store.counts() == (60, 0), 15), ctl.store.counts()


def test_scripted_command_outcomes_come_back_as_results(
        mosquitto_factory: Callable[..., Mosquitto],
        controller_for: Callable[[Mosquitto], Controller], tmp_path: Path) -> None:
    devices = ids(9)
    broker = mosquitto_factory(devices=devices).start()
    generate_keypair(tmp_path / "cmd.key", tmp_path / "cmd.pub")
    key = load_private(tmp_path / "cmd.key")
    ctl = controller_for(broker, key)
    ran: list[tuple[str, str]] = []

    def outcome(device: SimDevice, command: Command) -> dict[str, Any]:
        ran.append((device.device, command.id))
        number = int(device.device.rsplit("-", 1)[1])
        if number % 3 == 1:
            raise CommandRefused("malformed", "scripted refusal")
        if number % 3 == 2:
            raise RuntimeError("scripted failure")
        device.emit("rollout", AUDIT, {"event": "rollout.transition", "to": "ACTIVE",
                                       "release": command.args["release"]})
        return {"release": command.args["release"], "device": device.device}

    sim = Simulator(broker.url, fleet=FLEET, devices=devices,
                    password_file=broker.password_file, root=tmp_path / "sim",
                    script=outcome, public_key=load_public(tmp_path / "cmd.pub"),
                    options=FAST)
    try:
        sim.start()
        assert sim.wait_connected(30)
        assert wait_until(lambda: ctl.store.counts() == (9, 9), 15)
        sim.take_offline("sim-008")  # its Will marks it offline
        assert wait_until(lambda: ctl.store.counts() == (9, 8), 15)
        sent = commands.send(ctl.settings, ctl.store, key, fleet=FLEET, device=commands.ALL,
                             type_="rollout.start", args={"release": "gemma3:270m@2"})
        assert sorted(sent.expected) == list(devices[:8])
        results = {r["device"]: r for r in commands.wait(ctl.store, sent, 30)}
        assert set(results) == set(devices[:8])
        # Back online, it gets the command its broker session kept, and answers.
        sim.bring_online("sim-008")
        assert wait_until(lambda: len(ctl.store.command_results(sent.command["id"])) == 9, 30)
        results = {r["device"]: r for r in ctl.store.command_results(sent.command["id"])}
        for name, r in results.items():
            number = int(name.rsplit("-", 1)[1])
            if number % 3 == 0:
                assert (r["status"], r["reason"]) == ("ok", None)
                assert r["result"] == {"release": "gemma3:270m@2", "device": name}
            elif number % 3 == 1:
                assert (r["status"], r["reason"]) == ("refused", "malformed")
            else:
                assert (r["status"], r["reason"]) == ("failed", "RuntimeError")
        assert sorted(d for d, _ in ran) == list(devices)  # once each
        # What a script emits reaches the controller like any outbox message.
        assert wait_until(lambda: ctl.count("sim-003", "rollout") == 1, 15)
        # A device's own stream, and a type the script does not take: the link's own ping.
        ping = commands.send(ctl.settings, ctl.store, key, fleet=FLEET, device="sim-004",
                             type_="ping")
        [answer] = commands.wait(ctl.store, ping, 30)
        assert answer["status"] == "ok" and answer["result"]["pong"] is True
    finally:
        sim.stop()


def test_a_socket_paho_closes_during_a_turn_leaves_the_shared_selector_at_once(
        mosquitto_factory: Callable[..., Mosquitto],
        controller_for: Callable[[Mosquitto], Controller], tmp_path: Path) -> None:
    """paho closes the socket when a publish's write fails; its number must leave the
    shared selector in that turn, or the next socket to take the number (another device's
    connect in the same pass) cannot be registered."""
    devices = ids(3)
    broker = mosquitto_factory(devices=devices).start()
    controller_for(broker)
    sim = Simulator(broker.url, fleet=FLEET, devices=devices,
                    password_file=broker.password_file, root=tmp_path / "sim", options=FAST)
    seen: list[str] = []
    try:
        sim.start()
        assert sim.wait_connected(30)
        device = sim.devices["sim-000"]
        session = device.owner.session
        assert session is not None and session.fd is not None
        fd = session.fd

        def after_the_turn() -> None:  # on the loop thread, at the next pass
            # Whether the kernel hands the number out again at once depends on what other
            # threads open meanwhile, so look at the selector itself first.
            key = sim.sel.get_map().get(fd)
            current = device.owner.session
            if key is None:
                seen.append("left")
            elif current is not session and current is not None and current.fd == fd:
                seen.append("taken by the new session")
            else:
                seen.append("still registered")
            sock = socket.socket()
            try:
                sim.sel.register(sock, selectors.EVENT_READ, None)
                sim.sel.unregister(sock)
                seen.append("registered")
            except KeyError:
                seen.append("still registered")
            finally:
                sock.close()

        def failing_publish(topic: str, payload: bytes, *, retain: bool = False) -> None:
            session.client._sock_close()  # what paho does when the write fails
            sim._call(after_the_turn)
            return None

        session.publish = failing_publish  # type: ignore[method-assign]
        device.emit("events", AUDIT, {"event": "probe"})
        assert wait_until(lambda: len(seen) == 2, 10), seen
        assert seen[0] in {"left", "taken by the new session"}, seen
        assert seen[1] == "registered", seen
        # It reconnects by itself, what it emitted goes on the new connection, and the
        # loop counted no error.
        assert wait_until(lambda: device.owner.session is not None
                          and device.owner.session is not session
                          and device.owner.session.established, 15)
        assert sim.wait_drained(15)  # acknowledged by the controller
        assert sim.errors == 0
    finally:
        sim.stop()


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_bench_fleet_prints_its_figures(model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    result = CliRunner().invoke(main, [
        "bench", "fleet", "--devices", "20", "--interval", "1", "--duration", "5",
        "--messages", "500", "--runs", "1", "--idle", "1", "--requests", "2", "--json",
        "--state-dir", str(state)])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    outbox = figures["outbox"]
    for name in ("outbox_msgs_per_s", "plain_msgs_per_s", "outbox_vs_plain",
                 "controller_msgs_per_s", "idle_core_percent"):
        assert _finite(outbox[name]), name
    assert _finite(figures["serving"]["ttft_ratio"])
    [fleet] = figures["fleet"]
    assert fleet["devices"] == 20
    for name in ("ingest_per_s", "lost", "duplicates", "stored"):
        assert _finite(fleet[name]), name
    assert all(_finite(v) for v in fleet["cpu_percent"].values())
    assert "outbox to controller ack" in result.stderr and "messages lost" in result.stderr


@pytest.mark.broker
@pytest.mark.postgres
def test_bench_fleet_scale_prints_its_figures() -> None:
    """Two regions, two controllers, the leader killed: every message stored once (the
    bench's own check of the store), the failover timed, each controller's rate given."""
    result = CliRunner().invoke(main, [
        "bench", "fleet-scale", "--devices", "24", "--regions", "2", "--interval", "0.5",
        "--duration", "4", "--runs", "1", "--ack-timeout", "3", "--json"])
    assert result.exit_code == 0, result.output
    [run] = json.loads(result.stdout)["runs"]
    assert (run["devices"], run["regions"]) == (24, 2)
    assert (run["lost"], run["unknown"], run["undelivered"], run["gap_devices"]) == (0, 0, 0, 0)
    assert run["stored"] > 24 and run["drain_s"] is not None
    assert _finite(run["failover_s"])
    assert [_finite(c["ingest_per_s"]) for c in run["both"]["controllers"]] == [True, True]
    assert _finite(run["survivor"]["controllers"][0]["ingest_per_s"])
    assert "the other led after" in result.stderr and "messages lost" in result.stderr
