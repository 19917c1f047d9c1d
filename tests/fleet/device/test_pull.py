"""`edge-agent models pull NAME@VERSION`: a signed release from the box's repository,
through the real TUF client and the artifacts router in a live server — installed and
switched to (or staged), a tampered blob and expired metadata refused with nothing
installed, a cut download resumed, the bar on a real terminal (a pty) and none elsewhere,
the settings it needs, and the name held against a rollout of it, in both orders."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.cli.output import TransferBar, duration, transfer_figures
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.release import source as rel
from edge_agent.fleet.device.release import transfer
from edge_agent.fleet.device.release.pull import pull
from edge_agent.fleet.device.release.signed_releases import SignedReleases
from edge_agent.fleet.device.rollout.name_claim import NameHeld, claim_path, name_claim
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.device.rollout.store import RolloutStore
from edge_agent.fleet.protocol.rollout_states import DOWNLOADING
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import (
    ArtifactServer,
    Repo,
    device_settings,
    make_repo,
    mirror,
    sized_gguf,
    small_filesystem,
)

ROOT = Path(__file__).resolve().parents[3]
NAME = "tiny:1"
MB = 1_000_000


@dataclass
class Box:
    repo: Repo
    server: ArtifactServer
    state: Path
    old: str  # the digest tiny:1 serves before any pull
    new: str  # the release tiny:1@2's
    length: int

    @property
    def env(self) -> dict[str, str]:
        return {"EDGE_AGENT_FLEET__TUF_ROOT_FILE": str(self.repo.root_file),
                "EDGE_AGENT_FLEET__ARTIFACTS_URL": self.server.url}

    def cli(self, *args: str, code: int = 0, env: dict[str, str] | None = None) -> str:
        result = CliRunner().invoke(main, ["models", *args, "--state-dir", str(self.state)],
                                    env=self.env if env is None else env)
        assert result.exit_code == code, (result.output, result.exception)
        return result.output

    def settings(self) -> Settings:
        return device_settings(self.state, self.repo.root_file, self.server.url)

    def versions(self) -> list[tuple[str, bool]]:
        store = ModelStore(self.state)
        try:
            return [(v.digest, v.active) for v in store.versions(NAME)]
        finally:
            store.close()

    def blob_bytes(self) -> int:
        return sum(n for p, n in self.server.counter.by_path.items() if "/targets/" in p)


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    """tiny:1 installed on the box; the repository publishes tiny:1@2 (4 MB)."""
    repo = make_repo(tmp_path / "ctl")
    entry = repo.add(sized_gguf(tmp_path / "v2.gguf", 4, seed=2), NAME, "2")
    server = ArtifactServer(mirror(repo.repo.root, tmp_path / "served")).start()
    state = tmp_path / "box"
    ops = ModelOps(ModelStore(state))
    old = ops.import_file(write_tiny_gguf(tmp_path / "v1.gguf"), NAME, by="test").digest
    ops.store.close()
    yield Box(repo, server, state, old, entry.sha256, entry.length)
    server.stop()


def test_a_release_is_installed_verified_and_switched_to(box: Box) -> None:
    out = box.cli("pull", f"{NAME}@2")
    assert f"installed {NAME}@2 sha256:{box.new[:12]}" in out and "active" in out
    assert "\r" not in out and "MB/s" not in out  # no terminal: no bar
    assert box.versions() == [(box.new, True), (box.old, False)]
    history = json.loads(box.cli("history", NAME, "--json"))["history"]
    assert history[0]["action"] == "activate" and history[0]["by"].startswith("cli")
    assert history[0]["previous"] == box.old
    fetched = box.blob_bytes()
    assert fetched == box.length
    again = json.loads(box.cli("pull", f"{NAME}@2", "--json"))
    assert (again["digest"], again["downloaded"], again["active"]) == (box.new, False, True)
    assert box.blob_bytes() == fetched  # nothing fetched twice
    assert not list(transfer.downloads_dir(box.state).glob("*.gguf"))  # the store's copy


def test_no_activate_stages_the_release(box: Box) -> None:
    got = json.loads(box.cli("pull", f"{NAME}@2", "--no-activate", "--json"))
    assert (got["release"], got["digest"], got["downloaded"], got["active"]) == (
        f"{NAME}@2", box.new, True, False)
    assert got["origin"] == f"release:{NAME}@2"
    assert box.versions() == [(box.old, True), (box.new, False)]
    assert "already installed" in box.cli("pull", f"{NAME}@2")  # now switched to it
    assert box.versions()[0] == (box.new, True)


def test_a_tampered_blob_is_refused_and_nothing_installed(box: Box) -> None:
    blob = next((box.server.root / "targets" / "tiny" / "1" / "2").iterdir())
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    out = box.cli("pull", f"{NAME}@2", code=1)
    assert out.startswith(f"edge-agent: {NAME}@2: downloaded") and "signed" in out
    assert len(out.strip().splitlines()) == 1
    assert box.versions() == [(box.old, True)]
    dl = transfer.downloads_dir(box.state)
    assert not list(dl.glob("*.part")) and not list(dl.glob("*.gguf"))  # deleted


def test_tampered_metadata_is_refused_and_nothing_fetched(box: Box) -> None:
    md = box.server.root / "metadata"
    newest = max(md.glob("*.targets.json"), key=lambda p: int(p.name.split(".")[0]))
    doc = json.loads(newest.read_text())
    doc["signed"]["targets"]["tiny/1/2/model.gguf"]["custom"]["min_agent_version"] = "0.0.1"
    newest.write_text(json.dumps(doc))  # the signature kept: now it lies
    out = box.cli("pull", f"{NAME}@2", code=1)
    assert out.startswith(f"edge-agent: {NAME}@2: release metadata is not signed by the "
                          "trusted keys")
    assert box.versions() == [(box.old, True)] and box.blob_bytes() == 0


def test_expired_metadata_is_refused_with_the_boxs_clock(box: Box) -> None:
    box.repo.repo.refresh(box.repo.keys, timestamp_expires_s=-3600)
    mirror(box.repo.repo.root, box.server.root)
    out = box.cli("pull", f"{NAME}@2", code=1)
    assert "release metadata expired" in out and "UTC" in out
    assert box.versions() == [(box.old, True)] and box.blob_bytes() == 0


def test_without_the_repository_settings_one_line_names_them(box: Box) -> None:
    out = box.cli("pull", f"{NAME}@2", code=2, env={})
    assert out.count("\n") == 1
    assert "fleet.tuf_root_file and fleet.artifacts_url" in out
    out = box.cli("pull", f"{NAME}@2", code=2,
                  env={"EDGE_AGENT_FLEET__ARTIFACTS_URL": box.server.url})
    assert "set fleet.tuf_root_file (" in out and "artifacts_url" not in out.split("(")[0]


def test_a_cut_pull_resumes_from_its_part(box: Box) -> None:
    stopped = box.server.cut_at(box.server.counter.served + box.length // 2 + 20_000)
    with pytest.raises(rel.ReleaseFailed) as err:  # metadata first, then half the blob
        pull(box.settings(), ModelOps(ModelStore(box.state)), NAME, "2", by="test",
             retry=transfer.Retry(attempts=2, base_s=0.01))
    assert err.value.reason == rel.UNREACHABLE and stopped.wait(10)
    part = next(transfer.downloads_dir(box.state).glob("*.part"))
    have = part.stat().st_size
    assert 0 < have < box.length
    box.server.start()
    assert f"installed {NAME}@2" in box.cli("pull", f"{NAME}@2")
    resumed = [r for r in box.server.counter.requests if "/targets/" in r][-1]
    assert resumed.endswith(f"bytes={have}-")
    assert box.blob_bytes() <= 1.1 * box.length
    assert box.versions()[0] == (box.new, True) and not part.exists()


# -- the bar ----------------------------------------------------------------------------


def test_the_bar_shows_bytes_rate_and_eta_in_place() -> None:
    assert duration(None) == "--" and duration(7.4) == "0:07" and duration(3723) == "1:02:03"
    assert transfer_figures(42 * MB, 100 * MB, 3.1e6, 18.7) == \
        " 42%  42.0/100.0 MB  3.1 MB/s  ETA 0:19"
    out = io.StringIO()
    bar = TransferBar("tiny:1@2", out, width=10)
    bar(25 * MB, 100 * MB, 5e6, 15.0)
    bar(100 * MB, 100 * MB, 5e6, 0.0)
    assert out.getvalue() == (
        "\rtiny:1@2 [##        ]  25%  25.0/100.0 MB  5.0 MB/s  ETA 0:15"
        "\rtiny:1@2 [##########] 100%  100.0/100.0 MB  5.0 MB/s  ETA 0:00\n")
    bar.close()  # ended already: nothing more
    cut = io.StringIO()
    short = TransferBar("x", cut, width=4)
    short(10, 100, 1.0, None)
    short.close()  # a download that stopped: the line still ends
    assert cut.getvalue().endswith("ETA --\n")


def test_a_terminal_gets_the_bar_on_stderr(box: Box) -> None:
    box.server.counter.throttle_bps = 2 * MB  # a few redraws
    master, slave = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "edge_agent", "models", "pull", f"{NAME}@2", "--state-dir",
         str(box.state)], stdout=subprocess.PIPE, stderr=slave, cwd=ROOT,
        env={**os.environ, **box.env, "PYTHONPATH": str(ROOT)})
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        elif child.poll() is not None:
            break
    os.close(master)
    stdout = child.communicate(timeout=30)[0].decode()
    assert child.returncode == 0, seen
    bar = seen.decode()
    draws = [d for d in bar.replace("\r\n", "\n").split("\r") if d.strip()]
    assert len(draws) >= 3, bar  # redrawn in place
    assert f"{NAME}@2 [" in draws[0] and "MB/s" in draws[1] and "ETA 0:" in draws[1]
    assert f"/{box.length / MB:.1f} MB" in draws[1]
    assert draws[-1].startswith(f"{NAME}@2 [{'#' * 24}] 100%") and bar.endswith("\n")
    assert f"installed {NAME}@2" in stdout and "\r" not in stdout


# -- one change of a name at a time -----------------------------------------------------


def _manager(box: Box) -> RolloutManager:
    settings = box.settings()
    return RolloutManager(settings, ModelOps(ModelStore(box.state)),
                          SignedReleases(settings.fleet, box.state), probe=None)  # type: ignore[arg-type]


def test_a_live_rollout_of_the_name_refuses_the_pull(box: Box) -> None:
    store = RolloutStore(box.state / "rollouts.db")
    store.create("ro-7", NAME, "2")
    store.transition("ro-7", DOWNLOADING)
    store.close()
    out = box.cli("pull", f"{NAME}@2", code=1)
    assert f"{NAME} is being changed on this box by rollout ro-7 (DOWNLOADING)" in out
    assert box.blob_bytes() == 0 and box.versions() == [(box.old, True)]
    # --force: the rollout is not checked (the claim still is).
    assert f"installed {NAME}@2" in box.cli("pull", f"{NAME}@2", "--force")


def test_a_running_pull_makes_a_rollout_start_busy(box: Box) -> None:
    box.server.counter.throttle_bps = 4 * MB  # a second or so of download
    done: dict[str, Any] = {}

    def pulling() -> None:
        done["pulled"] = pull(box.settings(), ModelOps(ModelStore(box.state)), NAME, "2",
                              by="test")

    worker = threading.Thread(target=pulling)
    worker.start()
    deadline = time.monotonic() + 30
    while box.blob_bytes() == 0:  # the pull holds the name now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    emitted: list[dict[str, Any]] = []
    manager = _manager(box)
    manager.emit = lambda kind, cls, body: emitted.append(dict(body))
    try:
        answer = manager.begin("ro-8", NAME, "2")
        assert (answer["accepted"], answer["refused"]) == (False, "busy")
        assert answer["live"]["pull"] == f"{NAME}@2" and answer["live"]["pid"] == os.getpid()
        assert emitted[-1]["event"] == "rollout.refused"  # what the controller shows
        assert manager.store.get("ro-8") is None  # no row: the name stays the pull's
        worker.join(60)
        assert done["pulled"].active
        again = manager.begin("ro-8", NAME, "2")  # the pull has ended: the name is free
        assert again["accepted"] and again["created"]
    finally:
        manager.store.close()
    # ... and with that rollout live, a second pull is refused
    assert "by rollout ro-8 (RECEIVED)" in box.cli("pull", f"{NAME}@2", code=1)


def test_the_claim_is_one_holder_at_a_time_and_dies_with_its_process(box: Box) -> None:
    with name_claim(box.state, NAME, {"pull": f"{NAME}@9", "pid": 1}):
        out = box.cli("pull", f"{NAME}@2", code=1)
        assert f"by models pull {NAME}@9 (pid 1)" in out
        with pytest.raises(NameHeld):
            with name_claim(box.state, NAME, {"rollout_id": "x"}):
                pass
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(box.state), NAME], stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    assert "by models pull" in box.cli("pull", f"{NAME}@2", code=1)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert claim_path(box.state, NAME).exists()
    assert f"installed {NAME}@2" in box.cli("pull", f"{NAME}@2")  # nothing left held


_HOLD = """
import sys, time
from pathlib import Path
from edge_agent.fleet.device.rollout.name_claim import name_claim
with name_claim(Path(sys.argv[1]), sys.argv[2], {"pull": "held", "pid": 0}):
    print("held", flush=True)
    time.sleep(60)
