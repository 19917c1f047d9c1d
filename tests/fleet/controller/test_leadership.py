"""Which controller leads (`leadership`): on a SQLite store the one `fleet serve` there is,
a second refused; on PostgreSQL the one holding the advisory lock, another taking over
when its connection ends, and a leader cut off from the server giving up before the lock
can go to another. Then two real `fleet serve` on one PostgreSQL store with a shared
subscription: the leader killed (SIGKILL) during a rollout's soak, the other takes the
rollout to its end with no wave and no command twice, and every report stored once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.config import ConfigError
from edge_agent.config.controller import load_controller_settings
from edge_agent.fleet.controller.leadership import (
    LEADER_KEY,
    AdvisoryLeadership,
    FileLeadership,
)
from edge_agent.fleet.controller.store import PostgresStore
from edge_agent.fleet.controller.waves import assign_waves, parse_waves
from edge_agent.fleet.device.link.core import LinkOptions
from edge_agent.fleet.protocol.signing import load_public
from edge_agent.fleet.sim.fleet import SimOptions, Simulator
from tests.conftest import free_port
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import FLEET, Mosquitto
from tests.support.fleetkit import wait_until
from tests.support.fleetserve import FleetServe
from tests.support.releasekit import make_repo
from tests.support.rolloutkit import controller_config
from tests.support.rolloutsim import LinkFleet

ROOT = Path(__file__).resolve().parents[3]
NAME = "simmodel:1b"


def test_one_controller_per_sqlite_store(tmp_path: Path) -> None:
    first = FileLeadership(tmp_path, "ctl-a")
    first.start()
    try:
        assert first.is_leader() and first.state()["leader"]
        second = FileLeadership(tmp_path, "ctl-b")
        with pytest.raises(ConfigError, match=r"another fleet serve uses the store in .*"
                                              r"\(pid \d+, ctl-a\).*PostgreSQL"):
            second.start()
        assert not second.is_leader()
    finally:
        first.stop()
    again = FileLeadership(tmp_path, "ctl-b")  # released with its holder
    again.start()
    again.stop()


def test_fleet_serve_refuses_a_sqlite_store_another_controller_holds(tmp_path: Path) -> None:
    holder = FileLeadership(tmp_path / "state", "edge-fleet-controller")
    holder.start()
    try:
        config = tmp_path / "controller.toml"
        (tmp_path / "pw").write_text("secret\n")
        config.write_text(f'state_dir = "{tmp_path / "state"}"\n[broker]\n'
                          f'password_file = "{tmp_path / "pw"}"\n[http]\nport = {free_port()}\n')
        refused = subprocess.run(
            [sys.executable, "-m", "edge_agent", "fleet", "serve", "--config", str(config)],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
            text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith("edge-agent: another fleet serve uses the store in ")
        assert "db = postgresql://" in refused.stderr
    finally:
        holder.stop()


def test_shared_subscriptions_need_postgresql(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shared_group is for two or more controllers"):
        load_controller_settings(None, state_dir=tmp_path, **{"broker.shared_group": "ctl"})
    ok = load_controller_settings(None, state_dir=tmp_path, db="postgresql://x@/y",
                                  **{"broker.shared_group": "ctl"})
    assert ok.broker.shared_group == "ctl"


@pytest.mark.postgres
def test_the_advisory_lock_has_one_holder_and_passes_on_when_its_connection_ends(
        postgres_url: str) -> None:
    a = AdvisoryLeadership(postgres_url, "ctl-a", poll_s=0.1, lease_s=2, keepalive_s=6)
    b = AdvisoryLeadership(postgres_url, "ctl-b", poll_s=0.1, lease_s=2, keepalive_s=6)
    a.start()
    b.start()
    try:
        assert a.is_leader() and not b.is_leader()
        assert a.state()["since"] is not None and b.state()["since"] is None
        # The leader's session ends (its backend killed, as a dead process's would end).
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            pids = [row[0] for row in admin.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                "AND objid = %s", [LEADER_KEY >> 32, LEADER_KEY & 0xFFFFFFFF]).fetchall()]
            assert len(pids) == 1
            started = time.monotonic()
            admin.execute("SELECT pg_terminate_backend(%s)", [pids[0]])
        assert wait_until(b.is_leader, 10, 0.05)
        took = time.monotonic() - started
        assert took < 2.0, took
        assert wait_until(lambda: not a.is_leader(), 5, 0.05)
        time.sleep(0.5)
        assert not a.is_leader() and b.is_leader()  # a stays a follower: b holds it
    finally:
        b.stop()
        a.stop()


@pytest.mark.postgres
def test_a_leader_that_cannot_confirm_gives_up_within_its_lease(postgres_url: str) -> None:
    now = [100.0]
    a = AdvisoryLeadership(postgres_url, "ctl-a", poll_s=60, lease_s=3, keepalive_s=9,
                           clock=lambda: now[0])
    a.start()  # leads at once; its thread waits 60 s before the next confirmation
    try:
        assert a.is_leader()
        now[0] += 2.9
        assert a.is_leader()
        now[0] += 0.2  # no confirmation for more than the lease: not leading, whatever holds
        assert not a.is_leader() and a.state()["leader"] is False
    finally:
        a.stop()
    with pytest.raises(ConfigError, match="lease must end before the server's keepalive"):
        AdvisoryLeadership(postgres_url, "x", lease_s=10, keepalive_s=10)


# -- two real controllers -----------------------------------------------------------------

Pair = tuple[list[FleetServe], Mosquitto, Path, list[str]]


def _controllers(serve: FleetServe) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(
        f"http://127.0.0.1:{serve.port}/controllers", timeout=5).json()["controllers"]
    return found


@pytest.fixture
def pair_for(mosquitto_factory: Callable[..., Mosquitto], postgres_url: str, tmp_path: Path,
             ) -> Iterator[Callable[[int], Pair]]:
    """Two controllers (ctl-a leading, then ctl-b) on one PostgreSQL store and one broker
    for N boxes, with one release published."""
    serves: list[FleetServe] = []

    def make(n: int) -> Pair:
        devices = [f"sim-{i:03d}" for i in range(n)]
        broker = mosquitto_factory(devices=tuple(devices), passwd_tool=False).start()
        repo = make_repo(tmp_path)
        repo.add(write_tiny_gguf(tmp_path / "model.gguf"), NAME, "2")
        for name in ("ctl-a", "ctl-b"):
            port = free_port()
            # One store, one release repository (the state dir), a client id each.
            config = controller_config(
                tmp_path / f"{name}.toml", state=tmp_path / "state",
                key=repo.keys.private("command"), broker=broker, http=f"port = {port}",
                db=postgres_url,
                broker_lines=f'client_id = "edge-fleet-{name}"\nshared_group = "controllers"\n')
            serves.append(FleetServe(config, port, tmp_path / f"{name}.log"))
        serves[0].start()
        assert wait_until(serves[0].leads, 10, 0.1)
        serves[1].start()
        return serves, broker, repo.keys.public_file("command"), devices

    yield make
    for serve in serves:
        serve.stop()
    for serve in serves:
        text = serve.log.read_text()
        assert "Traceback" not in text, text[-3000:]


@pytest.mark.broker
@pytest.mark.postgres
@pytest.mark.parametrize("moment", ["during a soak", "as a wave starts"])
def test_the_other_controller_finishes_a_rollout_when_the_leader_is_killed(
        pair_for: Callable[[int], Pair], postgres_url: str, tmp_path: Path, moment: str) -> None:
    """Killed during wave 1's soak, the leader leaves wave 2 to the other to start; killed
    the moment it has stored wave 2's start, it leaves commands recorded that it may not
    have published: the other publishes those, and signs none anew."""
    (a, b), broker, public_key, devices = pair_for(12)
    assert a.leads() and not b.leads()
    sim = LinkFleet(broker, public_key, devices, tmp_path / "sim", step_s=0.05,
                    ack_timeout_s=5).connect()
    store = PostgresStore(postgres_url)
    try:
        assert wait_until(lambda: len(store.devices()) == len(devices), 60, 0.2)
        rid, spec = "r-failover", "2,50%,100%"
        waves = assign_waves(rid, {d: "f" for d in devices}, parse_waves(spec))
        started = CliRunner().invoke(main, ["fleet", "rollout", "start", f"{NAME}@2", "--id",
                                            rid, "--waves", spec, "--soak", "4s", "--config",
                                            str(b.config)])  # through the follower's store
        assert started.exit_code == 0, started.output
        first = [d for d, w in waves.items() if w == 1]
        assert wait_until(lambda: all(sim[d].state(rid) == "ACTIVE" for d in first), 30, 0.05)
        if moment == "as a wave starts":
            assert wait_until(
                lambda: (r := store.rollouts.rollout(rid)) is not None and r.wave >= 2, 30, 0.002)
        a.kill()
        killed = time.monotonic()
        with psycopg.connect(postgres_url, autocommit=True) as db:
            row = db.execute("SELECT COUNT(*) FROM rollout_commands WHERE rollout_id = %s "
                             "AND published_at IS NULL", [rid]).fetchone()
            unpublished = row[0] if row else 0
        assert wait_until(b.leads, 15, 0.05)
        takeover = time.monotonic() - killed
        assert wait_until(lambda: (r := store.rollouts.rollout(rid)) is not None and r.settled, 90,
                          0.2), (store.rollouts.rollout(rid), [(d.device, d.wave, d.state) for d in
                                                      store.rollouts.rollout_devices(rid)],
                                 {d: sim[d].state(rid) for d in devices},
                                 b.log.read_text()[-3000:])
        record = store.rollouts.rollout(rid)
        assert record is not None and record.state == "COMPLETED", record
        for device in devices:  # no wave started twice: one rollout.start each
            assert len(sim[device].got("rollout.start")) == 1, device
        with psycopg.connect(postgres_url, autocommit=True) as db:
            commands = db.execute("SELECT device, type, COUNT(*) FROM rollout_commands "
                                  "WHERE rollout_id = %s GROUP BY device, type",
                                  [rid]).fetchall()
            assert {c for _, _, c in commands} == {1} and len(commands) == len(devices)
            seqs = db.execute("SELECT device, boot_id, seq, COUNT(*) FROM messages GROUP BY "
                              "device, boot_id, seq HAVING COUNT(*) > 1").fetchall()
            assert seqs == []  # every report stored once, whichever controller took it
        health = b.health()
        assert health is not None and health["controller"]["controller"] == "edge-fleet-ctl-b"
        # Every controller of the store, as `fleet controllers` prints them: the killed
        # one stops answering, the other leads since the takeover.
        assert wait_until(lambda: {c["controller"]: c["state"] for c in _controllers(b)} == {
            "edge-fleet-ctl-a": "gone", "edge-fleet-ctl-b": "leader"}, 30, 0.5), \
            _controllers(b)
        shown = CliRunner().invoke(main, ["fleet", "controllers", "--config", str(b.config)])
        assert shown.exit_code == 0, shown.output
        rows = {line.split()[0]: line.split()[1] for line in shown.stdout.splitlines()[1:]}
        assert rows == {"edge-fleet-ctl-a": "gone", "edge-fleet-ctl-b": "leader"}
        console = httpx.get(f"http://127.0.0.1:{b.port}/", timeout=10).text
        assert "edge-fleet-ctl-b (leader since" in console and \
            "edge-fleet-ctl-a (gone, last seen" in console
        print(f"\n[figures] leader killed {moment}: the other led after "
              f"{takeover:.2f} s ({unpublished} command(s) it had recorded and not "
              f"published); rollout of {len(devices)} boxes completed")
    finally:
        store.close()
        sim.close()


@pytest.mark.broker
@pytest.mark.postgres
def test_a_controller_killed_mid_flood_loses_nothing_and_stores_nothing_twice(
        pair_for: Callable[[int], Pair], postgres_url: str, tmp_path: Path) -> None:
    (a, b), broker, public_key, devices = pair_for(200)
    sim = Simulator(broker.url, fleet=FLEET, devices=devices,
                    password_file=broker.password_file, root=tmp_path / "flood",
                    public_key=load_public(public_key),
                    options=SimOptions(reconnect_min_s=0.2, reconnect_max_s=1.0, sweep_s=1.0,
                                       stop_wait_s=3.0, link=LinkOptions(ack_timeout_s=5)))
    store = PostgresStore(postgres_url)
    try:
        sim.start()
        assert sim.wait_connected(60), f"{sim.connected()} of 200 connected"
        sim.produce(0.5)  # 400 messages a second in all, shared between the two
        assert wait_until(lambda: min(d.ticks for d in sim.devices.values()) >= 3, 30)
        a.kill()  # SIGKILL in the middle of it: what it held unacknowledged goes again
        mark = {name: d.ticks for name, d in sim.devices.items()}
        assert wait_until(lambda: all(d.ticks >= mark[n] + 3 for n, d in sim.devices.items()),
                          30)
        sim.pause()
        started = time.monotonic()
        assert sim.wait_drained(90), f"{sim.depth()} messages still in outboxes"
        drained = time.monotonic() - started
        for name, (boot, last) in sim.expected().items():
            # Every seq each box gave, stored once, none missing, whichever controller
            # took it (a seq is the store's key: twice would be one row with two acks).
            assert store.stored_ranges(name, boot) == [[1, last]], name
            assert store.gaps(name, boot) == [], name
        assert sim.counts()["loop_errors"] == 0
        with psycopg.connect(postgres_url, autocommit=True) as db:
            stored = db.execute("SELECT COUNT(*) FROM messages").fetchone()
        assert stored is not None and stored[0] == sum(
            last for _, last in sim.expected().values())
        # A filter per kind a box reports: the survivor got none of the acks it and the
        # other sent back through the shared subscription.
        metrics = httpx.get(f"http://127.0.0.1:{b.port}/metrics", timeout=5).text
        assert "\nedge_fleet_messages_ignored_total 0.0\n" in metrics
        print(f"\n[figures] 200 boxes at 2 msg/s, one of two controllers killed: "
              f"{stored[0]} messages stored once each, outboxes empty {drained:.1f} s after "
              "the flood stopped")
    finally:
        store.close()
        sim.stop()
