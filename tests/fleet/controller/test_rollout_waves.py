"""Rollouts in waves, driven by the real controller: `fleet serve` as a subprocess with its
rollout engine, a real Mosquitto, a signed release repository, `fleet rollout …` through
the CLI, and scripted boxes (`tests.support.rolloutsim`): the fleet simulator's (the agent's own
link code per box, on one selector loop) for the 100-box rollouts, a paho client each
where a box must go offline with its broker session kept.

A 4-wave rollout over 100 boxes with 20% failures aborts inside the wave where the
threshold is crossed; a clean one completes wave after soaked wave; the operator pauses,
resumes, aborts with rollbacks; boxes offline at their wave get the rollout on
reconnecting, a silent one times out, and a restarted controller carries on.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.fleet.controller.audit import local_operator
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.controller.waves import assign_waves, parse_waves
from tests.conftest import free_port
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import Mosquitto
from tests.support.fleetkit import wait_until
from tests.support.fleetserve import FleetServe
from tests.support.releasekit import make_repo
from tests.support.rolloutsim import LinkFleet, SimFleet

pytestmark = [pytest.mark.broker]

ROOT = Path(__file__).resolve().parents[3]
NAME = "simmodel:1b"
WAVES = "1,10%,50%,100%"


@dataclass
class Central:
    state: Path
    config: Path
    serve: FleetServe
    broker: Mosquitto
    public_key: Path
    devices: list[str]

    def cli(self, *args: str, code: int = 0) -> str:
        result = CliRunner().invoke(main, ["fleet", "rollout", *args, "--config",
                                           str(self.config)])
        assert result.exit_code == code, (result.output, result.exception)
        return result.output

    def status(self, rid: str) -> dict[str, Any]:
        return json.loads(self.cli("status", rid, "--json"))

    def rows(self, rid: str) -> dict[str, Any]:
        store = SQLiteStore(self.state / "controller.db")
        try:
            return {d.device: d for d in store.rollouts.rollout_devices(rid)}
        finally:
            store.close()

    def messages_between(self, t0: float, t1: float) -> int:
        import sqlite3

        with sqlite3.connect(self.state / "controller.db") as db:
            return int(db.execute("SELECT COUNT(*) FROM messages WHERE received BETWEEN ? "
                                  "AND ?", (t0, t1)).fetchone()[0])


@pytest.fixture
def central_for(mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path
                ) -> Iterator[Callable[[int], Central]]:
    """A controller for N boxes `sim-000`…: broker, keys, a release, `fleet serve`."""
    made: list[Central] = []

    def make(n: int) -> Central:
        devices = [f"sim-{i:03d}" for i in range(n)]
        broker = mosquitto_factory(devices=tuple(devices), passwd_tool=False).start()
        repo = make_repo(tmp_path)
        repo.add(write_tiny_gguf(tmp_path / "model.gguf"), NAME, "2")
        state, port = tmp_path / "state", free_port()
        config = tmp_path / "controller.toml"
        config.write_text(
            f'state_dir = "{state}"\ncommand_signing_key_file = "{repo.keys.private("command")}"\n'
            "rollout_tick_s = 0.5\nrollout_busy_retry_s = 1\n"
            f'[broker]\nurl = "{broker.url}"\nusername = "controller"\n'
            f'password_file = "{broker.password_file("controller")}"\n'
            f"[http]\nport = {port}\n")
        serve = FleetServe(config, port, tmp_path / "serve.log").start()
        central = Central(state, config, serve, broker, repo.keys.public_file("command"),
                          devices)
        made.append(central)
        return central

    yield make
    for central in made:
        central.serve.stop()
        log = central.serve.log.read_text()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def _all_known(central: Central) -> None:
    store = SQLiteStore(central.state / "controller.db")
    try:
        assert wait_until(lambda: len(store.devices()) == len(central.devices), 60, 0.2)
    finally:
        store.close()


def link_fleet(central: Central, outcomes: dict[str, str] | None = None,
               step_s: float = 0.05, slow_step_s: float | None = None) -> LinkFleet:
    """The fleet simulator's boxes (the link's own code), connected and known."""
    sim = LinkFleet(central.broker, central.public_key, central.devices,
                    central.state.parent / "sim", outcomes=outcomes, step_s=step_s,
                    slow_step_s=slow_step_s)
    sim.connect()
    _all_known(central)
    return sim


def wire_fleet(central: Central, outcomes: dict[str, str] | None = None,
               offline: tuple[str, ...] = ()) -> SimFleet:
    """Boxes with a paho client each (their sessions kept while offline)."""
    sim = SimFleet(central.broker, central.public_key, central.devices, outcomes=outcomes)
    sim.connect()
    for device in offline:
        sim[device].disconnect()
    _all_known(central)
    return sim


def waves_of(rid: str, devices: list[str], spec: str) -> dict[int, list[str]]:
    assigned = assign_waves(rid, devices, parse_waves(spec))
    return {w: sorted(d for d, x in assigned.items() if x == w)
            for w in sorted(set(assigned.values()))}


def settled(central: Central, rid: str, state: str, timeout: float,
            why: Callable[[], str] | None = None,
            states: dict[str, int] | None = None) -> dict[str, Any]:
    """The rollout in `state` with nothing left for the engine to do — and, given
    `states`, the boxes' reports counted so (a rollout settles once its last commands are
    out; the boxes' answers to them may still be on their way)."""
    last: dict[str, Any] = {}

    def done() -> bool:
        nonlocal last
        last = central.status(rid)
        return bool(last["state"] == state and last["settled"]
                    and (states is None or last["states"] == states))

    assert wait_until(done, timeout, 0.5), json.dumps(
        {k: v for k, v in last.items() if k != "devices"}, indent=1) + (
        "" if why is None else "\n" + why())
    return last


