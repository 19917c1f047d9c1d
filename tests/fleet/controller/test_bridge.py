"""A region's broker bridged to the central one (`broker.Uplink`, `BrokerPlan.regions`):
boxes on the regional broker, the controller on the central one. A rollout goes through the
bridge and completes; the central broker killed while the boxes report: nothing lost once
it is back, and a rollback goes out through the bridge again; the bridge's user cannot
publish what its region's boxes could not."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.fleet.controller.broker import Uplink, acl_text, conf_text
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.protocol import topics
from tests.conftest import free_port
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import FLEET, Mosquitto, MQTTClient
from tests.support.fleetkit import wait_until
from tests.support.fleetserve import FleetServe
from tests.support.releasekit import make_repo
from tests.support.rolloutkit import controller_config
from tests.support.rolloutsim import LinkFleet
from tests.support.tcpproxy import TCPProxy

NAME = "simmodel:1b"
BOXES = tuple(f"sim-{i:03d}" for i in range(6))


def test_the_bridge_user_has_its_regions_rights_and_no_more() -> None:
    from edge_agent.fleet.controller.broker import BrokerPlan

    central = BrokerPlan(fleet=FLEET, devices=("direct-1",),
                         regions=(("bridge-eu", ("eu-1", "eu-2")),))
    acl = acl_text(central).split("user bridge-eu\n", 1)[1]
    assert f"topic write {topics.topic(FLEET, 'eu-1', topics.STATUS)}" in acl
    assert f"topic read {topics.topic(FLEET, 'eu-2', topics.ACK)}" in acl
    assert f"topic read {topics.topic(FLEET, topics.ALL, topics.CMD)}" in acl
    assert "direct-1" not in acl and "#" not in acl and "+" not in acl
    assert not any(line.startswith("topic write") and line.endswith(("/ack", "/cmd"))
                   for line in acl.splitlines())
    region = BrokerPlan(fleet=FLEET, devices=("eu-1", "eu-2"),
                        uplink=Uplink("central.example", 8883, "bridge-eu", "pw", tls=True))
    conf = conf_text(region, Path("/etc/mosquitto/edge"))
    assert "address central.example:8883" in conf and "cleansession false" in conf
    assert f"topic edge/v1/{FLEET}/+/status out 1" in conf
    assert f"topic edge/v1/{FLEET}/+/ack in 1" in conf
    assert "bridge_capath /etc/ssl/certs" in conf


def test_broker_config_writes_the_centre_and_the_regions_side(tmp_path: Path) -> None:
    (tmp_path / "central.txt").write_text("direct-1\n")
    (tmp_path / "eu.txt").write_text("eu-1\neu-2\n")
    run = CliRunner().invoke
    centre = run(main, ["fleet", "broker-config", "--devices", str(tmp_path / "central.txt"),
                        "--out", str(tmp_path / "centre"), "--fleet", FLEET,
                        "--region", f"bridge-eu={tmp_path / 'eu.txt'}"])
    assert centre.exit_code == 0, centre.output
    assert "region bridge user bridge-eu: 2 devices" in centre.output
    password = tmp_path / "centre" / "credentials" / "bridge-eu.txt"
    assert "user bridge-eu" in (tmp_path / "centre" / "acl").read_text()
    region = run(main, ["fleet", "broker-config", "--devices", str(tmp_path / "eu.txt"),
                        "--out", str(tmp_path / "eu"), "--fleet", FLEET,
                        "--uplink", "mqtts://central.example:8883", "--uplink-user",
                        "bridge-eu", "--uplink-password-file", str(password)])
    assert region.exit_code == 0, region.output
    conf = tmp_path / "eu" / "mosquitto.conf"
    assert conf.stat().st_mode & 0o777 == 0o600  # it holds the bridge's password
    text = conf.read_text()
    assert "address central.example:8883" in text and "remote_username bridge-eu" in text
    assert f"remote_password {password.read_text().strip()}" in text
    overlap = run(main, ["fleet", "broker-config", "--devices", str(tmp_path / "eu.txt"),
                         "--out", str(tmp_path / "bad"), "--region",
                         f"bridge-eu={tmp_path / 'eu.txt'}"])
    assert overlap.exit_code == 2 and "is also in this broker's devices" in overlap.output
    half = run(main, ["fleet", "broker-config", "--devices", str(tmp_path / "eu.txt"),
                      "--out", str(tmp_path / "bad"), "--uplink", "mqtt://c:1883"])
    assert half.exit_code == 2 and "go together" in half.output


@dataclass
class Region:
    """A central broker with the controller, a region's broker (its uplink through `proxy`
    when there is one) with the boxes, and how a test drives and reads the rollout."""

    central: Mosquitto
    regional: Mosquitto
    config: Path
    serve: FleetServe
    sim: LinkFleet
    store: SQLiteStore

    def rollout(self, *args: str) -> None:
        done = CliRunner().invoke(main, ["fleet", "rollout", *args, "--config",
                                         str(self.config)])
        assert done.exit_code == 0, done.output

    def settled(self, rid: str, state: str, boxes: str) -> bool:
        """The engine done, and every box's report of `boxes` stored (a settled rollout
        has nothing left to send: the boxes' answers may still be on their way)."""
        found = self.store.rollouts.rollout(rid)
        return found is not None and found.state == state and found.settled and all(
            d.state == boxes for d in self.store.rollouts.rollout_devices(rid))

    def all_stored_once(self) -> None:
        self.sim.sim.pause()
        assert self.sim.sim.wait_drained(120), \
            f"{self.sim.sim.depth()} messages still in outboxes"
        for name, (boot, last) in self.sim.sim.expected().items():
            assert self.store.stored_ranges(name, boot) == [[1, last]], name


