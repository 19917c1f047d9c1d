"""One change of a model name at a time on this box, across processes: a rollout in the
running server, a `models pull NAME@VERSION` from the CLI.

The claim is an exclusive `flock` on `<state>/rollouts/.names/<sha256 of the name>.lock`,
taken without waiting; the holder writes who it is into the file (`{"pull": ref, "pid":
n}` or `{"rollout_id": id}`), so the one refused can say by whom. A process that dies, even
by kill -9, holds nothing: the kernel drops the lock with the file descriptor.

- A pull holds its name's claim for its whole run, and under it refuses a name that has a
  live rollout in `rollouts.db` (`fleet.device.release.pull`).
- The rollout runner holds the claim only while it creates a new rollout's row
  (`RolloutManager.begin`): from then on the row itself holds the name (one live rollout
  per name, `rollout_state`), and a pull refuses it.

So a pull never overlaps a rollout of its name, in either order. Changes by hand (`models
import|activate|rollback|rm`, HTTP `/api/delete` and `/api/copy`) go through `by_hand`: the
claim for their run, and refused while a rollout of the name is live (a switch under a
rollout's gate would be judged as the release's, or undone by its rollback); `force` skips
that refusal, not the claim. `.names` cannot be a
rollout's folder beside it: a rollout id holds no dot. Lock files are never deleted (a
file removed while another process waits on it would let two holders in).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edge_agent.errors import Conflict
from edge_agent.fleet.device.rollout.store import RolloutStore
from edge_agent.fleet.protocol.rollout_states import describe
from edge_agent.names import ModelName
from edge_agent.owner_only import private_dir

CLAIMS = Path("rollouts") / ".names"
ROLLOUTS_DB = "rollouts.db"


class NameHeld(Conflict):
    """Another change of the name is under way on this box; `holder` says which."""

    def __init__(self, name: str, holder: Mapping[str, Any]) -> None:
        super().__init__(f"{name} is being changed on this box by {describe(holder)}: one "
                         "change of a name at a time; try again once it has ended")
        self.name = name
        self.holder = dict(holder)


def claim_path(state_dir: Path, name: str) -> Path:
    return state_dir / CLAIMS / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.lock"


@contextmanager
def name_claim(state_dir: Path, name: str, holder: Mapping[str, Any]) -> Iterator[None]:
    """Holds `name` (normalized) for the block; NameHeld at once if another holds it."""
    path = claim_path(state_dir, name)
    private_dir(path.parent)  # the state dir too, when this is its first file
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NameHeld(name, _holder(fd)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dict(holder)).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # the lock goes with it


def _holder(fd: int) -> dict[str, Any]:
    try:  # written just after the lock was taken: it may be empty for a moment
        found = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def refuse_live_rollout(state_dir: Path, name: str) -> None:
    """NameHeld while a rollout of `name` is live here (checked under the name's claim,
    which a new rollout's row is created under too)."""
    path = state_dir / ROLLOUTS_DB
    if not path.exists():
        return
    store = RolloutStore(path)
    try:
        live = store.live_for(name)
    finally:
        store.close()
    if live is not None:
        raise NameHeld(name, {"rollout_id": live.id, "state": live.state,
                              "version": live.version})


@contextmanager
def by_hand(state_dir: Path, name: str, change: str, *, force: bool = False
            ) -> Iterator[None]:
    """A change of `name` by hand (`change` says which, for whoever is refused): under
    the name's claim, and refused while a rollout of the name is live unless `force`."""
    key = ModelName.parse(name)
    with name_claim(state_dir, key, {"change": change, "pid": os.getpid()}):
        if not force:
            refuse_live_rollout(state_dir, key)
        yield
