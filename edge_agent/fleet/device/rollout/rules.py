"""What the rollout runner (`fleet.device.rollout.runner`) is handed and the rules it applies, apart
from the runner so that they can be read (and tested) alone: the release side's
interface, when a STAGED release may activate, the retry backoff, and the arguments of
the `rollout.*` commands. Pure: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from edge_agent.config import parse_window
from edge_agent.engine.modelops import ModelOps
from edge_agent.fleet.device.link.command_gate import command_args
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import TargetArgs
from edge_agent.names import ModelName

MAX_BACKOFF_S = 3600.0


class Release(Protocol):
    """A release as the release side describes it after TUF verified it."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def length(self) -> int: ...

    @property
    def sha256(self) -> str: ...

    @property
    def manifest(self) -> Mapping[str, Any]: ...


class Releases(Protocol):
    """The release side (`fleet.device.release.source` + `fleet.device.release.transfer`), as
    the runner calls it, off the event loop. Each raises ReleaseRejected or ReleaseFailed
    (`fleet.device.rollout.outcomes`). `download` resumes what an earlier call left in
    `dest_dir` (the same directory per rollout across restarts); an exception raised by
    `progress(done, total)` (a cancel, a stop) must leave `download` unchanged, the partial file
    kept. `install` installs inactive (`ModelOps.install_verified(..., activate=False)`)."""

    def lookup(self, name: str, version: str) -> Release: ...

    def lookup_agent(self, version: str) -> Any: ...

    def download(self, release: Any, dest_dir: Path, *, progress: Callable[[int, int], None],
                 max_bytes_per_s: int | None = None, headroom: int) -> Path: ...

    def install(self, release: Any, path: Path, modelops: ModelOps, *, by: str) -> Any: ...


def hold_reason(*, minute: int, window: str | None, busy: int, defer: bool,
                staged_for_s: float, deadline_s: float) -> str | None:
    """Why a STAGED rollout may not activate now (None: it may). `minute`: local minutes
    after midnight."""
    if window is not None:
        start, end = parse_window(window)
        inside = start <= minute < end if start < end else minute >= start or minute < end
        if not inside:
            return f"outside the maintenance window {window}"
    if defer and busy > 0 and staged_for_s < deadline_s:
        return f"busy: {busy} request(s) running or queued"
    return None


def backoff_s(failures: int, base_s: float) -> float:
    return min(MAX_BACKOFF_S, base_s * 2 ** max(0, failures - 1))


def target(command: Command) -> dict[str, str]:
    """A `rollout.cancel` or `rollout.rollback`'s one target, the name normalized."""
    args = command_args(command, TargetArgs)
    if args.rollout_id is not None:
        return {"rollout_id": args.rollout_id}
    assert args.name is not None  # TargetArgs holds exactly one
    return {"name": ModelName.parse(args.name)}
