"""The controller store's rollouts, in the SQL SQLite and PostgreSQL share: `RolloutQueries`,
which `sql.SQLStore` holds (its tables are listed in `schema`; its records are
`rollout_records`).

    rollouts          one row per `fleet rollout start`: release, selector, policy, state
                      (RUNNING|PAUSED|ABORTED|COMPLETED|ROLLED_BACK), the wave reached,
                      `live` (1 while RUNNING or PAUSED: a partial unique index allows one
                      per model name) and `settled` (0 while the engine has work)
    rollout_devices   one row per selected device: its wave, its state as last reported
                      (PENDING and SENT before the box says anything, REFUSED when it
                      refused rollout.start), when rollout.start was published, when it
                      went ACTIVE, when it finished, the controller's own outcome
                      (timed_out, skipped), the last reason, and its latest download
                      progress (bytes, total, rate, ETA, the box's time; newest wins)
    rollout_commands  the rollout.start/cancel/rollback commands recorded for a rollout,
                      and when the broker took each (unpublished ones are published again,
                      but a start the rollout stopped before it left is withdrawn)

The devices' reports reach `rollout_devices` inside the ingest's own transaction
(`rollout_message`, `rollout_result`): a rollout audit message or a refused rollout.start result is
applied exactly once, when it is stored, and only if it is newer (device time) than what
the row shows; a `rollout.progress` message likewise, to the progress columns only.
Nothing here decides anything (that is `waves`) or publishes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from edge_agent.errors import NotFound
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.rollout_records import (
    DeviceRecord,
    DownloadProgress,
    NewRollout,
    RolloutConflict,
    RolloutRecord,
    rollout_from_row,
)
from edge_agent.fleet.controller.transaction import Exec
from edge_agent.fleet.controller.waves import LIVE, PENDING, REFUSED, SENT
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVE,
    FAILED,
    REJECTED,
    ROLLED_BACK,
    STATES,
    describe,
)

_ROLLOUT_COLUMNS = ("id, name, version, selector, waves, abort_above, min_executed, soak_s, "
                    "device_timeout_s, rollback_on_abort, state, live, settled, wave, "
                    "waves_total, devices_total, reason, wave_started_at, created_at, "
                    "updated_at, config")
_DEVICE_COLUMNS = ("device, fleet, wave, state, retrying, reason, command_id, started_at, "
                   "active_at, finished_at, outcome, reported_ts, updated_at, progress_bytes, "
                   "progress_total, progress_rate_bps, progress_eta_s, progress_ts")
_KNOWN_STATES = frozenset(STATES) | {REFUSED}
_FINAL = frozenset({ACTIVE, ROLLED_BACK, REJECTED, REFUSED, "CANCELLED"})


def _retrying(state: str, body: Mapping[str, Any]) -> bool:
    """A FAILED box still retries while its failures are under its limit (both are in
    the transition's details); a box that refused as busy is asked again (`waves`)."""
    if state == REFUSED:
        return body.get("refused") == "busy"
    details = body.get("details")
    if state != FAILED or not isinstance(details, dict):
        return False
    failures, limit = details.get("failures"), details.get("limit")
    return isinstance(failures, int) and isinstance(limit, int) and failures < limit


# A device whose box refused rollout.start as busy, not yet timed out or skipped.
_BUSY = f"state = '{REFUSED}' AND retrying = 1 AND outcome IS NULL"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _device_ts(msg: Inbound) -> float:
    """When the box says it sent the report (its `ts`), else the envelope's time."""
    ts: Any = msg.body.get("ts")
    return float(ts) if _number(ts) else msg.ts


def _progress_figures(body: Mapping[str, Any]) -> tuple[int, int, float, float | None]:
    """(bytes, total, rate_bps, eta_s) of a `rollout.progress` body; ValueError if bad."""
    values: list[Any] = [body.get(k) for k in ("bytes", "total", "rate_bps", "eta_s")]
    done, total, rate, eta = values
    if not (_count(done) and _count(total) and done <= total and _number(rate) and rate >= 0
            and (eta is None or (_number(eta) and eta >= 0))):
        raise ValueError("rollout.progress needs bytes <= total, rate_bps and eta_s >= 0")
    return done, total, float(rate), None if eta is None else float(eta)


def _short(value: Any, limit: int = 500) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text.replace("\x00", "\ufffd")[:limit]


Tx = Callable[[], AbstractContextManager["Exec"]]


class RolloutQueries:
    """Rollout rows, each call in a transaction of the store that holds this object
    (`sql.SQLStore.rollouts`): `tx` opens a write, `read` a read; `insert_command` is
    the store's own (the commands table is its)."""

    def __init__(self, tx: Tx, read: Tx,
                 insert_command: Callable[[Exec, Mapping[str, Any], float], None]) -> None:
        self._tx = tx
        self._read = read
        self._insert_command = insert_command

    # -- the operator's side --------------------------------------------------------------
    def create_rollout(self, new: NewRollout, now: float) -> RolloutRecord:
        """RUNNING, every device PENDING. RolloutConflict while another rollout of the name
        is live (or the id exists)."""
        p = new.policy
        waves_total = max((w for _, w in new.devices.values()), default=0)
        try:
            with self._tx() as db:
                self._refuse_taken(db, new.id, new.name)
                db.run(f"INSERT INTO rollouts ({_ROLLOUT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, "
                       "?, ?, ?, ?, 'RUNNING', 1, 0, 0, ?, ?, NULL, NULL, ?, ?, ?)",
                       [new.id, new.name, new.version, new.selector,
                        ",".join(str(s) for s in p.steps), p.abort_above, p.min_executed,
                        p.soak_s, p.device_timeout_s, int(p.rollback_on_abort), waves_total,
                        len(new.devices), now, now,
                        json.dumps(dict(new.config)) if new.config else None])
                db.many("INSERT INTO rollout_devices (rollout_id, device, fleet, wave, state, "
                        "updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                        [(new.id, device, fleet, wave, PENDING, now)
                         for device, (fleet, wave) in sorted(new.devices.items())])
        except RolloutConflict:
            raise
        except Exception:
            # Two starts at once on PostgreSQL: the partial unique index refused the second.
            with self._read() as db:
                self._refuse_taken(db, new.id, new.name)
            raise
        found = self.rollout(new.id)
        assert found is not None
        return found

    @staticmethod
    def _refuse_taken(db: Exec, rollout_id: str, name: str) -> None:
        if db.rows("SELECT 1 FROM rollouts WHERE id = ?", [rollout_id]):
            raise RolloutConflict(f"a rollout {rollout_id} exists already")
        live = db.rows("SELECT id, version, state FROM rollouts WHERE name = ? AND live = 1",
                       [name])
        if live:
            rid, version, state = live[0]
            raise RolloutConflict(f"rollout {rid} of {name}@{version} is {state}: one live "
                                  f"rollout per model name (abort it first)")

    def set_rollout_state(self, rollout_id: str, to: str, allowed: frozenset[str], *,
                          reason: str, now: float) -> RolloutRecord:
        """The operator's pause/resume/abort/rollback: `to` from one of `allowed`;
        RolloutConflict otherwise. The running engine acts on it at its next tick."""
        marks = ", ".join("?" for _ in allowed)
        with self._tx() as db:
            # Conditional on the state in the UPDATE itself: on PostgreSQL the engine may
            # commit a decision between a SELECT and this statement.
            if not db.run(f"UPDATE rollouts SET state = ?, live = ?, settled = 0, reason = ?, "
                          f"updated_at = ? WHERE id = ? AND state IN ({marks})",
                          [to, int(to in LIVE), reason, now, rollout_id, *sorted(allowed)]):
                rows = db.rows("SELECT state FROM rollouts WHERE id = ?", [rollout_id])
                if not rows:
                    raise NotFound(f"no rollout {rollout_id}")
                raise RolloutConflict(f"rollout {rollout_id} is {rows[0][0]}: cannot go "
                                      f"{to} (from {', '.join(sorted(allowed))} only)")
        found = self.rollout(rollout_id)
        assert found is not None
        return found

    # -- reading --------------------------------------------------------------------------
    def rollout(self, rollout_id: str) -> RolloutRecord | None:
        with self._read() as db:
            rows = db.rows(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE id = ?",
                           [rollout_id])
        return rollout_from_row(rows[0]) if rows else None

    def rollouts(self, *, unsettled: bool = False, limit: int = 100,
                 name: str | None = None) -> list[RolloutRecord]:
        """Newest first; `unsettled`: only those the engine still drives; `name`: only
        that model's."""
        where, params = [], []
        if unsettled:
            where.append("settled = 0")
        if name is not None:
            where.append("name = ?")
            params.append(name)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        with self._read() as db:
            rows = db.rows(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts {clause}"
                           "ORDER BY created_at DESC, id LIMIT ?", [*params, int(limit)])
        return [rollout_from_row(r) for r in rows]

    def rollout_devices(self, rollout_id: str) -> list[DeviceRecord]:
        with self._read() as db:
            rows = db.rows(f"SELECT {_DEVICE_COLUMNS} FROM rollout_devices WHERE rollout_id = ? "
                           "ORDER BY wave, device", [rollout_id])
            sent = db.rows("SELECT device, type FROM rollout_commands WHERE rollout_id = ?",
                           [rollout_id])
        kinds: dict[str, set[str]] = {}
        for device, type_ in sent:
            kinds.setdefault(device, set()).add(type_)
        out = []
        for r in rows:
            mine = kinds.get(r[0], set())
            progress = None if r[17] is None else DownloadProgress(
                int(r[13]), int(r[14]), float(r[15]), r[16], float(r[17]))
            out.append(DeviceRecord(r[0], r[1], int(r[2]), r[3], bool(r[4]), r[5], r[6],
                                    r[7], r[8], r[9], r[10], r[11], r[12],
                                    "rollout.cancel" in mine, "rollout.rollback" in mine,
                                    progress))
        return out

    # -- the engine's side ------------------------------------------------------------------
    def apply_plan(self, rollout_id: str, *, expect: str, state: str, wave: int,
                   reason: str | None, settled: bool, timed_out: Sequence[str],
                   skipped: Sequence[str], now: float) -> bool:
        """The engine's decision, only if the rollout is still in `expect` (an operator's
        command in between wins; the engine decides again at its next tick)."""
        with self._tx() as db:
            # The state condition is in the UPDATE (a row lock on PostgreSQL), not only in
            # a SELECT before it: an operator's command committed in between wins.
            if not db.run("UPDATE rollouts SET state = ?, live = ?, settled = ?, "
                          "reason = COALESCE(?, reason), updated_at = ?, "
                          "wave_started_at = CASE WHEN wave <> ? THEN ? "
                          "ELSE wave_started_at END, wave = ? WHERE id = ? AND state = ?",
                          [state, int(state in LIVE), int(settled), reason, now, wave, now,
                           wave, rollout_id, expect]):
                return False
            for outcome, devices, why in (("timed_out", timed_out, "no final state in time"),
                                          ("skipped", skipped, "rollout stopped first")):
                db.many("UPDATE rollout_devices SET outcome = ?, reason = COALESCE(reason, ?), "
                        "finished_at = COALESCE(finished_at, ?), updated_at = ? "
                        "WHERE rollout_id = ? AND device = ? AND outcome IS NULL",
                        [(outcome, why, now, now, rollout_id, d) for d in devices])
            db.many("UPDATE rollout_commands SET withdrawn_at = ? WHERE rollout_id = ? AND "
                    "device = ? AND type = 'rollout.start' AND published_at IS NULL",
                    [(now, rollout_id, d) for d in skipped])
            return True

    def next_command_seqs(self, streams: Sequence[str]) -> dict[str, int]:
        """The next seq of each command stream, taken in one transaction."""
        out: dict[str, int] = {}
        with self._tx() as db:
            for stream in streams:
                out[stream] = int(db.rows(
                    "INSERT INTO command_streams (stream, last_seq) VALUES (?, 1) ON CONFLICT "
                    "(stream) DO UPDATE SET last_seq = command_streams.last_seq + 1 "
                    "RETURNING last_seq", [stream])[0][0])
        return out

    def claim_commands(self, rollout_id: str, commands: Mapping[str, Mapping[str, Any]],
                       now: float, *, require_state: str | None = None,
                       retry: bool = False) -> list[str]:
        """Record signed rollout commands (one per device, all of one type) before they
        are published; returns the devices whose command was recorded. A rollout.start
        is recorded only for a device not yet commanded (with `retry`: only for one whose
        box refused it as busy, and not yet timed out), and only while the rollout is in
        `require_state`; a cancel or rollback at most once per device."""
        claimed: list[str] = []
        with self._tx() as db:
            # A no-op UPDATE rather than a SELECT: it holds the row (PostgreSQL) until the
            # commit, so a pause cannot slip in between the check and the claims.
            if require_state is not None and not db.run(
                    "UPDATE rollouts SET updated_at = updated_at WHERE id = ? AND state = ?",
                    [rollout_id, require_state]):
                return []
            for device, command in commands.items():
                type_ = str(command["type"])
                if type_ == "rollout.start":
                    unsent = _BUSY if retry else "command_id IS NULL"
                    if not db.run("UPDATE rollout_devices SET command_id = ?, state = ?, "
                                  "retrying = 0, updated_at = ? WHERE rollout_id = ? AND "
                                  f"device = ? AND {unsent}",
                                  [command["id"], SENT, now, rollout_id, device]):
                        continue
                elif db.rows("SELECT 1 FROM rollout_commands WHERE rollout_id = ? AND "
                             "device = ? AND type = ?", [rollout_id, device, type_]):
                    continue
                self._insert_command(db, command, now)
                db.run("INSERT INTO rollout_commands (command_id, rollout_id, device, type, "
                       "recorded) VALUES (?, ?, ?, ?, ?)",
                       [command["id"], rollout_id, device, type_, now])
                claimed.append(device)
        return claimed

    def unpublished_commands(self, rollout_id: str) -> list[dict[str, Any]]:
        """Commands recorded for the rollout that the broker has not taken yet, in order."""
        with self._read() as db:
            rows = db.rows("SELECT c.body FROM rollout_commands r JOIN commands c "
                           "ON c.id = r.command_id WHERE r.rollout_id = ? AND "
                           "r.published_at IS NULL AND r.withdrawn_at IS NULL "
                           "ORDER BY r.recorded, c.seq", [rollout_id])
        return [json.loads(r[0]) for r in rows]

    def mark_published(self, command_ids: Sequence[str], now: float) -> None:
        """The broker took these: a rollout.start's device timeout counts from now."""
        with self._tx() as db:
            db.many("UPDATE rollout_commands SET published_at = ? WHERE command_id = ?",
                    [(now, cid) for cid in command_ids])
            db.many("UPDATE rollout_devices SET started_at = COALESCE(started_at, ?) "
                    "WHERE command_id = ?", [(now, cid) for cid in command_ids])

    # -- the ingest's side (inside its transaction) ------------------------------------------
    @staticmethod
    def rollout_message(db: Exec, msg: Inbound) -> None:
        """A box's rollout audit message: its state for that rollout, or its download
        progress, each if newer than what the row holds."""
        body = msg.body
        rollout_id, event = body.get("rollout_id"), body.get("event")
        if not isinstance(rollout_id, str):
            return
        if event == "rollout.progress":
            done, total, rate, eta = _progress_figures(body)
            ts = _device_ts(msg)
            db.run("UPDATE rollout_devices SET progress_bytes = ?, progress_total = ?, "
                   "progress_rate_bps = ?, progress_eta_s = ?, progress_ts = ? "
                   "WHERE rollout_id = ? AND device = ? "
                   "AND (progress_ts IS NULL OR progress_ts <= ?)",
                   [done, total, rate, eta, ts, rollout_id, msg.device, ts])
            return
        reason = body.get("reason")
        if event == "rollout.transition":
            state = body.get("to")
        elif event in ("rollout.resumed", "rollout.held"):
            state = body.get("state")
            reason = body.get("held_by") or reason
        elif event == "rollout.refused":
            state = REFUSED
            live = body.get("live") if isinstance(body.get("live"), dict) else {}
            reason = f"refused: {body.get('refused')}" + (
                f" ({describe(live)} on the box)" if live else "")
        else:
            return  # evidence: shown elsewhere
        if state not in _KNOWN_STATES:
            raise ValueError(f"unknown rollout state {state!r}")
        ts = _device_ts(msg)
        retrying = _retrying(str(state), body)
        final = (state in _FINAL or state == FAILED) and not retrying
        db.run("UPDATE rollout_devices SET state = ?, retrying = ?, reason = ?, "
               "reported_ts = ?, updated_at = ?, active_at = COALESCE(active_at, ?), "
               "finished_at = COALESCE(finished_at, ?) WHERE rollout_id = ? AND device = ? "
               "AND (reported_ts IS NULL OR reported_ts <= ?)",
               [state, int(retrying), _short(reason), ts, msg.received,
                msg.received if state == ACTIVE else None, msg.received if final else None,
                rollout_id, msg.device, ts])

    @staticmethod
    def rollout_result(db: Exec, device: str, body: Mapping[str, Any], msg_ts: float,
                        received: float) -> None:
        """A rollout.start the box refused (a bad signature, an expired or replayed
        command, a busy name): REFUSED, unless the box reported something since."""
        if body.get("type") != "rollout.start":
            return
        result = body.get("result")
        refused = isinstance(result, dict) and result.get("accepted") is False
        if body.get("status") == "ok" and not refused:
            return
        why = body.get("reason") or (result.get("refused") if isinstance(result, dict)
                                     else None)
        busy = body.get("status") == "ok" and why == "busy"
        db.run("UPDATE rollout_devices SET state = ?, retrying = ?, reason = ?, "
               "reported_ts = ?, finished_at = CASE WHEN ? = 1 THEN finished_at ELSE "
               "COALESCE(finished_at, ?) END, updated_at = ? WHERE command_id = ? "
               "AND device = ? AND state = ?",
               [REFUSED, int(busy), _short(f"{body.get('status')}: {why}"), msg_ts,
                int(busy), received, received, body.get("id"), device, SENT])
