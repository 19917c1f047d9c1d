"""The state dir is owner-only whoever starts the box: started under umask 0022 (outside
systemd's `UMask=0077`), every folder it creates is 0700 and every file and database 0600,
SQLite's -wal and -shm included; an existing state dir open to others is narrowed at start,
and nothing that exists is widened."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from edge_agent.app import create_app
from edge_agent.config import load_settings
from edge_agent.files import atomic_write, locked
from edge_agent.fleet.device.link.outbox import Outbox
from edge_agent.fleet.device.link.overlay import OVERLAY_FILE
from edge_agent.fleet.device.link.state import FleetState
from edge_agent.fleet.device.rollout.name_claim import by_hand
from edge_agent.fleet.device.rollout.store import RolloutStore
from edge_agent.governance.keys import KeyStore
from edge_agent.ledger.store import REQUESTS, open_ledger
from edge_agent.owner_only import private_dir, private_file
from tests.conftest import DEFAULT_MODEL, free_port, start_server
from tests.support.fleetkit import wait_until


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask of a shell, a container's entry point, `sudo edge-agent serve`."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _exposed(root: Path) -> list[str]:
    """`root` and everything under it that its group or others may read, write or enter."""
    found = []
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        if not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) & 0o077:
            found.append(f"{path.relative_to(root)} {stat.S_IMODE(info.st_mode):o}")
    return found


@pytest.mark.integration
def test_a_box_started_under_umask_022_creates_its_state_owner_only(
        tmp_path: Path, umask_022: None) -> None:
    """A fresh state dir, made by the live server itself: the default model installed from
    its package (blobs/, manifests/, models.db), a completion served (ledger.db), the
    redaction key; a key added beside it (keys.db), as `edge-agent keys create` adds one."""
    state = tmp_path / "var" / "state"  # parents missing too
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 512})
    live = start_server(settings)
    ledger = None
    try:
        client = openai.OpenAI(base_url=live.openai_url, api_key="unused", max_retries=0)
        r = client.completions.create(model=DEFAULT_MODEL, prompt="Hi", max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        KeyStore(state).create("local")
        ledger = open_ledger(state / "ledger.db")  # held open: its -wal and -shm are there
        # The row is queued after the response's last byte: flush until it is written.
        assert wait_until(lambda: live.app.state.parts.ledger.flush()
                          and ledger[REQUESTS].count >= 1, 10)  # type: ignore[union-attr]
        names = {p.name for p in state.rglob("*")}
        assert {"blobs", "manifests", "models.db", "ledger.db", "ledger.db-wal",
                "ledger.db-shm", "keys.db", "redaction.key"} <= names, names
        assert any(n.startswith("sha256-") for n in names), names
        assert _exposed(tmp_path / "var") == []
    finally:
        if ledger is not None:
            ledger.close()
        live.stop()


def test_the_fleet_files_are_owner_only_under_umask_022(tmp_path: Path,
                                                        umask_022: None) -> None:
    """outbox.db, fleet.db, rollouts.db (each held open, WAL) and a name's claim, each the
    first file of a fresh state dir."""
    for first in ("outbox", "fleet", "rollouts", "claim"):
        state = tmp_path / first / "state"
        stores: list[Outbox | FleetState | RolloutStore] = []
        try:
            if first == "claim":
                with by_hand(state, DEFAULT_MODEL, "copy"):
                    assert _exposed(tmp_path / first) == []
            stores.append(Outbox(state / "outbox.db", device="box-1",
                                 boot_id=uuid.uuid4().hex, max_bytes=1 << 20))
            stores.append(FleetState(state / "fleet.db"))
            stores.append(RolloutStore(state / "rollouts.db"))
            names = {p.name for p in state.iterdir()}
            assert {"outbox.db-wal", "fleet.db-shm", "rollouts.db-wal"} <= names, names
            assert _exposed(tmp_path / first) == []
        finally:
            for store in stores:
                store.close()


def test_the_link_s_plain_files_are_owner_only_under_umask_022(tmp_path: Path,
                                                               umask_022: None) -> None:
    """The overlay a config.patch saves, fleet-sync.json, a download's lock and its .part:
    written by `files.atomic_write`, `files.locked` and the transfer, 0600 by default."""
    state = tmp_path / "state"
    private_dir(state)
    atomic_write(state / OVERLAY_FILE, b"{}", sync_dir=True)
    with locked(state / "downloads.lock"):
        pass
    assert _exposed(tmp_path) == []


def test_an_existing_state_dir_open_to_others_is_narrowed_at_start(
        tmp_path: Path, umask_022: None) -> None:
    """A state dir made 0755 (by hand, or by an earlier version under umask 0022) is the
    box's own: serve narrows it to 0700, as systemd's StateDirectoryMode=0700 does."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    app = create_app(load_settings(None, state_dir=state), preload=False)
    with TestClient(app):
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert _exposed(state) == []


def test_the_modes_do_not_depend_on_the_umask_and_nothing_is_widened(tmp_path: Path) -> None:
    """Under umask 0 (where mkdir and open would give 0777 and 0666) the helpers create
    0700 and 0600; an existing folder or file is left exactly as it is (only the state
    dir at start is narrowed)."""
    old = os.umask(0)
    try:
        made = private_file(tmp_path / "a" / "b" / "x.db")
        assert [stat.S_IMODE(p.stat().st_mode) for p in (
            tmp_path / "a", tmp_path / "a" / "b", made)] == [0o700, 0o700, 0o600]
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o750)
        (shared / "f").write_bytes(b"")
        os.chmod(shared / "f", 0o640)
        private_dir(shared)
        private_file(shared / "f")
        assert stat.S_IMODE(shared.stat().st_mode) == 0o750
        assert stat.S_IMODE((shared / "f").stat().st_mode) == 0o640
    finally:
        os.umask(old)
