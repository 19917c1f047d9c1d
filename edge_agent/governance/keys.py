"""API keys, stored in `<state-dir>/keys.db` only as SHA-256 hashes.

A key is `ea_<prefix>_<secret>`: the prefix (public, shown in listings and the ledger)
finds the row; the full key's hash is then compared in constant time. Keys are 32
random bytes, so a plain hash is enough (no password stretching needed). An operator
key (`admin`) may also manage models (delete, unload, load outside its tenant's scope).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from edge_agent.owner_only import private_file

MIGRATIONS = Migrations("edge-agent-keys")


@MIGRATIONS()
def m001_keys(db: Database) -> None:
    db["keys"].create({"prefix": str, "hash": str, "tenant": str, "created": float,  # type: ignore[union-attr]
                       "last_used": float, "revoked": float}, pk="prefix")


@MIGRATIONS()
def m002_admin(db: Database) -> None:
    """Operator keys: existing keys stay ordinary (0)."""
    db["keys"].add_column("admin", int, not_null_default=0)  # type: ignore[union-attr]


@dataclass(frozen=True)
class KeyRecord:
    prefix: str
    tenant: str
    created: float
    last_used: float | None
    revoked: float | None
    admin: bool = False


class ActiveKey(NamedTuple):
    """What the server keeps in memory per key that is not revoked."""

    hash: str
    tenant: str
    admin: bool


class KeyMatch(NamedTuple):
    prefix: str
    tenant: str
    admin: bool


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "keys.db"

    def _db(self) -> Database:
        db = Database(private_file(self.path))  # 0600, and so its -wal and -shm
        db.enable_wal()
        MIGRATIONS.apply(db)
        return db

    def create(self, tenant: str, *, admin: bool = False) -> tuple[str, KeyRecord]:
        prefix = secrets.token_hex(4)
        key = f"ea_{prefix}_{secrets.token_urlsafe(32)}"
        now = time.time()
        db = self._db()
        try:
            db["keys"].insert({"prefix": prefix, "hash": _hash(key), "tenant": tenant,  # type: ignore[union-attr]
                               "created": now, "last_used": None, "revoked": None,
                               "admin": int(admin)})
        finally:
            db.close()
        return key, KeyRecord(prefix, tenant, now, None, None, admin)

    def list(self) -> list[KeyRecord]:
        if not self.path.exists():
            return []
        db = self._db()
        try:
            return [KeyRecord(r["prefix"], r["tenant"], r["created"], r["last_used"],
                              r["revoked"], bool(r["admin"]))
                    for r in db["keys"].rows_where(order_by="created")]  # type: ignore[union-attr]
        finally:
            db.close()

    def any_active(self) -> bool:
        return any(k.revoked is None for k in self.list())

    def revoke(self, prefix: str) -> bool:
        db = self._db()
        try:
            with db.atomic():
                cur = db.execute("UPDATE keys SET revoked = ? WHERE prefix = ? AND revoked IS NULL",
                                 [time.time(), prefix])
            return cur.rowcount == 1
        finally:
            db.close()

    def stamp(self) -> tuple[int, ...]:
        """What changes when the store is written (keys.db and its WAL: size and mtime):
        a cheap way to know a reload would find something new."""
        out: list[int] = []
        for path in (self.path, self.path.with_name(self.path.name + "-wal")):
            try:
                st = path.stat()
                out += [st.st_mtime_ns, st.st_size]
            except FileNotFoundError:
                out += [0, 0]
        return tuple(out)

    def load_active(self) -> dict[str, ActiveKey]:
        """prefix → (hash, tenant, admin) of keys not revoked; the server keeps this in
        memory."""
        if not self.path.exists():
            return {}
        db = self._db()
        try:
            return {r["prefix"]: ActiveKey(r["hash"], r["tenant"], bool(r["admin"]))
                    for r in db["keys"].rows_where("revoked IS NULL")}  # type: ignore[union-attr]
        finally:
            db.close()

    def touch(self, used: dict[str, float]) -> None:
        if not used:
            return
        db = self._db()
        try:
            with db.atomic():
                for prefix, ts in used.items():
                    db.execute("UPDATE keys SET last_used = ? WHERE prefix = ?", [ts, prefix])
        finally:
            db.close()


def match(key: str, active: dict[str, ActiveKey]) -> KeyMatch | None:
    """The prefix, tenant and admin flag of a valid key, else None; the hash comparison is
    constant-time."""
    parts = key.split("_", 2)  # the secret itself may contain "_"
    if len(parts) != 3 or parts[0] != "ea":
        return None
    entry = active.get(parts[1])
    digest = _hash(key)
    expected = entry.hash if entry else "0" * 64
    if hmac.compare_digest(digest, expected) and entry is not None:
        return KeyMatch(parts[1], entry.tenant, entry.admin)
    return None
