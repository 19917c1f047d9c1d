"""An agent release through the box's rollout runner, on both sides of the restart: the
running version installs it (a real venv and pip from the release's wheelhouse), records
its baseline, snapshots the databases, switches and asks for a restart; the base entry
counts the start; the new version gates itself against the baseline and commits, or fails
and the entry puts the previous one back, with the outcome recorded by whichever version
runs. Kills at each step converge on one version.

The two versions are the same code told apart by `agent_version` and `running_release`
(the release the process runs from); the model under the gate is a paper one and the probe
answers as the version that runs (`test_rollout.py`'s stand-ins). The real service, its
systemd and a real controller: `tests/test_systemd_box.py`."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.agent import boot, trial
from edge_agent.fleet.device.agent.slots import Slots
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.protocol.agent_release import AGENT_NAME
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    GATING,
    REJECTED,
    ROLLED_BACK,
)
from edge_agent.ledger.evidence import evidence_for
from tests.support.agentkit import AgentReleases, VersionProbe, agent_release
from tests.support.pace import SETTLE_S
from tests.support.rollout_support import PaperLoader, write_gguf

MODEL = "m:1"
ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Box:
    tmp: Path
    settings: Settings
    ops: ModelOps
    releases: AgentReleases
    probe: VersionProbe
    running: list[str]  # the agent version this "process" is
    restarts: list[str] = field(default_factory=list)

    def manager(self) -> RolloutManager:
        version = self.running[0]
        release = None if version == "0.1.0" else version
        return RolloutManager(self.settings, self.ops, self.releases, self.probe,
                              poll_s=0.01, retry_base_s=0.01,
                              restart=lambda: self.restarts.append(version),
                              agent_version=version, running_release=lambda: release)

    def rows(self) -> list[str]:
        with closing(sqlite3.connect(self.settings.state_dir / "ledger.db")) as db:
            return [r[0] for r in db.execute("SELECT id FROM marks ORDER BY id")]

    def write_row(self, row: str, *, migrate: bool = False) -> None:
        with closing(sqlite3.connect(self.settings.state_dir / "ledger.db")) as db:
            db.execute("CREATE TABLE IF NOT EXISTS marks (id TEXT PRIMARY KEY)")
            if migrate:
                db.execute("ALTER TABLE marks ADD COLUMN more TEXT")
            db.execute("INSERT INTO marks (id) VALUES (?)", (row,))
            db.commit()

    def boot(self) -> str:
        """The base entry at a start: the version that runs now."""
        exe = boot.at_start(self.settings)
        self.running[0] = "0.1.0" if exe is None else exe.parent.parent.name
        return self.running[0]


@pytest.fixture
def box(tmp_path: Path) -> Box:
    state = tmp_path / "state"
    store = ModelStore(state)
    ops = ModelOps(store, PaperLoader(store))  # type: ignore[arg-type]
    ops.import_file(write_gguf(tmp_path / "v1.gguf"), MODEL, by="test")
    settings = Settings(state_dir=state, default_model=MODEL,
                        fleet={"agent_releases_dir": tmp_path / "releases"})
    running = ["0.1.0"]
    releases = AgentReleases()
    made = Box(tmp_path, settings, ops, releases, VersionProbe({}, running), running)
    made.write_row("before")
    return made


async def _until(manager: RolloutManager, check: Callable[[], bool], what: str) -> None:
    for _ in range(int(SETTLE_S / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def _run(box: Box, body: Callable[[RolloutManager], Any]) -> Any:
    manager = box.manager()
    await manager.start()
    try:
        return await body(manager)
    finally:
        await manager.stop()


def _switch_to_new(box: Box, rid: str = "ag-1", version: str = "0.2.0") -> None:
    """The old version's side: begin, install, baseline, snapshot, switch, restart asked."""
    async def body(m: RolloutManager) -> None:
        assert m.begin(rid, AGENT_NAME, version)["accepted"]
        await _until(m, lambda: bool(box.restarts), "the restart request")

    asyncio.run(_run(box, body))