def rollback_trace(central: Central, rid: str, sim: LinkFleet) -> str:
    """Where the rollbacks stopped: recorded, published, run by the boxes, reported."""
    import sqlite3

    with sqlite3.connect(central.state / "controller.db") as db:
        recorded = db.execute("SELECT COUNT(*), COUNT(published_at) FROM rollout_commands "
                              "WHERE rollout_id = ? AND type = 'rollout.rollback'",
                              (rid,)).fetchone()
    ran = sum(1 for d in central.devices if sim[d].got("rollout.rollback"))
    boxes = sum(1 for d in central.devices if sim[d].state(rid) == "ROLLED_BACK")
    return (f"rollbacks recorded {recorded[0]}, published {recorded[1]}, run by {ran} "
            f"boxes, {boxes} boxes ROLLED_BACK\n{central.serve.log.read_text()[-4000:]}")


def test_a_fifth_failing_aborts_inside_the_wave_that_crosses_the_threshold(
        central_for: Callable[[int], Central]) -> None:
    central = central_for(100)
    rid = "r-abort"
    waves = waves_of(rid, central.devices, WAVES)
    assert [len(waves[w]) for w in (1, 2, 3, 4)] == [1, 9, 40, 50]
    # 20 of 100 fail (8 of wave 3, 12 of wave 4), in every way a box can; waves 1 and 2
    # are clean, so the threshold can only be crossed inside wave 3. The failing boxes
    # walk their paths at once (a retrying one caught by the abort's cancel would end
    # CANCELLED, not FAILED: the engine's tick must not fall inside a path); wave 3's
    # sound boxes take 2 s a step: the abort finds them mid-way. Two boxes of wave 3 stay
    # busy (another change of the name under way there): not failed, asked again, and
    # skipped by the abort.
    kinds = cycle(["rolled_back", "rejected", "failed"])
    failing = {d: next(kinds) for d in waves[3][:8] + waves[4][:12]}
    busy = waves[3][8:10]
    outcomes = {**dict.fromkeys(waves[3], "slow"), **failing, **dict.fromkeys(busy, "busy")}
    sim = link_fleet(central, outcomes, step_s=0.0, slow_step_s=2.0)
    try:
        central.cli("start", f"{NAME}@2", "--id", rid, "--waves", WAVES, "--abort-above",
                    "10%", "--min-executed", "3", "--soak", "1s", "--device-timeout", "2m")
        report = settled(central, rid, "ABORTED", 120)
        assert report["wave"] == 3 and "finished devices failed" in report["reason"]
        for device in waves[4]:
            assert sim[device].got("rollout.start") == []  # never sent
        rows = central.rows(rid)
        assert {rows[d].outcome for d in waves[4]} == {"skipped"}
        assert all(rows[d].command_id is None for d in waves[4])
        for device in waves[1] + waves[2] + waves[3]:
            assert len(sim[device].got("rollout.start")) == 1 or device in busy
        assert {rows[d].state for d in waves[1] + waves[2]} == {"ACTIVE"}
        # Each of wave 3's failing boxes ends in its own failure state, unless the abort's
        # cancel reached it still on its way (on a loaded machine their paths spread out
        # past the tick that crosses the threshold): then CANCELLED, and told so. Two
        # failures are what cross 10% beside the ten clean boxes.
        ends = {"rolled_back": "ROLLED_BACK", "rejected": "REJECTED", "failed": "FAILED"}
        failed = []
        for device in (d for d in failing if d in waves[3]):
            assert rows[device].state in (ends[failing[device]], "CANCELLED"), \
                (device, failing[device], rows[device].state)
            if rows[device].state == "CANCELLED":
                assert sim[device].got("rollout.cancel")
            else:
                failed.append(device)
        assert len(failed) >= 2, {d: rows[d].state for d in failing}
        assert {(rows[d].state, rows[d].outcome) for d in busy} == {("REFUSED", "skipped")}
        # Inside the wave: its sound boxes were still on their way, and were cancelled.
        sound = [d for d in waves[3] if d not in failing and d not in busy]
        cancelled = [d for d in sound if rows[d].state == "CANCELLED"]
        assert cancelled, {d: rows[d].state for d in sound}
        for device in sound:
            assert rows[device].state in ("CANCELLED", "ACTIVE")
            if rows[device].state == "CANCELLED":
                assert sim[device].got("rollout.cancel")
            assert sim[device].got("rollout.rollback") == []  # no --rollback-on-abort
        assert report["phases"]["failed"] == len(failed)
        assert report["phases"]["cancelled"] >= 50
        text = central.cli("status", rid)
        assert "ABORTED" in text and "wave 3/4" in text
    finally:
        sim.close()


