"""The state databases before a new agent version migrates them, and the way back.

`take` copies every SQLite database of the state dir with SQLite's online backup (the
running version keeps writing meanwhile; each copy is one consistent point). `restore`
runs in the base entry before any process opens a database, after a trial failed:

- a database whose schema the new version left as it was stays as it is: every row either
  version wrote is kept, and the previous version reads it as its own;
- a database whose schema changed (a migration ran, or failed half-way) is replaced by its
  snapshot, and every row of the live file the snapshot lacks is carried over into it —
  the columns both have, keyed by rowid or primary key — so that ledger rows, outbox
  messages and batch results written meanwhile (by the previous version before it stopped,
  or by the new one) survive. A row both hold keeps the snapshot's values: an outbox
  message the new version sent and dropped is sent again (the controller keeps the first
  by its id), a rollout row goes back to what the previous version knew (its runner
  finishes it from the trial).

The live file is replaced by rename, with its `-wal` and `-shm` removed first (they belong
to the file being replaced).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

SKIP_DIRS = frozenset({"agent", "rollouts", "downloads", "tuf"})
_INTERNAL = ("sqlite_", "_sqlite")


def databases(state_dir: Path) -> Iterator[Path]:
    """The state dir's databases, relative (its top level and one level down, leaving
    out work and snapshot directories)."""
    for path in sorted(state_dir.glob("*.db")) + sorted(state_dir.glob("*/*.db")):
        rel = path.relative_to(state_dir)
        if rel.parts[0] not in SKIP_DIRS and path.is_file():
            yield rel


def take(state_dir: Path, dest: Path) -> list[str]:
    """Each database backed up into `dest` (its relative path kept); the names copied."""
    done = []
    for rel in databases(state_dir):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = target.with_name(target.name + ".part")
        tmp.unlink(missing_ok=True)
        with closing(sqlite3.connect(state_dir / rel, timeout=30)) as src, \
                closing(sqlite3.connect(tmp)) as copy:
            src.backup(copy)
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
        done.append(str(rel))
    return done


def schema(path: Path) -> list[tuple[str, str, str]]:
    with closing(sqlite3.connect(path, timeout=30)) as db:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        rows = db.execute("SELECT type, name, COALESCE(sql, '') FROM sqlite_master "
                          "ORDER BY type, name").fetchall()
    return [("user_version", "", str(version)), *rows]


def restore(state_dir: Path, snapshot: Path) -> dict[str, str]:
    """Each snapshot database back where its schema changed, live rows carried over (the
    module's doc); per database what was done."""
    out: dict[str, str] = {}
    for path in sorted(snapshot.glob("*.db")) + sorted(snapshot.glob("*/*.db")):
        rel = path.relative_to(snapshot)
        live = state_dir / rel
        if not live.exists():
            shutil.copyfile(path, live)
            os.chmod(live, 0o600)
            out[str(rel)] = "restored (the live file was gone)"
            continue
        try:
            same = schema(live) == schema(path)
        except sqlite3.DatabaseError:
            same = False  # a file the new version left unreadable
        if same:
            out[str(rel)] = "kept (schema unchanged)"
            continue
        tmp = live.with_name(f".{live.name}.restore")
        shutil.copyfile(path, tmp)
        try:
            carried = _carry_over(tmp, live)
        except sqlite3.DatabaseError as exc:
            carried = -1
            out[str(rel)] = f"restored; the live rows could not be read: {exc}"
        for suffix in ("-wal", "-shm"):
            Path(f"{live}{suffix}").unlink(missing_ok=True)
        os.chmod(tmp, 0o600)
        os.replace(tmp, live)
        if carried >= 0:
            out[str(rel)] = f"restored, {carried} row(s) written meanwhile carried over"
    return out


def _carry_over(into: Path, live: Path) -> int:
    """Rows of `live` that `into` lacks, inserted into `into` (columns both have)."""
    total = 0
    with closing(sqlite3.connect(into)) as db:
        db.execute("ATTACH DATABASE ? AS live", (str(live),))
        tables = [r[0] for r in db.execute(
            "SELECT name FROM main.sqlite_master WHERE type = 'table' "
            "AND sql NOT LIKE 'CREATE VIRTUAL%'")]
        theirs = {r[0] for r in db.execute(
            "SELECT name FROM live.sqlite_master WHERE type = 'table'")}
        for table in tables:
            if table.startswith(_INTERNAL) or table not in theirs:
                continue
            mine = [r[1] for r in db.execute(f'PRAGMA main.table_info("{table}")')]
            other = {r[1] for r in db.execute(f'PRAGMA live.table_info("{table}")')}
            cols = [c for c in mine if c in other]
            if not cols:
                continue
            listed = ", ".join(f'"{c}"' for c in cols)
            without_rowid = db.execute(
                "SELECT sql FROM main.sqlite_master WHERE name = ?", (table,)
            ).fetchone()[0].upper().rstrip().endswith("WITHOUT ROWID")
            if without_rowid:
                cur = db.execute(f'INSERT OR IGNORE INTO main."{table}" ({listed}) '
                                 f'SELECT {listed} FROM live."{table}"')
            else:
                cur = db.execute(f'INSERT OR IGNORE INTO main."{table}" (rowid, {listed}) '
                                 f'SELECT rowid, {listed} FROM live."{table}"')
            total += max(cur.rowcount, 0)
        db.commit()
        db.execute("DETACH DATABASE live")
    return total