def _settle(box: Box, rid: str = "ag-1") -> Any:
    """One start of whichever version the entry picks, until the rollout is settled or a
    restart is asked; the row as that version sees it."""
    asked = len(box.restarts)

    async def body(m: RolloutManager) -> Any:
        await _until(m, lambda: len(box.restarts) > asked or (
            (r := m.store.get(rid)) is not None and not r.live and r.restored
            and rid not in m._tasks), "the rollout to settle")
        return m.store.get(rid)

    return asyncio.run(_run(box, body))


def test_a_good_release_is_installed_switched_to_gated_and_committed(box: Box) -> None:
    tar, m = agent_release(box.tmp)
    box.releases.add_agent(tar, m)
    _switch_to_new(box)
    slots = Slots(box.tmp / "releases")
    assert slots.installed("0.2.0") and slots.current() == "0.2.0"
    t = trial.read(box.settings.state_dir)
    assert t is not None and (t.state, t.previous, t.boots) == ("trying", None, 0)
    with closing(sqlite3.connect(box.settings.state_dir / "rollouts.db")) as db:
        state = db.execute("SELECT state FROM rollouts WHERE id = 'ag-1'").fetchone()[0]
    assert state == ACTIVATING
    assert box.probe.calls == ["0.1.0"]  # the baseline, on the running version
    assert box.boot() == "0.2.0"
    box.write_row("by-new")
    r = _settle(box)
    assert (r.state, r.restored) == (ACTIVE, True), r
    assert box.probe.calls == ["0.1.0", "0.2.0"]
    assert trial.read(box.settings.state_dir) is None
    assert not (box.settings.state_dir / "agent" / "snapshots" / "ag-1").exists()
    assert box.rows() == ["before", "by-new"]
    ev = evidence_for(box.settings.state_dir / "ledger.db", AGENT_NAME)[0]
    assert ev["outcome"] == ACTIVE and ev["parameters"]["agent"]["to"] == "0.2.0"
    assert box.boot() == "0.2.0"  # and it stays


def test_a_release_that_fails_its_gate_puts_the_previous_back_with_every_row(
        box: Box) -> None:
    tar, m = agent_release(box.tmp)
    box.releases.add_agent(tar, m)
    box.probe.answers["0.2.0"] = "good day"  # the golden prompt wants "hello"
    _switch_to_new(box)
    assert box.boot() == "0.2.0"
    box.write_row("by-new", migrate=True)  # the new version migrated and wrote
    r = _settle(box)
    assert r.state == GATING and box.restarts[-1] == "0.2.0"  # failed: a restart asked
    t = trial.read(box.settings.state_dir)
    assert t is not None and t.state == "failed" and "prompt:hello" in t.reason
    assert box.boot() == "0.1.0"
    assert Slots(box.tmp / "releases").current() is None
    r = _settle(box)
    assert (r.state, r.restored) == (ROLLED_BACK, True)
    assert "prompt:hello" in (r.reason or "")
    assert box.rows() == ["before", "by-new"]  # restored schema, the new row carried over
    ev = evidence_for(box.settings.state_dir / "ledger.db", AGENT_NAME)[0]
    assert ev["outcome"] == ROLLED_BACK
    assert "restored" in ev["parameters"]["agent"]["restored"]["ledger.db"]
    assert not Slots(box.tmp / "releases").installed("0.2.0")  # pruned
    assert trial.read(box.settings.state_dir) is None
    shown = CliRunner().invoke(main, ["models", "history", "edge-agent", "--state-dir",
                                      str(box.settings.state_dir)])
    assert shown.exit_code == 0, shown.output
    assert "edge-agent:latest version 0.2.0" in shown.output and "ROLLED_BACK" in shown.output
    assert "switch    0.1.0 → 0.2.0 (previous the base install), 1 start(s)" in shown.output
    assert "ledger.db restored, 1 row(s) written meanwhile carried over" in shown.output


def test_a_release_that_never_comes_up_is_rolled_back_by_the_boot_counter(box: Box) -> None:
    tar, m = agent_release(box.tmp)
    box.releases.add_agent(tar, m)
    _switch_to_new(box)
    for _ in range(box.settings.fleet.agent_max_boots):
        assert box.boot() == "0.2.0"  # ... and it crashes at start, each time
    assert box.boot() == "0.1.0"
    r = _settle(box)
    assert r.state == ROLLED_BACK and "without passing its gate" in (r.reason or "")


