"""The base entry's boot counter and the way back (`fleet.device.agent.boot`), the state
databases' snapshot and restore (`snapshot`) and an install side by side (`slots`), on real
files: SQLite databases, a venv made by the Python that runs the tests, pip from a
wheelhouse of this test's own wheels."""

from __future__ import annotations

import sqlite3
import tarfile
from contextlib import closing
from pathlib import Path

import pytest

from edge_agent.config import Settings
from edge_agent.fleet.device.agent import boot, snapshot, trial
from edge_agent.fleet.device.agent.slots import MARKER, InstallFailed, Slots
from edge_agent.fleet.device.agent.trial import (
    FAILED,
    ROLLED_BACK,
    SWITCHING,
    TRYING,
    Trial,
)
from edge_agent.fleet.protocol.agent_release import parse
from tests.support.agentkit import wheel


def settings(tmp_path: Path, **fleet: object) -> Settings:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return Settings(state_dir=state, fleet={"agent_releases_dir": tmp_path / "releases",
                                            **fleet})


def installed(s: Settings, version: str) -> Path:
    root = s.fleet.agent_releases_dir
    assert root is not None
    (root / version / "bin").mkdir(parents=True)
    (root / version / MARKER).write_text(version)
    return root / version / "bin" / "edge-agent"


def ledger(path: Path, rows: list[str], *, migrated: bool = False) -> None:
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE IF NOT EXISTS requests (id TEXT PRIMARY KEY, model TEXT)")
        if migrated:
            db.execute("ALTER TABLE requests ADD COLUMN route TEXT")
            db.execute("PRAGMA user_version = 2")
        db.executemany("INSERT INTO requests (id, model) VALUES (?, 'smollm2:135m')",
                       [(r,) for r in rows])
        db.commit()


def ids(path: Path) -> list[str]:
    with closing(sqlite3.connect(path)) as db:
        return [r[0] for r in db.execute("SELECT id FROM requests ORDER BY id")]


def switched(s: Settings, tmp_path: Path, version: str = "0.2.0", **fields: object) -> Trial:
    snap = tmp_path / "state" / "agent" / "snapshots" / "ro-1"
    snapshot.take(s.state_dir, snap)
    Slots(s.fleet.agent_releases_dir or tmp_path).switch(version)
    return trial.write(s.state_dir, Trial("ro-1", version, None, TRYING, 1000.0, str(snap),
                                          **fields))  # type: ignore[arg-type]


def test_the_entry_counts_the_new_versions_starts_then_puts_the_previous_back(
        tmp_path: Path) -> None:
    s = settings(tmp_path, agent_max_boots=3)
    exe = installed(s, "0.2.0")
    switched(s, tmp_path)
    for boots in (1, 2, 3):
        assert boot.at_start(s, now=1001.0) == exe
        t = trial.read(s.state_dir)
        assert t is not None and (t.state, t.boots) == (TRYING, boots)
    assert boot.at_start(s, now=1001.0) is None  # the fourth start: the base version
    t = trial.read(s.state_dir)
    assert t is not None and t.state == ROLLED_BACK
    assert "started 3 time(s) without passing its gate" in t.reason
    assert Slots(tmp_path / "releases").current() is None


def test_a_failed_gate_restores_a_migrated_database_and_keeps_every_row(
        tmp_path: Path) -> None:
    s = settings(tmp_path)
    installed(s, "0.2.0")
    live = s.state_dir / "ledger.db"
    ledger(live, ["a", "b"])
    t = switched(s, tmp_path)
    # The new version migrates and writes; the gate fails.
    ledger(live, ["c"], migrated=True)
    trial.write(s.state_dir, t.but(state=FAILED, reason="gate check prompt:x failed"))
    assert boot.at_start(s, now=1001.0) is None
    t2 = trial.read(s.state_dir)
    assert t2 is not None and t2.state == ROLLED_BACK
    assert t2.reason == "gate check prompt:x failed"
    assert t2.restored == {"ledger.db": "restored, 1 row(s) written meanwhile carried over"}
    assert ids(live) == ["a", "b", "c"]
    assert snapshot.schema(live) == snapshot.schema(Path(t.snapshot) / "ledger.db")


def test_an_unchanged_schema_keeps_the_live_database(tmp_path: Path) -> None:
    s = settings(tmp_path)
    installed(s, "0.2.0")
    live = s.state_dir / "ledger.db"
    ledger(live, ["a"])
    t = switched(s, tmp_path)
    ledger(live, ["b"])
    trial.write(s.state_dir, t.but(state=FAILED, reason="no"))
    boot.at_start(s, now=1001.0)
    t2 = trial.read(s.state_dir)
    assert t2 is not None and t2.restored == {"ledger.db": "kept (schema unchanged)"}
    assert ids(live) == ["a", "b"]


def test_a_switch_that_never_happened_ends_the_trial(tmp_path: Path) -> None:
    s = settings(tmp_path)
    installed(s, "0.2.0")
    snap = s.state_dir / "agent" / "snapshots" / "ro-1"
    trial.write(s.state_dir, Trial("ro-1", "0.2.0", None, SWITCHING, 1000.0, str(snap)))
    assert boot.at_start(s, now=1001.0) is None
    t = trial.read(s.state_dir)
    assert t is not None and (t.state, t.reason) == (ROLLED_BACK,
                                                     "interrupted before the switch")


