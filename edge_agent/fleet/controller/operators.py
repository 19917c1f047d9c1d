"""The people who run the fleet from their desks: operators, their roles and tokens.

An operator token is `eop_<prefix>_<secret>`, made once by `fleet operators create` on the
controller host and shown only then; the store keeps its SHA-256 (32 random bytes need no
password stretching), found by the public prefix and compared in constant time, as the
box does with its API keys. Each API request looks its token up in the store, so a token
revoked with `fleet operators revoke` is refused from the next request on, by every
controller on the same store, with no restart and no cache to expire.

Roles are ranked: a `viewer` reads; an `operator` also starts, pauses, resumes, aborts
and rolls back rollouts and sends commands; an `admin` also manages operators and
devices. The CLI on the controller host acts as `local:<unix user>` with the role `host`,
which no token has. A name has at most one live token (a new one needs the old one revoked), so the
name in the audit trail is one person's.

`OperatorQueries` is held by `sql.SQLStore` (SQLite and PostgreSQL alike), as the
rollouts' and retention's queries are.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from edge_agent.errors import Conflict
from edge_agent.fleet.controller.transaction import Exec

ROLES: tuple[str, ...] = ("viewer", "operator", "admin")  # each may do what those before it may
# Not a token's role: whoever runs `edge-agent fleet …` on the controller host with the store
# in reach (the CLI's in-process client), who could write the store anyway.
HOST = "host"
TOKEN_PREFIX = "eop"
OPERATOR_NAME = re.compile(r"[a-z0-9][a-z0-9._@-]{0,63}")

_COLUMNS = "prefix, name, role, created, revoked"


class OperatorConflict(Conflict):
    """The name already has a live token."""


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    return role


def check_name(name: str) -> str:
    if not OPERATOR_NAME.fullmatch(name):
        raise ValueError(f"operator name {name!r}: 1-64 of a-z 0-9 . _ @ -, starting with a "
                         "letter or digit")
    return name


def may(role: str, needed: str) -> bool:
    """Whether `role` covers `needed` (an admin may do what an operator may, and so on;
    the host everything)."""
    return role == HOST or ROLES.index(role) >= ROLES.index(needed)


@dataclass(frozen=True)
class OperatorRecord:
    prefix: str
    name: str
    role: str
    created: float
    revoked: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Operator:
    """Who made a request: the token's operator, as the access rules and the audit see it."""

    name: str
    role: str
    prefix: str


class OperatorStore(Protocol):
    """The operators' queries as callers hold them: `store.operators` (`store.ControllerStore`)."""

    def create_operator(self, name: str, role: str, now: float
                        ) -> tuple[str, OperatorRecord]: ...

    def operators(self, *, revoked: bool = True) -> list[OperatorRecord]: ...

    def revoke_operator(self, name: str, now: float) -> OperatorRecord | None: ...

    def any_operator(self) -> bool: ...

    def operator_for_token(self, token: str) -> Operator | None: ...


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def split_token(token: str) -> str | None:
    """The prefix of something shaped like an operator token, else None."""
    parts = token.split("_", 2)  # the secret itself may contain "_"
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or not re.fullmatch(r"[0-9a-f]{8}", parts[1]):
        return None
    return parts[1]


class OperatorQueries:
    """The operators' rows, each call in a transaction of the store that holds this object
    (`sql.SQLStore.operators`): `tx` opens a write, `read` a read."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Exec]],
                 read: Callable[[], AbstractContextManager[Exec]]) -> None:
        self._tx = tx
        self._read = read

    def create_operator(self, name: str, role: str, now: float) -> tuple[str, OperatorRecord]:
        """A new token for `name`, returned once; OperatorConflict if the name has one."""
        check_name(name)
        check_role(role)
        prefix = secrets.token_hex(4)
        token = f"{TOKEN_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
        with self._tx() as db:
            if db.rows("SELECT 1 FROM operators WHERE name = ? AND revoked IS NULL", [name]):
                raise OperatorConflict(f"operator {name!r} has a token already: revoke it "
                                       f"first (fleet operators revoke {name})")
            db.run("INSERT INTO operators (prefix, name, role, hash, created) "
                   "VALUES (?, ?, ?, ?, ?)", [prefix, name, role, _hash(token), now])
        return token, OperatorRecord(prefix, name, role, now, None)

    def operators(self, *, revoked: bool = True) -> list[OperatorRecord]:
        where = "" if revoked else " WHERE revoked IS NULL"
        with self._read() as db:
            rows = db.rows(f"SELECT {_COLUMNS} FROM operators{where} ORDER BY created, prefix")
        return [OperatorRecord(*row) for row in rows]

    def revoke_operator(self, name: str, now: float) -> OperatorRecord | None:
        """Revokes the name's live token; the record as it is now, or None if it had none."""
        with self._tx() as db:
            rows = db.rows(f"SELECT {_COLUMNS} FROM operators WHERE name = ? AND revoked IS NULL",
                           [name])
            if not rows:
                return None
            db.run("UPDATE operators SET revoked = ? WHERE name = ? AND revoked IS NULL",
                   [now, name])
        prefix, name, role, created, _ = rows[0]
        return OperatorRecord(prefix, name, role, created, now)

    def any_operator(self) -> bool:
        with self._read() as db:
            return bool(db.rows("SELECT 1 FROM operators WHERE revoked IS NULL LIMIT 1"))

    def operator_for_token(self, token: str) -> Operator | None:
        """The live operator whose token this is, else None; the hash comparison is
        constant-time, and an unknown prefix costs the same comparison."""
        prefix = split_token(token)
        if prefix is None:
            return None
        with self._read() as db:
            rows = db.rows("SELECT name, role, hash FROM operators WHERE prefix = ? AND "
                           "revoked IS NULL", [prefix])
        name, role, expected = rows[0] if rows else ("", "", "0" * 64)
        if hmac.compare_digest(_hash(token), expected) and rows:
            return Operator(name, role, prefix)
        return None
