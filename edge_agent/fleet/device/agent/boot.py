"""The service's entry, before anything opens a database: which agent version runs now.

`edge-agent serve` of the base install (the one systemd's `ExecStart` names, installed by
the role and never replaced over the fleet) calls `at_start` first. With a trial under way
(`trial`) it is the boot counter of RAUC and Mender:

    the switch never happened (`current` does not name the trial's version): the trial
        ends rolled back, nothing to restore
    the new version failed its gate, was interrupted (`failed`), has started more than
        `fleet.agent_max_boots` times without passing it, or is past
        `fleet.agent_ready_timeout_s` since the switch: `current` back to the previous
        version, the databases restored where its migrations changed them (`snapshot`),
        the trial rolled back with the reason
    otherwise: one more start counted

and then it execs `current`'s `edge-agent` with the same arguments (same process id:
systemd's notify socket and watchdog carry over), or, with no `current`, goes on as the
base version. A version started that way finds itself running from its slot and goes on.

`request_restart` is how a runner asks systemd for a new start: a mark in the state dir and
the server's own stop (the drain of a SIGTERM, without the signal: uvicorn would raise it
again once stopped, and a process that dies of SIGTERM is a clean stop to systemd); `serve`
exits with `RESTART_EXIT` once the server has stopped and the mark is there, and the unit's
`Restart=on-failure` starts it again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from edge_agent.config import Settings
from edge_agent.fleet.device.agent import snapshot, trial
from edge_agent.fleet.device.agent.slots import Slots
from edge_agent.fleet.device.agent.trial import (
    FAILED,
    ROLLED_BACK,
    SWITCHING,
    TRYING,
    Trial,
)

log = logging.getLogger(__name__)
RESTART_EXIT = 75  # EX_TEMPFAIL: systemd's Restart=on-failure starts the service again
_RESTART_MARK = "restart"


def at_start(settings: Settings, *, now: float | None = None) -> Path | None:
    """The `edge-agent` to exec instead of going on (None: go on here); see the module's
    doc. Never raises for a bad trial or link: the base version runs then."""
    root = settings.fleet.agent_releases_dir
    if root is None:
        return None
    slots = Slots(root)
    if slots.running() is not None:
        return None  # started by the entry: this is the version to run
    state_dir = settings.state_dir
    t = trial.read(state_dir)
    when = time.time() if now is None else now
    if t is not None and t.state in (SWITCHING, TRYING):
        if slots.current() != t.version:
            trial.write(state_dir, t.but(state=ROLLED_BACK,
                                         reason="interrupted before the switch"))
        elif t.boots >= settings.fleet.agent_max_boots:
            t = roll_back(settings, slots, t, f"{t.version} started {t.boots} time(s) "
                          "without passing its gate (fleet.agent_max_boots)")
        elif when - t.switched_at > settings.fleet.agent_ready_timeout_s:
            t = roll_back(settings, slots, t, f"{t.version} did not pass its gate within "
                          f"{settings.fleet.agent_ready_timeout_s:.0f} s of the switch "
                          "(fleet.agent_ready_timeout_s)")
        elif not slots.installed(t.version):
            t = roll_back(settings, slots, t, f"{t.version} is not installed")
        else:
            trial.write(state_dir, t.but(state=TRYING, boots=t.boots + 1))
    elif t is not None and t.state == FAILED:
        roll_back(settings, slots, t, t.reason or "its gate failed")
    current = slots.current()
    if current is None:
        return None
    if not slots.installed(current):
        log.error("agent: %s names %s, which is not installed; running the base version",
                  root / "current", current)
        return None
    return slots.path(current) / "bin" / "edge-agent"


def roll_back(settings: Settings, slots: Slots, t: Trial, reason: str) -> Trial:
    """`current` back to the previous version, the databases restored where needed, the
    trial rolled back with `reason` (what was done to each database kept with it)."""
    slots.switch(t.previous)
    restored: dict[str, str] = {}
    snap = Path(t.snapshot)
    if snap.is_dir():
        restored = snapshot.restore(settings.state_dir, snap)
    log.warning("agent: %s rolled back to %s: %s", t.version, t.previous or "the base install",
                reason)
    return trial.write(settings.state_dir, t.but(state=ROLLED_BACK, reason=reason[:500],
                                                 restored=restored))


def request_restart(state_dir: Path, stop: Callable[[], None] | None = None) -> None:
    """The mark, then the server's own stop (`stop`: `SupervisedServer.request_stop`);
    without one, SIGTERM (a process that dies of it is a clean stop to systemd: only a
    server `serve` built exits 75)."""
    mark = trial.agent_dir(state_dir) / _RESTART_MARK
    mark.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    mark.write_text(str(time.time()), encoding="utf-8")
    if stop is not None:
        stop()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def restart_requested(state_dir: Path) -> bool:
    """Whether a runner asked for this stop (the mark is taken away)."""
    mark = trial.agent_dir(state_dir) / _RESTART_MARK
    try:
        mark.unlink()
    except FileNotFoundError:
        return False
    return True
