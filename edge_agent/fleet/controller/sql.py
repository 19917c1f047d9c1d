"""The controller store's behaviour, written once in the SQL that SQLite and PostgreSQL
share: schema steps, ingest with dedupe, birth/death with the bdseq rule, gaps, commands.

`SQLStore` owns the queries; a subclass (`store.SQLiteStore`, `store.PostgresStore`) owns
only its connection: how a transaction starts and ends, and how `?` placeholders reach the
driver. Nothing here may commit outside `_tx`, and nothing here speaks MQTT: `ingest`
returns the acks, the caller publishes them after this function has committed.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from functools import cached_property
from typing import Any

from edge_agent.fleet.controller.audit import AuditQueries
from edge_agent.fleet.controller.inbound import Acks, Inbound
from edge_agent.fleet.controller.operators import OperatorQueries
from edge_agent.fleet.controller.retention import RetentionQueries
from edge_agent.fleet.controller.review import ReviewQueries
from edge_agent.fleet.controller.rollout_queries import RolloutQueries
from edge_agent.fleet.controller.slo import MinuteSums, SLOQueries
from edge_agent.fleet.controller.transaction import Exec
from edge_agent.fleet.protocol.envelope import (
    Ranges,
    check_ranges,
    complement,
    merge_ranges,
    to_ranges,
)
from edge_agent.fleet.protocol.ids import COMMAND_ID

log = logging.getLogger(__name__)


_DEVICE_COLUMNS = ("device, fleet, online, bdseq, boot_id, birth, first_seen, last_seen, "
                   "last_birth, last_death, models")
# What a device row reads as: its columns and whether an admin retired it.
_DEVICE_READ = f"{_DEVICE_COLUMNS}, retired, retired_by"
# The models column takes a newer report only (births and events travel apart: a birth
# on the status topic, a models.state in the outbox, which may deliver it late).
_NEWER_MODELS = ("models = CASE WHEN devices.models_ts IS NULL OR excluded.models_ts >= "
                 "devices.models_ts THEN excluded.models ELSE devices.models END, "
                 "models_ts = CASE WHEN devices.models_ts IS NULL OR excluded.models_ts >= "
                 "devices.models_ts THEN excluded.models_ts ELSE devices.models_ts END")
# last_seen only moves forward (GREATEST is PostgreSQL's, max() SQLite's: CASE is both's).
_LATER = "CASE WHEN excluded.last_seen > devices.last_seen THEN excluded.last_seen " \
         "ELSE devices.last_seen END"


def _dumps(value: Any) -> str:
    """Compact JSON; control characters (NUL included, which PostgreSQL text refuses)
    come out escaped."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _text(value: Any, limit: int = 1000) -> str | None:
    """A device's free-text field as a column value: a string without NUL, or the JSON of
    anything else; bounded."""
    if value is None:
        return None
    text = value if isinstance(value, str) else _dumps(value)
    return text.replace("\x00", "\ufffd")[:limit]


