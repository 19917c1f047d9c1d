"""A box's running agent version that takes one agent release and kills itself (SIGKILL,
no cleanup) at a chosen point: `python -m tests.support.agent_child STATE_DIR SPEC_JSON`.
SPEC: {"tar", "manifest", "releases_dir", "model", "rollout_id", "kill_at"}; kill_at is a
state the rollout enters, "switched" (right after `current` moved), "DOWNLOADING" (once
the transfer has written), "installing" (once the new venv exists, pip not done) or "trial"
(once the trial is written, the databases snapshotted)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.agent.trial import trial_path
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.device.rollout.store import Rollout
from edge_agent.fleet.protocol.agent_release import AGENT_NAME, parse
from tests.support.agentkit import AgentReleases, VersionProbe
from tests.support.rollout_support import PaperLoader


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_when(path: Path) -> None:
    def watch() -> None:
        while not path.exists():
            time.sleep(0.005)
        die()

    threading.Thread(target=watch, daemon=True).start()


async def main(state: Path, spec: dict) -> None:
    releases_dir = Path(spec["releases_dir"])
    settings = Settings(state_dir=state, default_model=spec["model"],
                        fleet={"agent_releases_dir": releases_dir})
    store = ModelStore(state)
    ops = ModelOps(store, PaperLoader(store))
    manifest = parse(spec["manifest"])
    releases = AgentReleases()
    releases.add_agent(Path(spec["tar"]), manifest)
    kill_at = spec["kill_at"]
    if kill_at == "DOWNLOADING":
        releases.after_chunk = lambda done, total: die()
    elif kill_at == "installing":
        die_when(releases_dir / manifest.version / "bin" / "python")
    elif kill_at == "trial":
        die_when(trial_path(state))

    def hook(event: str, r: Rollout) -> None:
        if event == kill_at:
            die()

    manager = RolloutManager(settings, ops, releases, VersionProbe({}, ["0.1.0"]),
                             hook=hook, poll_s=0.02, restart=die, agent_version="0.1.0",
                             running_release=lambda: None)
    await manager.start()
    manager.begin(spec["rollout_id"], AGENT_NAME, manifest.version)
    await manager.settled(spec["rollout_id"], 120)
    await manager.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), json.loads(sys.argv[2])))
    sys.exit(3)  # the kill point was never reached
