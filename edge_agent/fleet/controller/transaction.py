"""What every query of the controller's store is written against: a connection inside a
transaction, with `?` placeholders (`Exec`). Its own module because every part of the store
uses it — the ingest (`sql`), rollouts (`rollout_queries`), retention, operators and the audit
trail — while `sql` imports those parts: the type beside them would close a circle.

The drivers' side (`store._SQLiteExec`, `store._PostgresExec`) implements it; nothing here
opens, commits or knows a driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Exec(Protocol):
    """A connection inside a transaction, with `?` placeholders."""

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def run(self, sql: str, params: Sequence[Any] = ()) -> int: ...

    def many(self, sql: str, params: Sequence[Sequence[Any]]) -> None: ...

    def inserted(self, sql: str, params: Sequence[Sequence[Any]]) -> list[bool]:
        """Run an `INSERT … ON CONFLICT DO NOTHING RETURNING …` per row; for each row,
        whether it was inserted."""
        ...