"""


def test_changes_by_hand_wait_for_a_live_rollout_of_the_name(box: Box,
                                                             tmp_path: Path) -> None:
    """`models import|activate|rollback|rm` of a name under a live rollout are refused,
    naming it, with nothing changed; another name is free; `--force` goes ahead; once the
    rollout has ended the name is free again."""
    store = RolloutStore(box.state / "rollouts.db")
    store.create("ro-9", NAME, "2")
    store.transition("ro-9", DOWNLOADING)
    v3 = write_tiny_gguf(tmp_path / "v3.gguf", name="tiny-v3")
    box.cli("import", str(v3), "--name", NAME, "--no-activate", "--force")
    staged = [d for d, active in box.versions() if not active]
    before = box.versions()
    refused = f"{NAME} is being changed on this box by rollout ro-9 (DOWNLOADING)"
    for args in (("import", str(v3), "--name", NAME), ("activate", NAME, staged[0]),
                 ("rollback", NAME), ("rm", NAME, "--digest", staged[0])):
        assert refused in box.cli(*args, code=1), args
    assert box.versions() == before
    assert "imported other:1" in box.cli("import", str(v3), "--name", "other:1")
    assert "now serves" in box.cli("activate", NAME, staged[0], "--force")
    store.transition("ro-9", "CANCELLED", live=False)
    store.close()
    assert "rolled back" in box.cli("rollback", NAME)
    # While a pull of the name runs, a change by hand is refused too (and names it).
    with name_claim(box.state, NAME, {"pull": f"{NAME}@2", "pid": 812}):
        out = box.cli("rollback", NAME, "--force", code=1)
    assert f"by models pull {NAME}@2 (pid 812)" in out


def test_a_release_needs_room_for_one_copy_of_the_file_not_two(box: Box,
                                                                tmp_path: Path) -> None:
    """A box whose state dir is a 6 MB filesystem takes the 4 MB release: the store takes
    the verified download by rename, so the free-disk check counts the file once."""
    with small_filesystem(tmp_path / "small", "6m") as mnt:
        state = mnt / "box"
        ops = ModelOps(ModelStore(state))
        ops.import_file(write_tiny_gguf(tmp_path / "v1.gguf"), NAME, by="test")
        ops.store.close()
        assert not transfer.store_copy_needed(transfer.downloads_dir(state), state / "blobs")
        assert transfer.store_copy_needed(tmp_path, state / "blobs")
        result = CliRunner().invoke(main, ["models", "pull", f"{NAME}@2", "--json",
                                           "--state-dir", str(state)],
                                    env={**box.env,
                                         "EDGE_AGENT_FLEET__DOWNLOAD_HEADROOM_BYTES": "0"})
        assert result.exit_code == 0, result.output
        got = json.loads(result.output)
        assert (got["digest"], got["downloaded"], got["active"]) == (box.new, True, True)
        assert not list(transfer.downloads_dir(state).glob("*.gguf"))