class SQLStore:
    """The store's behaviour over `_tx()` (a write transaction) and `_read()`, which a
    subclass gives (its connection): the devices, their messages and commands here, and
    six narrow query objects that callers reach directly — the rollouts' (`rollouts`), the
    service levels over time and the apps' verdicts on answers (`slo`), the periodic
    review's baselines and verify answers (`review`), the
    purge's (`retention`), the operators' tokens (`operators`) and the audit trail
    (`audit`), each its own module's, in this store's transactions."""

    @cached_property
    def rollouts(self) -> RolloutQueries:
        return RolloutQueries(self._tx, self._read, self._insert_command)

    @cached_property
    def slo(self) -> SLOQueries:
        return SLOQueries(self._tx, self._read)

    @cached_property
    def review(self) -> ReviewQueries:
        return ReviewQueries(self._tx, self._read)

    @cached_property
    def retention(self) -> RetentionQueries:
        return RetentionQueries(self._tx, self._read)

    @cached_property
    def operators(self) -> OperatorQueries:
        return OperatorQueries(self._tx, self._read)

    @cached_property
    def audit(self) -> AuditQueries:
        return AuditQueries(self._tx, self._read)

    def _tx(self) -> AbstractContextManager[Exec]:
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Exec]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- ingest -------------------------------------------------------------------------

    def ingest(self, batch: Sequence[Inbound]) -> Acks:
        """Store each message once (dedupe on device, boot_id, seq) in ONE transaction; the
        acks cover every message of the batch, duplicates included, and are valid only
        once this returns (it has committed)."""
        acks = Acks()
        if not batch:
            return acks
        # Rows are locked in one order, the boxes': two controllers each taking part of
        # the same boxes' messages (a shared subscription) then wait on each other, never
        # in a circle.
        batch = sorted(batch, key=lambda m: (m.device, m.boot_id, m.seq))
        groups: dict[tuple[str, str], list[Inbound]] = defaultdict(list)
        for msg in batch:
            groups[(msg.device, msg.boot_id)].append(msg)
        for (device, boot_id), msgs in groups.items():
            acks.ranges.setdefault(device, {})[boot_id] = to_ranges(m.seq for m in msgs)
        with self._tx() as db:
            # The insert is the dedupe: a row already there (or earlier in this batch, or
            # written by another controller on the same PostgreSQL) conflicts, and is not new.
            new = db.inserted(
                "INSERT INTO messages (device, boot_id, seq, fleet, kind, class, ts, received, "
                "body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING seq",
                [(m.device, m.boot_id, m.seq, m.fleet, m.kind, m.cls, m.ts, m.received,
                  _dumps(m.body)) for m in batch])
            dups: dict[tuple[str, str], int] = defaultdict(int)
            minutes = MinuteSums()
            for msg, fresh in zip(batch, new, strict=True):
                if not fresh:
                    acks.duplicates += 1
                    dups[(msg.device, msg.boot_id)] += 1
                    continue
                acks.stored += 1
                acks.stored_by_kind[msg.kind] = acks.stored_by_kind.get(msg.kind, 0) + 1
                self._side_effects(db, msg, minutes)
            SLOQueries.write_minutes(db, minutes)
            if dups:
                db.many("INSERT INTO duplicates (device, boot_id, count) VALUES (?, ?, ?) "
                        "ON CONFLICT (device, boot_id) DO UPDATE SET "
                        "count = duplicates.count + excluded.count",
                        [(d, b, n) for (d, b), n in dups.items()])
            last: dict[str, Inbound] = {}
            for msg in batch:
                if msg.device not in last or msg.received > last[msg.device].received:
                    last[msg.device] = msg
            db.many(f"INSERT INTO devices (device, fleet, online, first_seen, last_seen) "
                    f"VALUES (?, ?, 0, ?, ?) ON CONFLICT (device) DO UPDATE SET "
                    f"last_seen = {_LATER}",
                    [(m.device, m.fleet, m.received, m.received) for m in last.values()])
        return acks

    def _side_effects(self, db: Exec, msg: Inbound, minutes: MinuteSums) -> None:
        """What a new message means beyond itself: a dropped-metrics report, a command's
        result, a rollout's report (`rollout_queries`). Bad shapes are logged, never fatal:
        the message itself is stored."""
        body = msg.body
        try:
            if msg.kind == "events" and body.get("event") == "outbox.dropped":
                ranges = body.get("ranges")
                if not isinstance(ranges, dict):
                    raise ValueError("ranges must be an object")
                self._insert_dropped(db, msg.device, ranges, msg.received)
            elif msg.kind == "events" and body.get("event") == "models.state":
                self._models_state(db, msg)
            elif msg.kind == "cmd/result":
                self._insert_result(db, msg.device, body, msg.received)
                RolloutQueries.rollout_result(db, msg.device, body, msg.ts, msg.received)
            elif msg.kind == "rollout":
                RolloutQueries.rollout_message(db, msg)
            elif msg.kind == "metrics":
                SLOQueries.metrics_message(db, msg, minutes)
            elif msg.kind == "events" and body.get("event") == "errors":
                SLOQueries.errors_event(db, msg)
        except (ValueError, TypeError) as exc:
            log.warning("fleet: %s from %s seq %s: %s", msg.kind, msg.device, msg.seq, exc)

    @staticmethod
    def _models_state(db: Exec, msg: Inbound) -> None:
        models = check_models(msg.body.get("models"))
        db.run(f"INSERT INTO devices (device, fleet, online, first_seen, last_seen, models, "
               f"models_ts) VALUES (?, ?, 0, ?, ?, ?, ?) ON CONFLICT (device) DO UPDATE SET "
               f"{_NEWER_MODELS}",
               [msg.device, msg.fleet, msg.received, msg.received, _dumps(models), msg.ts])

    # -- dropped metrics and gaps ---------------------------------------------------------

    def record_dropped(self, device: str, ranges: Mapping[str, Any], reported: float) -> int:
        """Seq ranges a device's outbox dropped (from an `outbox.dropped` event body's
        `ranges`); returns how many ranges were new. ValueError for a bad shape."""
        with self._tx() as db:
            return self._insert_dropped(db, device, ranges, reported)

    @staticmethod
    def _insert_dropped(db: Exec, device: str, ranges: Mapping[str, Any], reported: float) -> int:
        rows = [(device, str(boot_id), first, last, reported)
                for boot_id, value in ranges.items() for first, last in check_ranges(value)]
        new = 0
        for row in rows:
            new += db.run("INSERT INTO dropped (device, boot_id, first_seq, last_seq, reported) "
                          "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", row)
        return new

    def dropped(self, device: str, boot_id: str) -> Ranges:
        with self._read() as db:
            return merge_ranges(db.rows(
                "SELECT first_seq, last_seq FROM dropped WHERE device = ? AND boot_id = ?",
                [device, boot_id]))

    def stored_ranges(self, device: str, boot_id: str) -> Ranges:
        """The seqs stored for (device, boot), as ranges (islands: seq - row_number is
        constant along a run of consecutive seqs)."""
        with self._read() as db:
            return [[a, b] for a, b in db.rows(
                "SELECT MIN(seq), MAX(seq) FROM (SELECT seq, seq - ROW_NUMBER() OVER "
                "(ORDER BY seq) AS island FROM messages WHERE device = ? AND boot_id = ?) AS s "
                "GROUP BY island ORDER BY 1", [device, boot_id])]

    def gaps(self, device: str, boot_id: str) -> Ranges:
        """Seqs of (device, boot) up to the highest known that are neither stored nor
        reported dropped nor removed by retention: what was lost."""
        retired = self.retention.retired(device, boot_id)
        covered = merge_ranges(self.stored_ranges(device, boot_id)
                               + self.dropped(device, boot_id)
                               + ([[1, retired]] if retired else []))
        return complement(covered, covered[-1][1]) if covered else []

    def loss(self, device: str) -> dict[str, Any]:
        """Loss accounting for one device, as an operator reads it: per boot the highest
        seq stored, what is stored, the gaps (neither stored, nor reported dropped, nor
        removed by retention: lost), the dropped and retired ranges and the duplicates
        dropped; and the outbox backlog the box last reported (its latest metrics)."""
        with self._read() as db:
            dups = dict(db.rows("SELECT boot_id, count FROM duplicates WHERE device = ?",
                                [device]))
        boots = []
        for boot in self.boots(device):
            stored, retired = self.stored_ranges(device, boot), self.retention.retired(device, boot)
            gaps = self.gaps(device, boot)
            boots.append({
                "boot_id": boot,
                "highest_seq": max([retired] + [b for _, b in stored]),
                "stored": sum(b - a + 1 for a, b in stored),
                "gaps": gaps, "missing": sum(b - a + 1 for a, b in gaps),
                "dropped": self.dropped(device, boot), "retired_through": retired,
                "duplicates": int(dups.get(boot, 0))})
        latest = self.latest_metrics(device)
        outbox = latest["body"].get("outbox") if latest is not None else None
        return {"device": device, "boots": boots,
                "missing": sum(b["missing"] for b in boots),
                "duplicates": sum(b["duplicates"] for b in boots),
                "outbox": {**outbox, "reported": latest["ts"]}
                if isinstance(outbox, dict) and latest is not None else None}

    def boots(self, device: str) -> list[str]:
        with self._read() as db:
            return [row[0] for row in db.rows(
                "SELECT boot_id FROM messages WHERE device = ? GROUP BY boot_id "
                "ORDER BY MIN(received)", [device])]

    # -- birth and death ----------------------------------------------------------------

    def birth(self, fleet: str, device: str, message: Mapping[str, Any], received: float) -> None:
        """Online, with this session's bdseq and the birth's facts. A birth always wins:
        births of one device arrive in the order it sent them (one topic, one publisher)."""
        try:
            models: str | None = _dumps(check_models(message.get("models")))
        except ValueError:
            models = None  # a birth without a sound list: the models column keeps its own
        ts = message.get("ts")
        models_ts = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) \
            and abs(ts) < 1e11 else received
        with self._tx() as db:
            db.run(f"INSERT INTO devices ({_DEVICE_COLUMNS}, models_ts) VALUES (?, ?, 1, ?, ?, "
                   f"?, ?, ?, ?, NULL, ?, ?) ON CONFLICT (device) DO UPDATE SET "
                   f"fleet = excluded.fleet, online = 1, "
                   f"bdseq = excluded.bdseq, boot_id = excluded.boot_id, birth = excluded.birth, "
                   f"last_birth = excluded.last_birth, last_seen = {_LATER}"
                   + (f", {_NEWER_MODELS}" if models is not None else ""),
                   [device, fleet, int(message["bdseq"]), _text(message.get("boot_id"), 64),
                    _dumps(dict(message)), received, received, received, models,
                    models_ts if models is not None else None])

    def retire(self, device: str, *, by: str | None, now: float) -> bool:
        """A box out of service (`by`: who), or back in it (None): a retired box keeps its
        history and is left out of every rollout. False for a device never seen."""
        with self._tx() as db:
            return db.run("UPDATE devices SET retired = ?, retired_by = ? WHERE device = ?",
                          [None if by is None else now, by, device]) > 0

    def register(self, devices: Sequence[str], *, fleet: str, by: str,
                 now: float) -> list[str]:
        """Boxes expected in `fleet` (`by`: who); returns those not registered before (a
        registration already there is kept as it was, its fleet too)."""
        with self._tx() as db:
            return [device for device in devices if db.run(
                "INSERT INTO device_registrations (device, fleet, registered, registered_by) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (device) DO NOTHING",
                [device, fleet, now, by]) > 0]

    def controller_seen(self, controller: str, *, leader: bool, leader_since: float | None,
                        started: float, now: float, pid: int, host: str) -> None:
        """A controller's heartbeat (`fleet serve`, every few seconds)."""
        with self._tx() as db:
            db.run("INSERT INTO controllers (controller, leader, leader_since, started, "
                   "last_seen, pid, host) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT "
                   "(controller) DO UPDATE SET leader = excluded.leader, leader_since = "
                   "excluded.leader_since, started = excluded.started, last_seen = "
                   "excluded.last_seen, pid = excluded.pid, host = excluded.host",
                   [controller, int(leader), leader_since, started, now, pid, host])

    def controllers(self) -> list[dict[str, Any]]:
        """Every controller that ever ran on this store, as it last said, by name."""
        with self._read() as db:
            return [{"controller": c, "leader": bool(leader), "leader_since": since,
                     "started": started, "last_seen": seen, "pid": pid, "host": host}
                    for c, leader, since, started, seen, pid, host in db.rows(
                        "SELECT controller, leader, leader_since, started, last_seen, pid, "
                        "host FROM controllers ORDER BY controller")]

    def unregister(self, device: str) -> bool:
        """The registration gone (the device's history, if it reported, stays)."""
        with self._tx() as db:
            return db.run("DELETE FROM device_registrations WHERE device = ?", [device]) > 0

    def registrations(self) -> dict[str, dict[str, Any]]:
        """Every registration: device -> {"fleet", "at", "by"}."""
        with self._read() as db:
            return {device: {"fleet": fleet, "at": at, "by": by}
                    for device, fleet, at, by in db.rows(
                        "SELECT device, fleet, registered, registered_by FROM "
                        "device_registrations ORDER BY device")}

    def death(self, fleet: str, device: str, message: Mapping[str, Any], received: float) -> bool:
        """Offline only if the death's bdseq is the current session's (a stale Will from an
        older session leaves a newer one online); True if it marked the device offline."""
        with self._tx() as db:
            changed = db.run("UPDATE devices SET online = 0, last_death = ? "
                             "WHERE device = ? AND bdseq = ?",
                             [received, device, int(message["bdseq"])])
            db.run(f"INSERT INTO devices (device, fleet, online, first_seen, last_seen, "
                   f"last_death) VALUES (?, ?, 0, ?, ?, ?) ON CONFLICT (device) DO UPDATE SET "
                   f"last_seen = {_LATER}", [device, fleet, received, received, received])
            return changed > 0

    # -- reading --------------------------------------------------------------------------

    def devices(self) -> list[dict[str, Any]]:
        with self._read() as db:
            return [_device(row) for row in db.rows(
                f"SELECT {_DEVICE_READ} FROM devices ORDER BY device")]

    def device(self, device: str) -> dict[str, Any] | None:
        with self._read() as db:
            rows = db.rows(f"SELECT {_DEVICE_READ} FROM devices WHERE device = ?", [device])
            if not rows:
                return None
            found = _device(rows[0])
            found["messages"] = {kind: count for kind, count in db.rows(
                "SELECT kind, COUNT(*) FROM messages WHERE device = ? GROUP BY kind ORDER BY kind",
                [device])}
            return found

    def counts(self) -> tuple[int, int]:
        """(devices known, devices online)."""
        with self._read() as db:
            total, online = db.rows("SELECT COUNT(*), COALESCE(SUM(online), 0) FROM devices")[0]
            return int(total), int(online)

    def latest_metrics(self, device: str) -> dict[str, Any] | None:
        found = self.messages(device, kind="metrics", limit=1, newest_first=True)
        return found[0] if found else None

    def messages(self, device: str, *, kind: str | None = None, boot_id: str | None = None,
                 since: float | None = None, limit: int = 100,
                 newest_first: bool = False) -> list[dict[str, Any]]:
        where, params = ["device = ?"], [device]
        for column, value in (("kind", kind), ("boot_id", boot_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since is not None:
            where.append("ts >= ?")
            params.append(since)  # type: ignore[arg-type]
        order = "DESC" if newest_first else "ASC"
        with self._read() as db:
            rows = db.rows(f"SELECT device, fleet, boot_id, seq, kind, class, ts, received, body "
                           f"FROM messages WHERE {' AND '.join(where)} "
                           f"ORDER BY ts {order}, seq {order} LIMIT ?", [*params, int(limit)])
        return [{"device": r[0], "fleet": r[1], "boot_id": r[2], "seq": r[3], "kind": r[4],
                 "class": r[5], "ts": r[6], "received": r[7], "body": json.loads(r[8])}
                for r in rows]

    # -- commands -------------------------------------------------------------------------

    def next_command_seq(self, stream: str) -> int:
        """The next seq of a command stream (`<fleet>/<device>` or `<fleet>/all`): 1, 2, …"""
        with self._tx() as db:
            return int(db.rows(
                "INSERT INTO command_streams (stream, last_seq) VALUES (?, 1) ON CONFLICT "
                "(stream) DO UPDATE SET last_seq = command_streams.last_seq + 1 "
                "RETURNING last_seq", [stream])[0][0])

    def record_command(self, command: Mapping[str, Any], recorded: float) -> None:
        """A signed command as sent (its id once; a second record of the same id is a no-op)."""
        with self._tx() as db:
            self._insert_command(db, command, recorded)

    @staticmethod
    def _insert_command(db: Exec, command: Mapping[str, Any], recorded: float) -> None:
        db.run("INSERT INTO commands (id, fleet, target, type, seq, issued_at, expires_at, "
               "body, recorded) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
               [command["id"], command["fleet"], command["device"], command["type"],
                int(command["seq"]), float(command["issued_at"]),
                float(command["expires_at"]), _dumps(dict(command)), recorded])

    def command_result(self, device: str, body: Mapping[str, Any], received: float) -> bool:
        """A device's result for a command (the body of a `cmd/result` envelope); the first
        result per (command, device) is kept. True if it was new."""
        with self._tx() as db:
            return self._insert_result(db, device, body, received) > 0

    @staticmethod
    def _insert_result(db: Exec, device: str, body: Mapping[str, Any], received: float) -> int:
        cid, status = body.get("id"), body.get("status")
        if not isinstance(cid, str) or not COMMAND_ID.fullmatch(cid) or status not in (
                "ok", "refused", "failed"):
            raise ValueError("a command result needs an id and a status ok|refused|failed")
        result = body.get("result")
        return db.run("INSERT INTO command_results (id, device, type, status, reason, result, "
                      "received) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                      [cid, device, _text(body.get("type")), status, _text(body.get("reason")),
                       None if result is None else _dumps(result), received])

    def last_error(self, device: str) -> dict[str, Any] | None:
        """The newest thing that went wrong for a box, as the console's fleet page shows it:
        a command it refused or failed, or a rollout that failed on it."""
        with self._read() as db:
            found = db.rows(
                "SELECT received, 'command ' || COALESCE(type, '') || ' ' || status, "
                "COALESCE(reason, '') FROM command_results WHERE device = ? AND status <> 'ok' "
                "UNION ALL SELECT updated_at, 'rollout ' || rollout_id || ' ' || state, "
                "COALESCE(reason, '') FROM rollout_devices WHERE device = ? AND (state IN "
                "('FAILED', 'REFUSED', 'REJECTED', 'ROLLED_BACK') OR outcome = 'timed_out') "
                "ORDER BY 1 DESC LIMIT 1", [device, device])
        if not found:
            return None
        at, what, reason = found[0]
        return {"at": at, "what": what, "reason": reason}

    def command(self, command_id: str) -> dict[str, Any] | None:
        """A command as it was signed and sent, or None."""
        with self._read() as db:
            rows = db.rows("SELECT body FROM commands WHERE id = ?", [command_id])
        return json.loads(rows[0][0]) if rows else None

    def command_results(self, command_id: str) -> list[dict[str, Any]]:
        with self._read() as db:
            rows = db.rows("SELECT id, device, type, status, reason, result, received FROM "
                           "command_results WHERE id = ? ORDER BY device", [command_id])
        return [{"id": r[0], "device": r[1], "type": r[2], "status": r[3], "reason": r[4],
                 "result": None if r[5] is None else json.loads(r[5]), "received": r[6]}
                for r in rows]


def check_models(value: Any) -> list[dict[str, Any]]:
    """A box's model list (`[{"name", "digest", "active", "loaded"}]`), checked: device
    data never reaches the view in a shape the CLI cannot show."""
    if not isinstance(value, list) or len(value) > 10_000:
        raise ValueError("models must be a list")
    out = []
    for m in value:
        if (not isinstance(m, dict) or not isinstance(m.get("name"), str)
                or not isinstance(m.get("digest"), str)):
            raise ValueError("each model needs a name and a digest")
        out.append({"name": m["name"][:200], "digest": m["digest"][:80],
                    "active": m.get("active") is True, "loaded": m.get("loaded") is True})
    return out


def _device(row: tuple[Any, ...]) -> dict[str, Any]:
    """A device row as the API and `fleet devices` show it (the birth's facts lifted)."""
    (device, fleet, online, bdseq, boot_id, birth, first_seen, last_seen, last_birth,
     last_death, models_now, retired, retired_by) = row
    facts: dict[str, Any] = json.loads(birth) if birth else {}
    models = json.loads(models_now) if models_now else facts.get("models")
    if not isinstance(models, list):
        models = []
    return {
        "device": device, "fleet": fleet, "online": bool(online), "bdseq": bdseq,
        "boot_id": boot_id, "first_seen": first_seen, "last_seen": last_seen,
        "last_birth": last_birth, "last_death": last_death,
        "agent_version": facts.get("agent_version"),
        "llama_cpp_version": facts.get("llama_cpp_version"),
        "config_fingerprint": facts.get("config_fingerprint"),
        "hardware": facts.get("hardware"), "tenants": facts.get("tenants"),
        "models": models,
        "active_models": [m.get("name") for m in models
                          if isinstance(m, dict) and m.get("active")],
        "retired": None if retired is None else {"at": retired, "by": retired_by},
    }