def test_past_the_ready_bound_the_previous_version_comes_back(tmp_path: Path) -> None:
    s = settings(tmp_path, agent_ready_timeout_s=60)
    installed(s, "0.2.0")
    exe = installed(s, "0.1.9")
    Slots(tmp_path / "releases").switch("0.1.9")
    t = switched(s, tmp_path)
    trial.write(s.state_dir, t.but(previous="0.1.9"))
    Slots(tmp_path / "releases").switch("0.2.0")
    assert boot.at_start(s, now=1061.0) == exe
    t2 = trial.read(s.state_dir)
    assert t2 is not None and "within 60 s of the switch" in t2.reason


def test_a_link_to_an_unfinished_install_runs_the_base_version(tmp_path: Path) -> None:
    s = settings(tmp_path)
    root = tmp_path / "releases"
    (root / "0.2.0").mkdir(parents=True)
    Slots(root).switch("0.2.0")
    assert boot.at_start(s) is None


# -- an install side by side ----------------------------------------------------------------

def agent_tar(tmp_path: Path, *, native_exit: int) -> tuple[Path, object]:
    house = tmp_path / "house"
    house.mkdir()
    native = f"import sys\nprint('ok' if {native_exit} == 0 else 'libgomp.so.1 missing')\n" \
             f"sys.exit({native_exit})\n"
    wheel(house, "edge-agent-appliance", "0.2.0", {
        "edge_agent/__init__.py": "__version__ = '0.2.0'\n",
        "edge_agent/engine/__init__.py": "", "edge_agent/engine/runtime/__init__.py": "",
        "edge_agent/engine/runtime/native.py": native})
    m = parse({"version": "0.2.0", "edge_agent": "0.2.0", "llama_cpp_python": "0.3.36",
               "python": "cp311", "abi": "cp311", "platform": "linux_x86_64",
               "requirement": "edge-agent-appliance==0.2.0",
               "wheels": [p.name for p in house.iterdir()]})
    tar = tmp_path / "wheelhouse.tar"
    with tarfile.open(tar, "w") as t:
        for p in house.iterdir():
            t.add(p, arcname=p.name)
    return tar, m


def test_an_install_goes_into_its_own_venv_and_is_checked_there(tmp_path: Path) -> None:
    tar, m = agent_tar(tmp_path, native_exit=0)
    slots = Slots(tmp_path / "releases")
    dest = slots.install(tar, m)  # type: ignore[arg-type]
    assert slots.installed("0.2.0") and (dest / "bin" / "python").exists()
    assert not list((tmp_path / "releases").glob(".wheelhouse-*"))
    assert slots.current() is None  # installed, not switched to
    slots.switch("0.2.0")
    assert slots.current() == "0.2.0"
    assert slots.prune({"0.2.0"}) == []


def test_an_install_whose_llama_cpp_does_not_load_is_removed(tmp_path: Path) -> None:
    tar, m = agent_tar(tmp_path, native_exit=1)
    slots = Slots(tmp_path / "releases")
    with pytest.raises(InstallFailed, match="llama.cpp check: .*libgomp.so.1 missing"):
        slots.install(tar, m)  # type: ignore[arg-type]
    assert not (tmp_path / "releases" / "0.2.0").exists()


def test_an_install_a_kill_cut_is_done_again(tmp_path: Path) -> None:
    tar, m = agent_tar(tmp_path, native_exit=0)
    slots = Slots(tmp_path / "releases")
    cut = tmp_path / "releases" / "0.2.0"
    (cut / "bin").mkdir(parents=True)  # a venv half made, no `.installed`
    (tmp_path / "releases" / ".wheelhouse-0.2.0").mkdir()
    assert not slots.installed("0.2.0")
    Slots(tmp_path / "releases").switch("0.2.0")
    assert boot.at_start(settings(tmp_path)) is None  # never run unfinished
    slots.install(tar, m)  # type: ignore[arg-type]
    assert slots.installed("0.2.0") and (cut / "bin" / "python").exists()


def test_a_wheelhouse_with_anything_but_plain_files_is_refused(tmp_path: Path) -> None:
    _, m = agent_tar(tmp_path, native_exit=0)
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as t:
        info = tarfile.TarInfo("../outside.whl")
        t.addfile(info)
    with pytest.raises(InstallFailed, match="unpack: '../outside.whl' is not a wheel's"):
        Slots(tmp_path / "releases").install(evil, m)  # type: ignore[arg-type]
    assert not (tmp_path / "outside.whl").exists()
    assert not (tmp_path / "releases" / "0.2.0").exists()


def test_a_restart_is_asked_of_the_server_and_marked_for_the_exit(tmp_path: Path) -> None:
    stopped: list[bool] = []
    boot.request_restart(tmp_path, lambda: stopped.append(True))
    assert stopped == [True]
    assert boot.restart_requested(tmp_path)  # `serve` exits 75 …
    assert not boot.restart_requested(tmp_path)  # … once