def test_a_clean_rollout_completes_wave_after_soaked_wave_then_rolls_back(
        central_for: Callable[[int], Central], capsys: pytest.CaptureFixture[str]) -> None:
    central = central_for(100)
    rid, soak = "r-clean", 1.0
    waves = waves_of(rid, central.devices, WAVES)
    # A box of each of waves 2-4 is busy at the first rollout.start (a `models pull` of
    # the name, say): it is asked again a second later, and the rollout still completes.
    busy = [waves[w][0] for w in (2, 3, 4)]
    sim = link_fleet(central, dict.fromkeys(busy, "busy_once"))
    try:
        cpu0, t0, wall0 = central.serve.cpu_s(), time.time(), time.monotonic()
        central.cli("start", f"{NAME}@2", "--id", rid, "--waves", WAVES, "--soak", "1s")
        report = settled(central, rid, "COMPLETED", 120)
        wall, t1 = time.monotonic() - wall0, time.time()
        cpu = central.serve.cpu_s() - cpu0
        assert report["states"] == {"ACTIVE": 100} and report["wave"] == 4
        api = f"http://127.0.0.1:{central.serve.port}"
        assert httpx.get(f"{api}/rollouts/{rid}").json()["phases"]["succeeded"] == 100
        assert [r["id"] for r in httpx.get(f"{api}/rollouts").json()["rollouts"]] == [rid]
        assert httpx.get(f"{api}/rollouts/nope").status_code == 404
        for device in central.devices:
            assert len(sim[device].got("rollout.start")) == (2 if device in busy else 1)
        starts = sim[busy[0]].got("rollout.start")
        assert starts[1] - starts[0] >= 1.0  # rollout_busy_retry_s
        for w in (1, 2, 3):
            active = max(sim[d].reached(rid, "ACTIVE") or 0.0 for d in waves[w])
            first_next = min(sim[d].got("rollout.start")[0] for d in waves[w + 1])
            assert first_next >= active + soak, (w, first_next - active)
        messages = central.messages_between(t0, t1)
        with capsys.disabled():
            print(f"\n[figures] 100 boxes, 4 waves, soak 1s: {wall:.1f} s, controller CPU "
                  f"{cpu:.2f} s ({100 * cpu / wall:.1f}% of one core), {messages} messages "
                  f"stored ({messages / wall:.0f}/s)")

        central.cli("rollback", rid)
        settled(central, rid, "ROLLED_BACK", 60, why=lambda: rollback_trace(central, rid, sim),
                states={"ROLLED_BACK": 100})
        assert all(len(sim[d].got("rollout.rollback")) == 1 for d in central.devices)
    finally:
        sim.close()


