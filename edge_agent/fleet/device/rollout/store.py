"""The device's rollouts, persisted: `<state_dir>/rollouts.db` (SQLite, WAL, sqlite-utils
migrations, synchronous=FULL).

    RECEIVED → DOWNLOADING → VERIFYING → STAGED → ACTIVATING → GATING → ACTIVE
                                                                      ↘ ROLLED_BACK
    any state before ACTIVATING → FAILED (retried: → RECEIVED) | REJECTED | CANCELLED

- `rollouts`: one row per rollout — id (the controller's), name, version, state, the
  release's signed facts once looked up, target and previous digest, attempts and
  failures, the reason of the last transition with its figures, seconds spent per state,
  the gate's report. `live` is 1 while the rollout still owns its name (every state but
  the final ones; a FAILED one waiting for its retry too): a partial unique index on
  (name) WHERE live = 1 makes a second rollout of a name impossible, even across a race.
  `restored` is 0 on a ROLLED_BACK row whose switch back is still to be done: the row is
  committed first, the pointer moved after, and `resume` finishes what a crash cut.
- `transitions`: every transition, in commit order, with its reason and details.

Every transition is committed (fsync) before the caller acts on it, so after a kill -9
the row says what may have been started, never less. The states and their graph are the
protocol's (`protocol.rollout_states`); this module stores and checks them; it never acts on
models, and never publishes (the runner does both).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.fleet.device.durable import DurableStore
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVE,
    CANCELLED,
    FAILED,
    NEXT,
    RECEIVED,
    REJECTED,
    ROLLED_BACK,
)
from edge_agent.names import ModelName

MIGRATIONS = Migrations("edge-agent-rollouts")


@MIGRATIONS()
def m001_rollouts(db: Database) -> None:
    db.execute("""CREATE TABLE rollouts (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, version TEXT NOT NULL,
        state TEXT NOT NULL, live INTEGER NOT NULL, restored INTEGER NOT NULL DEFAULT 1,
        attempts INTEGER NOT NULL DEFAULT 1, failures INTEGER NOT NULL DEFAULT 0,
        reason TEXT, details TEXT, release TEXT, target_digest TEXT, previous_digest TEXT,
        gate TEXT, timings TEXT NOT NULL DEFAULT '{}', entered_at REAL NOT NULL,
        staged_at REAL, retry_at REAL, command_id TEXT,
        created_at REAL NOT NULL, updated_at REAL NOT NULL)""")
    db.execute("CREATE UNIQUE INDEX rollouts_one_live_per_name ON rollouts (name) "
               "WHERE live = 1")
    db.execute("CREATE INDEX rollouts_name ON rollouts (name, created_at)")
    db.execute("""CREATE TABLE transitions (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT NOT NULL,
        at REAL NOT NULL, from_state TEXT, to_state TEXT NOT NULL, reason TEXT,
        details TEXT)""")
    db.execute("CREATE INDEX transitions_rollout ON transitions (rollout_id, seq)")


@MIGRATIONS()
def m002_capacity(db: Database) -> None:
    """A capacity release (`rollout.capacity`): the settings it changes, and what the
    overlay held for them before (NULL: a model release)."""
    db.execute("ALTER TABLE rollouts ADD COLUMN config TEXT")


class IllegalTransition(RuntimeError):
    """A transition the graph does not allow from the row's state now (another thread
    moved it first: a cancel, a rollback)."""


class NameBusy(RuntimeError):
    """A rollout of this name is already live."""

    def __init__(self, live: Rollout) -> None:
        super().__init__(f"rollout {live.id} of {live.name} is {live.state}")
        self.live = live


@dataclass(frozen=True)
class Rollout:
    id: str
    name: ModelName  # parsed when the rollout was created
    version: str
    state: str
    live: bool
    restored: bool
    attempts: int
    failures: int
    reason: str | None
    details: dict[str, Any]
    release: dict[str, Any] | None
    target_digest: str | None
    previous_digest: str | None
    gate: dict[str, Any] | None
    timings: dict[str, float]
    entered_at: float
    staged_at: float | None
    retry_at: float | None
    command_id: str | None
    created_at: float
    updated_at: float
    # A capacity release: {"change": {key: value}} from its command, and once it switched,
    # "overlay_before" (what the overlay held for those keys) and "before"/"after" (the
    # effective settings of the name). None: a model release.
    config: dict[str, Any] | None = None

    @property
    def final(self) -> bool:
        return not self.live

    @property
    def capacity(self) -> dict[str, Any] | None:
        """The settings a capacity release changes (None: a model release)."""
        return dict(self.config["change"]) if self.config and "change" in self.config \
            else None

    def summary(self) -> dict[str, Any]:
        """What a command result and an audit message carry about the rollout."""
        return {"rollout_id": self.id, "name": self.name, "version": self.version,
                "state": self.state, "attempts": self.attempts, "failures": self.failures,
                "reason": self.reason, "target_digest": self.target_digest,
                "previous_digest": self.previous_digest,
                "timings": {k: round(v, 3) for k, v in self.timings.items()},
                **({"config": self.capacity} if self.capacity is not None else {})}


@dataclass(frozen=True)
class Transition:
    seq: int
    rollout_id: str
    at: float
    from_state: str | None
    to_state: str
    reason: str | None
    details: dict[str, Any] = field(default_factory=dict)


_COLUMNS = ("id", "name", "version", "state", "live", "restored", "attempts", "failures",
            "reason", "details", "release", "target_digest", "previous_digest", "gate",
            "timings", "entered_at", "staged_at", "retry_at", "command_id", "created_at",
            "updated_at", "config")
_JSON = frozenset({"details", "release", "gate", "timings", "config"})
_SETTABLE = frozenset({"release", "target_digest", "previous_digest", "gate", "staged_at",
                       "retry_at", "restored", "attempts", "failures", "config"})


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, allow_nan=False, sort_keys=True)


def _row(values: tuple[Any, ...]) -> Rollout:
    d = dict(zip(_COLUMNS, values, strict=True))
    for key in _JSON:
        d[key] = json.loads(d[key]) if d[key] is not None else None
    d["details"] = d["details"] or {}
    d["timings"] = d["timings"] or {}
    d["live"], d["restored"] = bool(d["live"]), bool(d["restored"])
    d["name"] = ModelName(d["name"])
    return Rollout(**d)


class RolloutStore(DurableStore):
    """Thread-safe: one connection, used under the instance lock (the link's command
    thread creates and cancels, the runner moves rows along)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(path, MIGRATIONS, clock=clock)

    # -- reading ---------------------------------------------------------------------------
    def get(self, rollout_id: str) -> Rollout | None:
        with self._lock:
            return self._get(rollout_id)

    def live_for(self, name: str) -> Rollout | None:
        return self._one("name = ? AND live = 1", [name])

    def latest_for(self, name: str, state: str | None = None) -> Rollout | None:
        if state is None:
            return self._one("name = ? ORDER BY created_at DESC, rowid DESC", [name])
        return self._one("name = ? AND state = ? ORDER BY updated_at DESC, rowid DESC",
                         [name, state])

    def for_name(self, name: str) -> list[Rollout]:
        return self._many("name = ? ORDER BY created_at DESC, rowid DESC", [name])

    def release_digest(self, name: str, version: str) -> str | None:
        """The digest the signed release `name@version` names, as the latest rollout of it
        here recorded it once it looked the release up (None: none did)."""
        with self._lock:
            row = self._db.conn.execute(
                "SELECT target_digest FROM rollouts WHERE name = ? AND version = ? AND "
                "target_digest IS NOT NULL ORDER BY created_at DESC, rowid DESC LIMIT 1",
                [name, version]).fetchone()
        return str(row[0]) if row else None

    def unfinished(self) -> list[Rollout]:
        """Rollouts `resume` must look at: the live ones, and ROLLED_BACK ones whose
        switch back was committed but maybe not done."""
        return self._many("live = 1 OR (state = ? AND restored = 0) ORDER BY created_at, "
                          "rowid", [ROLLED_BACK])

    def transitions(self, rollout_id: str) -> list[Transition]:
        with self._lock:
            rows = self._db.conn.execute(
                "SELECT seq, rollout_id, at, from_state, to_state, reason, details "
                "FROM transitions WHERE rollout_id = ? ORDER BY seq", [rollout_id]).fetchall()
        return [Transition(r[0], r[1], r[2], r[3], r[4], r[5],
                           json.loads(r[6]) if r[6] else {}) for r in rows]

    # -- writing ---------------------------------------------------------------------------
    def create(self, rollout_id: str, name: str, version: str, *,
               command_id: str | None = None, config: Mapping[str, Any] | None = None
               ) -> tuple[Rollout, bool]:
        """A new rollout in RECEIVED, committed; `(row, True)`. The same id again gives
        `(its row, False)` unchanged (a redelivered command). NameBusy when another
        rollout of `name` is live."""
        now = self._clock()
        with self._lock:
            existing = self._get(rollout_id)
            if existing is not None:
                return existing, False
            try:
                with self._db.atomic():
                    self._db.conn.execute(
                        "INSERT INTO rollouts (id, name, version, state, live, entered_at, "
                        "command_id, created_at, updated_at, config) "
                        "VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, ?)",
                        [rollout_id, name, version, RECEIVED, now, command_id, now, now,
                         _dump({"change": dict(config)}) if config else None])
                    self._log(rollout_id, now, None, RECEIVED, None, {})
            except sqlite3.IntegrityError:
                live = self._first("name = ? AND live = 1", [name])
                if live is None:  # not the name: the id raced in (cannot happen here)
                    raise
                raise NameBusy(live) from None
            row = self._get(rollout_id)
        assert row is not None
        return row, True

    def transition(self, rollout_id: str, to: str, *, reason: str | None = None,
                   details: Mapping[str, Any] | None = None, expect: str | None = None,
                   live: bool | None = None, **fields: Any) -> Rollout:
        """Moves the rollout to `to` and commits, with the time spent in the state it
        leaves added to its timings. IllegalTransition when the graph does not allow it
        from the current state, or the state is not `expect`. `live` defaults to: still
        live unless `to` is a final state (FAILED is final only when `live=False`)."""
        if to not in NEXT:
            raise ValueError(f"unknown state {to!r}")
        bad = set(fields) - _SETTABLE
        if bad:
            raise ValueError(f"not settable: {sorted(bad)}")
        now = self._clock()
        with self._lock:
            row = self._get(rollout_id)
            if row is None:
                raise KeyError(rollout_id)
            if expect is not None and row.state != expect:
                raise IllegalTransition(f"{rollout_id} is {row.state}, not {expect}")
            if to not in NEXT[row.state]:
                raise IllegalTransition(f"{rollout_id}: {row.state} -> {to} is not allowed")
            if live is None:
                live = to not in (ACTIVE, ROLLED_BACK, REJECTED, CANCELLED, FAILED) or (
                    to == FAILED and fields.get("retry_at") is not None)
            timings = dict(row.timings)
            timings[row.state] = timings.get(row.state, 0.0) + max(0.0, now - row.entered_at)
            values = {**fields, "state": to, "live": int(live), "reason": reason,
                      "details": _dump(dict(details or {})), "timings": _dump(timings),
                      "entered_at": now, "updated_at": now}
            for key in ("release", "gate", "config"):
                if key in values:
                    values[key] = _dump(values[key])
            if "restored" in values:
                values["restored"] = int(values["restored"])
            sets = ", ".join(f"{k} = ?" for k in values)
            with self._db.atomic():
                self._db.conn.execute(f"UPDATE rollouts SET {sets} WHERE id = ?",
                                      [*values.values(), rollout_id])
                self._log(rollout_id, now, row.state, to, reason, details or {})
            new = self._get(rollout_id)
        assert new is not None
        return new

    def update(self, rollout_id: str, **fields: Any) -> Rollout:
        """Fields that are no transition (the release facts, a digest, `restored`)."""
        bad = set(fields) - _SETTABLE
        if bad or not fields:
            raise ValueError(f"not settable: {sorted(bad) or 'nothing'}")
        values = dict(fields)
        for key in ("release", "gate", "config"):
            if key in values:
                values[key] = _dump(values[key])
        if "restored" in values:
            values["restored"] = int(values["restored"])
        values["updated_at"] = self._clock()
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._lock:
            with self._db.atomic():
                self._db.conn.execute(f"UPDATE rollouts SET {sets} WHERE id = ?",
                                      [*values.values(), rollout_id])
            row = self._get(rollout_id)
        if row is None:
            raise KeyError(rollout_id)
        return row

    # -- internals (under the lock) -------------------------------------------------------
    def _log(self, rollout_id: str, at: float, from_state: str | None, to: str,
             reason: str | None, details: Mapping[str, Any]) -> None:
        self._db.conn.execute(
            "INSERT INTO transitions (rollout_id, at, from_state, to_state, reason, details) "
            "VALUES (?, ?, ?, ?, ?, ?)", [rollout_id, at, from_state, to, reason,
                                          _dump(dict(details))])

    def _get(self, rollout_id: str) -> Rollout | None:
        return self._first("id = ?", [rollout_id])

    def _first(self, where: str, args: list[Any]) -> Rollout | None:
        row = self._db.conn.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM rollouts WHERE {where} LIMIT 1",
            args).fetchone()
        return _row(row) if row else None

    def _one(self, where: str, args: list[Any]) -> Rollout | None:
        with self._lock:
            return self._first(where, args)

    def _many(self, where: str, args: list[Any]) -> list[Rollout]:
        with self._lock:
            rows = self._db.conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM rollouts WHERE {where}", args).fetchall()
        return [_row(r) for r in rows]
