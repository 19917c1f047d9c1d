"""Who did what to the fleet: one row per operator action, kept apart from what the boxes
report, and never changed once written.

An action is a rollout's start, pause, resume, abort or rollback, a command sent, or an
operator's token made or revoked, through the API: by a token's operator from the
caller's address, or by the CLI on the controller host (its in-process app:
`local:<unix user>`, role `host`, source `cli`). Its row says when, who
with which role, from where, the action and its target, the request as given, and the
outcome: the HTTP status it got (2xx done, 4xx refused, with the reason). A refused action
is recorded too, so an attempt to do more than a role allows is on the trail.

The table is `operator_actions`: nothing in the API updates or deletes a row of it, and
retention (which removes the boxes' audit *messages*) does not touch it.
`AuditQueries` is held by `sql.SQLStore`, as the other tables' queries are.
"""

from __future__ import annotations

import getpass
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from edge_agent.errors import EdgeAgentError
from edge_agent.fleet.controller.transaction import Exec

_COLUMNS = "id, at, operator, role, source, action, target, request, status, outcome"
REQUEST_LIMIT = 16_384  # characters of a request's JSON kept on the trail
# What neither database's text takes: a lone surrogate (valid in a JSON string, `\ud800`,
# but not encodable as UTF-8) and NUL (PostgreSQL refuses it).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    """`text` as both databases store it: each unstorable character becomes U+FFFD, so a
    hostile value is kept as near as it can be rather than failing the row (and with it
    the refusal the row records)."""
    return _UNSTORABLE.sub("\ufffd", text)


# The rows recorded while a request is handled: set by the access check around the app,
# shared with the threads that run its synchronous handlers (each runs in a copy of the
# context, which holds the same list), so the check can tell whether a refused write was
# already recorded by the code that refused it.
_RECORDED: ContextVar[list[AuditEntry] | None] = ContextVar("audit_recorded", default=None)


@contextmanager
def recording() -> Iterator[list[AuditEntry]]:
    """The rows `Action`s record within the block (a request's handling)."""
    rows: list[AuditEntry] = []
    token = _RECORDED.set(rows)
    try:
        yield rows
    finally:
        _RECORDED.reset(token)


@dataclass(frozen=True)
class AuditEntry:
    id: str
    at: float
    operator: str
    role: str
    source: str
    action: str
    target: str | None
    request: dict[str, Any]
    status: int
    outcome: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def local_operator() -> str:
    """The name an action from the controller host's CLI is recorded under."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (a container)
        user = "unknown"
    return f"local:{user}"


class AuditStore(Protocol):
    """The audit trail's queries as callers hold them: `store.audit` (`store.ControllerStore`)."""

    def record_action(self, *, at: float, operator: str, role: str, source: str, action: str,
                      target: str | None, request: Mapping[str, Any], status: int,
                      outcome: str) -> AuditEntry: ...

    def actions(self, *, since: float | None = None, operator: str | None = None,
                target: str | None = None, limit: int = 1000) -> list[AuditEntry]: ...


class AuditQueries:
    """The trail's rows, each call in a transaction of the store that holds this object
    (`sql.SQLStore.audit`): `tx` opens a write, `read` a read."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Exec]],
                 read: Callable[[], AbstractContextManager[Exec]]) -> None:
        self._tx = tx
        self._read = read

    def record_action(self, *, at: float, operator: str, role: str, source: str, action: str,
                      target: str | None, request: Mapping[str, Any], status: int,
                      outcome: str) -> AuditEntry:
        text = storable(json.dumps(dict(request), separators=(",", ":"), ensure_ascii=False,
                                   default=str))
        if len(text) > REQUEST_LIMIT:
            text = json.dumps({"truncated": text[:REQUEST_LIMIT]}, ensure_ascii=False)
        operator, role, source, action = (storable(v)[:200]
                                          for v in (operator, role, source, action))
        target = None if target is None else storable(target)[:200]
        entry = AuditEntry(f"au-{uuid.uuid4().hex}", at, operator, role, source, action,
                           target, json.loads(text), status, storable(outcome)[:1000])
        with self._tx() as db:
            db.run(f"INSERT INTO operator_actions ({_COLUMNS}) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   [entry.id, at, operator, role, source, action, target, text, status,
                    entry.outcome])
        return entry

    def actions(self, *, since: float | None = None, operator: str | None = None,
                target: str | None = None, limit: int = 1000) -> list[AuditEntry]:
        """Oldest first (the last `limit` of those that match)."""
        where, params = [], []
        for column, op, value in (("at", ">=", since), ("operator", "=", operator),
                                  ("target", "=", target)):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        with self._read() as db:
            rows = db.rows(f"SELECT {_COLUMNS} FROM operator_actions{clause} "
                           "ORDER BY at DESC, id DESC LIMIT ?", [*params, limit])
        return [AuditEntry(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), r[8],
                           r[9]) for r in reversed(rows)]


class Action:
    """One action being done: `audited` records it once, whatever way it ends; the code
    doing it sets `target` once known (a rollout's generated id) or records a refusal it
    turns into another exception (`refused`)."""

    def __init__(self, store: AuditStore, *, operator: str, role: str, source: str,
                 action: str, target: str | None, request: Mapping[str, Any]) -> None:
        self._store = store
        self.operator, self.role, self.source = operator, role, source
        self.action, self.request = action, request
        self.target = target
        self.entry: AuditEntry | None = None

    def record(self, status: int, outcome: str) -> None:
        if self.entry is None:
            self.entry = self._store.record_action(
                at=time.time(), operator=self.operator, role=self.role, source=self.source,
                action=self.action, target=self.target, request=self.request, status=status,
                outcome=outcome)
            rows = _RECORDED.get()
            if rows is not None:
                rows.append(self.entry)

    def refused(self, exc: EdgeAgentError) -> None:
        self.record(exc.status_code, exc.message)


@contextmanager
def audited(store: AuditStore, *, operator: str, role: str, source: str, action: str,
            target: str | None, request: Mapping[str, Any]) -> Iterator[Action]:
    """Records the action done (200), refused (the error's status and message) or failed
    (500), then lets the outcome go on its way."""
    done = Action(store, operator=operator, role=role, source=source, action=action,
                  target=target, request=request)
    try:
        yield done
    except EdgeAgentError as exc:
        done.refused(exc)
        raise
    except Exception as exc:
        done.record(500, f"failed: {type(exc).__name__}: {exc}")
        raise
    done.record(200, "done")