def test_a_kill_during_the_gate_ends_on_the_previous_version(box: Box) -> None:
    tar, m = agent_release(box.tmp)
    box.releases.add_agent(tar, m)
    _switch_to_new(box)
    assert box.boot() == "0.2.0"
    with closing(sqlite3.connect(box.settings.state_dir / "rollouts.db")) as db:
        db.execute("UPDATE rollouts SET state = 'GATING' WHERE id = 'ag-1'")  # killed there
        db.commit()
    assert box.boot() == "0.2.0"
    r = _settle(box)  # never gated again: failed, a restart asked
    assert r.state == GATING and box.restarts[-1] == "0.2.0"
    assert box.boot() == "0.1.0"
    r = _settle(box)
    assert r.state == ROLLED_BACK and r.reason == "interrupted during gating"


def test_a_kill_before_the_switch_ends_rolled_back_on_the_running_version(box: Box) -> None:
    tar, m = agent_release(box.tmp)
    box.releases.add_agent(tar, m)
    _switch_to_new(box)
    # As if killed after the trial was written, before `current` moved.
    Slots(box.tmp / "releases").switch(None)
    t = trial.read(box.settings.state_dir)
    assert t is not None
    trial.write(box.settings.state_dir, t.but(state="switching"))
    assert box.boot() == "0.1.0"
    r = _settle(box)
    assert r.state == ROLLED_BACK and r.reason == "interrupted before the switch"


def test_a_release_built_for_another_platform_is_refused_before_download(box: Box) -> None:
    tar, m = agent_release(box.tmp, platform=("cp39", "cp39", "win_amd64"))
    box.releases.add_agent(tar, m)

    async def body(mgr: RolloutManager) -> Any:
        assert mgr.begin("ag-x", AGENT_NAME, "0.2.0")["accepted"]
        await _until(mgr, lambda: (r := mgr.store.get("ag-x")) is not None and not r.live,
                     "the refusal")
        return mgr.store.get("ag-x")

    r = asyncio.run(_run(box, body))
    assert (r.state, r.reason) == (REJECTED, "not_for_this_box")
    assert "built for cp39-cp39-win_amd64" in r.details["message"]
    assert box.releases.copied == 0  # nothing downloaded
    assert not (box.tmp / "releases" / "0.2.0").exists()


@pytest.mark.parametrize(("kill_at", "ends"), [
    ("DOWNLOADING", ACTIVE), ("VERIFYING", ACTIVE), ("installing", ACTIVE),
    (ACTIVATING, ROLLED_BACK), ("trial", None), ("switched", ACTIVE)])
def test_kill_9_at_each_step_ends_on_one_version(box: Box, kill_at: str,
                                                  ends: str | None) -> None:
    """The running version killed (SIGKILL, its own process) at a step of the switch; then
    the starts a box makes (the base entry, then whichever version it runs, again while
    one asks for a restart) until the rollout is final: on the new version, ACTIVE, or on
    the one before, ROLLED_BACK, never between; the rows all there. Killed just as the trial
    is written, either end is right: the switch may or may not have happened."""
    tar, m = agent_release(box.tmp)
    spec = {"tar": str(tar), "manifest": m.model_dump(), "releases_dir":
            str(box.tmp / "releases"), "model": MODEL, "rollout_id": "ag-k", "kill_at": kill_at}
    child = subprocess.run([sys.executable, "-m", "tests.support.agent_child",
                            str(box.settings.state_dir), json.dumps(spec)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr[-3000:])
    box.releases.add_agent(tar, m)
    r = None
    for _ in range(6):  # the starts: each until the rollout settles or asks for one more
        box.boot()
        asked = len(box.restarts)
        r = _settle(box, "ag-k")
        if len(box.restarts) == asked:
            break
    assert r is not None and not r.live and r.restored, r
    current = Slots(box.tmp / "releases").current()
    assert (r.state, current, box.running[0]) in (
        (ACTIVE, "0.2.0", "0.2.0"), (ROLLED_BACK, None, "0.1.0")), (r.state, r.reason)
    assert ends is None or r.state == ends, (r.state, r.reason)
    assert trial.read(box.settings.state_dir) is None
    assert box.rows() == ["before"]
    assert box.boot() == box.running[0]  # and the next start runs the same