def test_pause_holds_the_next_wave_resume_goes_on_abort_rolls_back(
        central_for: Callable[[int], Central]) -> None:
    central = central_for(12)
    rid, spec = "r-ops", "2,50%,100%"
    waves = waves_of(rid, central.devices, spec)
    assert [len(waves[w]) for w in (1, 2, 3)] == [2, 4, 6]
    sim = link_fleet(central, dict.fromkeys(waves[3], "slow"), step_s=0.1)
    try:
        started = central.cli("start", f"{NAME}@2", "--id", rid, "--waves", spec,
                              "--rollback-on-abort")
        # The follow-up it prints carries the --config it was given, and works as printed.
        follow = started.split("follow it with: ")[1].strip()
        assert follow == f"edge-agent fleet rollout status {rid} --config {central.config}"
        printed = CliRunner().invoke(main, shlex.split(follow)[1:])
        assert printed.exit_code == 0 and rid in printed.output, printed.output
        central.cli("pause", rid)
        time.sleep(3)  # wave 1 may have started before the pause; wave 2 must not
        assert all(sim[d].got("rollout.start") == [] for d in waves[2] + waves[3])
        assert central.status(rid)["state"] == "PAUSED"
        central.cli("pause", rid, code=1)  # paused already
        central.cli("resume", rid)
        assert wait_until(lambda: all(sim[d].state(rid) == "ACTIVE" for d in waves[2])
                          and any(sim[d].got("rollout.start") for d in waves[3]), 30, 0.1)
        time.sleep(0.5)
        central.cli("abort", rid)
        report = settled(central, rid, "ABORTED", 60)
        assert report["reason"] == f"abort by {local_operator()}"  # who, as the trail says
        # Settled: the rollbacks are out; the boxes' reports of them may still be on the way.
        switched = waves[1] + waves[2]
        assert wait_until(lambda: all(central.rows(rid)[d].state == "ROLLED_BACK"
                                      for d in switched), 30, 0.2)
        rows = central.rows(rid)
        for device in switched:  # switched already: rolled back
            assert sim[device].got("rollout.rollback")
        for device in waves[3]:  # slow: still on their way, or never sent
            assert rows[device].state in ("CANCELLED", "ROLLED_BACK") or \
                rows[device].outcome == "skipped", (device, rows[device])
        assert any(rows[d].state == "CANCELLED" for d in waves[3])
        central.cli("resume", rid, code=1)  # an aborted rollout stays aborted
    finally:
        sim.close()


def test_offline_boxes_get_it_on_reconnect_a_silent_one_times_out_a_restart_carries_on(
        central_for: Callable[[int], Central]) -> None:
    central = central_for(6)
    rid, spec = "r-offline", "1,100%"
    waves = waves_of(rid, central.devices, spec)
    offline, silent = waves[2][0], waves[2][1]
    sim = wire_fleet(central, {silent: "silent"}, offline=(offline,))
    try:
        central.cli("start", f"{NAME}@2", "--id", rid, "--waves", spec, "--soak", "3s",
                    "--device-timeout", "6s", "--abort-above", "50%")
        assert wait_until(lambda: sim[waves[1][0]].state(rid) == "ACTIVE", 30, 0.1)
        central.serve.stop()  # during the soak: the next wave is the restarted one's job
        time.sleep(1)
        central.serve.start()
        assert wait_until(lambda: all(sim[d].got("rollout.start") for d in waves[2]
                                      if d != offline), 30, 0.1)
        time.sleep(1)
        sim[offline].connect()  # its session kept the command
        report = settled(central, rid, "COMPLETED", 60)
        rows = central.rows(rid)
        assert rows[offline].state == "ACTIVE"
        assert (rows[silent].outcome, report["phases"]["failed"]) == ("timed_out", 1)
        assert sim[silent].got("rollout.cancel")  # so it never switches late
        for device in central.devices:  # the restart sent nothing twice
            assert len(sim[device].got("rollout.start")) == 1
    finally:
        sim.close()
