"""The controller's store on either database: `store`, the same test on SQLite and on a
private PostgreSQL (a module with a `store` of its own uses that one instead)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.fleet.controller.store import ControllerStore, PostgresStore, SQLiteStore


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ControllerStore]:
    if request.param == "sqlite":
        made: ControllerStore = SQLiteStore(tmp_path / "controller.db")
    else:
        made = PostgresStore(request.getfixturevalue("postgres_url"))
    yield made
    made.close()
