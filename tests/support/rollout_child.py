"""A box that runs one rollout and kills itself (SIGKILL, no cleanup) at a chosen point:
`python -m tests.support.rollout_child STATE_DIR SPEC_JSON`. SPEC: {"name", "version", "file",
"manifest", "rollout_id", "kill_at"}; kill_at is a state the rollout enters, "switched"
(right after the pointer moved), or "DOWNLOADING" (then halfway through the transfer)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.device.rollout.store import Rollout
from tests.support.rollout_support import DirReleases, PaperLoader, ScriptedProbe


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def main(state: Path, spec: dict) -> None:
    settings = Settings(state_dir=state)
    store = ModelStore(state)
    ops = ModelOps(store, PaperLoader(store))
    releases = DirReleases()
    releases.add(spec["name"], spec["version"], Path(spec["file"]), spec["manifest"])
    kill_at = spec["kill_at"]
    if kill_at == "DOWNLOADING":
        releases.after_chunk = lambda done, total: die() if done * 2 >= total else None

    def hook(event: str, r: Rollout) -> None:
        if event == kill_at and kill_at != "DOWNLOADING":
            die()

    manager = RolloutManager(settings, ops, releases, ScriptedProbe(store), hook=hook,
                             poll_s=0.02)
    await manager.start()
    manager.begin(spec["rollout_id"], spec["name"], spec["version"])
    await manager.settled(spec["rollout_id"], 60)
    await manager.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), json.loads(sys.argv[2])))
    sys.exit(3)  # the kill point was never reached
