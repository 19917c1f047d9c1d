"""The trial of a new agent version: one small JSON file in the state dir, the one record
the base entry (`boot`) and both versions' runners agree on across restarts.

    switching   written before `current` moves; if `current` does not name the version
                yet, the switch never happened
    trying      `current` names the version; `boots` counts its starts
    committed   its gate passed: it stays
    failed      its gate failed or it was interrupted: the entry puts the previous back
    rolled_back the entry put the previous back (with `reason`); the previous version's
                runner records the outcome and removes the file

It lives beside the databases but outside them, so that restoring a snapshot never takes
the trial's own state back with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edge_agent.files import atomic_write

SWITCHING, TRYING, COMMITTED, FAILED, ROLLED_BACK = (
    "switching", "trying", "committed", "failed", "rolled_back")


@dataclass(frozen=True)
class Trial:
    rollout_id: str
    version: str
    previous: str | None  # None: the base install
    state: str
    switched_at: float
    snapshot: str
    boots: int = 0
    reason: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    restored: dict[str, str] = field(default_factory=dict)  # per database: what was done

    def but(self, **changes: Any) -> Trial:
        return replace(self, **changes)


def agent_dir(state_dir: Path) -> Path:
    return state_dir / "agent"


def trial_path(state_dir: Path) -> Path:
    return agent_dir(state_dir) / "trial.json"


def read(state_dir: Path) -> Trial | None:
    """The trial, or None (none, or a file a crash cut: `atomic_write` never leaves one)."""
    try:
        data = json.loads(trial_path(state_dir).read_text(encoding="utf-8"))
        return Trial(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):
        return None


def write(state_dir: Path, trial: Trial) -> Trial:
    atomic_write(trial_path(state_dir), json.dumps(asdict(trial)).encode(), sync_dir=True)
    return trial


def clear(state_dir: Path) -> None:
    trial_path(state_dir).unlink(missing_ok=True)