@pytest.fixture
def region_for(mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path
               ) -> Iterator[Callable[[Callable[[int], int]], Region]]:
    """`region_for(uplink)`: the region, its bridge dialling `uplink(central port)`."""
    made: list[Region] = []

    def make(uplink: Callable[[int], int]) -> Region:
        central = mosquitto_factory(devices=("direct-1",), regions=(("bridge-eu", BOXES),),
                                    passwd_tool=False).start()
        regional = mosquitto_factory(devices=BOXES, passwd_tool=False, uplink=Uplink(
            "127.0.0.1", uplink(central.port), "bridge-eu",
            central.password("bridge-eu"))).start()
        repo = make_repo(tmp_path)
        repo.add(write_tiny_gguf(tmp_path / "model.gguf"), NAME, "2")
        port = free_port()
        config = controller_config(tmp_path / "controller.toml", state=tmp_path / "state",
                                   key=repo.keys.private("command"), broker=central,
                                   http=f"port = {port}")
        serve = FleetServe(config, port, tmp_path / "serve.log").start()
        sim = LinkFleet(regional, repo.keys.public_file("command"), BOXES, tmp_path / "sim",
                        step_s=0.05, ack_timeout_s=5).connect()
        made.append(Region(central, regional, config, serve, sim,
                           SQLiteStore(tmp_path / "state" / "controller.db")))
        # Births through the bridge: the controller knows every box of the region.
        assert wait_until(lambda: len(made[-1].store.devices()) == len(BOXES), 60, 0.2), \
            made[-1].store.devices()
        return made[-1]

    yield make
    for region in made:
        region.store.close()
        region.sim.close()
        region.serve.stop()
        log = region.serve.log.read_text()
        assert "Traceback" not in log, log[-3000:]


