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
from edge_agent.errors import InvalidRequest
from edge_agent.fleet.protocol.command_types import ROLLOUT_ID, VERSION
from edge_agent.fleet.protocol.refusals import MALFORMED, CommandRefused
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


def check_id(value: Any) -> str:
    if not isinstance(value, str) or not ROLLOUT_ID.fullmatch(value):
        raise CommandRefused(MALFORMED, "rollout_id: 1-64 of [A-Za-z0-9_-]")
    return value


def check_name(value: Any) -> ModelName:
    try:
        if not isinstance(value, str):
            raise InvalidRequest("not a string")
        return ModelName.parse(value)
    except InvalidRequest as exc:
        raise CommandRefused(MALFORMED, f"name: {exc.message[:100]}") from None


def check_version(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if not isinstance(value, str) or not VERSION.fullmatch(value):
        raise CommandRefused(MALFORMED, "version: a number or 1-64 of [A-Za-z0-9._+-]")
    return value


def target(args: Mapping[str, Any]) -> dict[str, str]:
    if set(args) == {"rollout_id"}:
        return {"rollout_id": check_id(args["rollout_id"])}
    if set(args) == {"name"}:
        return {"name": check_name(args["name"])}
    raise CommandRefused(MALFORMED, "args must be {rollout_id} or {name}")