def test_a_rollout_goes_through_the_bridge_and_a_cut_uplink_loses_nothing(
        region_for: Callable[[Callable[[int], int]], Region]) -> None:
    r = region_for(lambda port: port)
    central, serve, sim, store = r.central, r.serve, r.sim, r.store
    rollout, settled = r.rollout, r.settled
    rollout("start", f"{NAME}@2", "--id", "r-bridge", "--waves", "1,100%", "--soak", "1s")
    assert wait_until(lambda: settled("r-bridge", "COMPLETED", "ACTIVE"), 90, 0.2), \
        store.rollouts.rollout("r-bridge")
    assert all(sim[d].state("r-bridge") == "ACTIVE" for d in BOXES)

    # The uplink cut: the central broker killed while the boxes report.
    sim.sim.produce(0.5)
    assert wait_until(lambda: min(d.ticks for d in sim.sim.devices.values()) >= 2, 30)
    central.kill()
    mark = {name: d.ticks for name, d in sim.sim.devices.items()}
    assert wait_until(lambda: all(d.ticks >= mark[n] + 4
                                  for n, d in sim.sim.devices.items()), 30)
    central.start()
    assert wait_until(lambda: serve.health() is not None, 60, 0.2)
    rollout("rollback", "r-bridge")  # commands go in through the bridge again
    assert wait_until(lambda: settled("r-bridge", "ROLLED_BACK", "ROLLED_BACK"), 90,
                      0.2), \
        store.rollouts.rollout("r-bridge")
    assert all(sim[d].state("r-bridge") == "ROLLED_BACK" for d in BOXES)
    r.all_stored_once()

    # The bridge's user on the central broker: its region's boxes' rights, no more.
    rogue = MQTTClient(central, "bridge-eu")
    assert not rogue.connect().is_failure
    try:
        assert rogue.publish(topics.topic(FLEET, "direct-1", topics.STATUS), b"{}") == 135
        assert rogue.publish(topics.topic(FLEET, BOXES[0], topics.ACK), b"{}") == 135
        assert rogue.publish(topics.topic(FLEET, BOXES[0], topics.CMD), b"{}") == 135
    finally:
        rogue.client.loop_stop()
        rogue.client.disconnect()


CUT_S = 20.0  # the uplink down this long, mid-rollout


def test_a_bridge_cut_mid_rollout_loses_nothing_and_the_rollout_resumes(
        region_for: Callable[[Callable[[int], int]], Region]) -> None:
    """Only the link between the region and the centre goes down (both brokers and the
    controller stay up), between the rollout's two waves, for 20 s: the controller
    goes on (the soak ends, wave 2 starts, its commands wait at the central broker for the
    bridge's session), the boxes' reports wait at the regional broker; once the link is
    back, wave 2 reaches its boxes and the rollout completes, with every report stored
    once."""
    proxies: list[TCPProxy] = []

    def through_proxy(port: int) -> int:
        proxies.append(TCPProxy(port))
        return proxies[-1].port

    r = region_for(through_proxy)
    [proxy] = proxies
    rid = "r-cut"
    try:
        r.rollout("start", f"{NAME}@2", "--id", rid, "--waves", "2,100%", "--soak", "2s")
        devices = r.store.rollouts.rollout_devices
        assert wait_until(lambda: sum(d.state == "ACTIVE" for d in devices(rid)) == 2, 60,
                          0.1), devices(rid)
        second = [d.device for d in r.store.rollouts.rollout_devices(rid) if d.state != "ACTIVE"]
        r.sim.sim.produce(0.5)
        proxy.cut()
        cut = time.monotonic()
        assert wait_until(lambda: (found := r.store.rollouts.rollout(rid)) is not None
                          and found.wave == 2, 30, 0.2), r.store.rollouts.rollout(rid)
        mark = {name: d.ticks for name, d in r.sim.sim.devices.items()}
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut)))  # the outage itself
        # Nothing crossed: wave 2's commands are still on the centre's side, the boxes'
        # reports since the cut on the region's.
        assert all(r.sim[d].state(rid) is None for d in second)
        assert all(d.ticks >= mark[n] + 10 for n, d in r.sim.sim.devices.items())
        proxy.restore()
        assert wait_until(lambda: r.settled(rid, "COMPLETED", "ACTIVE"), 120, 0.2), \
            r.store.rollouts.rollout_devices(rid)
        assert all(r.sim[d].state(rid) == "ACTIVE" for d in BOXES)
        r.all_stored_once()
    finally:
        proxy.close()
