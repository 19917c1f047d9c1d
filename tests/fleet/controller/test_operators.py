"""Operators and their tokens, on SQLite and on a private PostgreSQL, and from the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.fleet.controller.operators import (
    OperatorConflict,
    check_name,
    check_role,
    may,
    split_token,
)
from edge_agent.fleet.controller.store import ControllerStore, SQLiteStore


def test_roles_are_ranked() -> None:
    assert may("admin", "operator") and may("admin", "viewer") and may("operator", "viewer")
    assert not may("viewer", "operator") and not may("operator", "admin")
    assert check_role("viewer") == "viewer"
    with pytest.raises(ValueError, match="role must be one of viewer, operator, admin"):
        check_role("root")
    for bad in ("", "Alice", "-x", "a b", "a/b", "x" * 65):
        with pytest.raises(ValueError, match="operator name"):
            check_name(bad)
    assert check_name("alice@hq") == "alice@hq"


def test_a_token_names_its_operator_until_it_is_revoked(store: ControllerStore) -> None:
    assert not store.operators.any_operator()
    token, record = store.operators.create_operator("alice", "operator", 100.0)
    assert token.startswith(f"eop_{record.prefix}_") and len(token) > 50
    assert (record.name, record.role, record.created, record.revoked) == \
        ("alice", "operator", 100.0, None)
    assert store.operators.any_operator()
    found = store.operators.operator_for_token(token)
    assert found is not None and (found.name, found.role, found.prefix) == \
        ("alice", "operator", record.prefix)
    # Anything else than the exact token is nobody, the right prefix with a wrong secret too.
    for other in (token + "x", token[:-1], f"eop_{record.prefix}_guess", "eop_zzzzzzzz_x",
                  "ea_12345678_x", "", "eop__", token.upper()):
        assert store.operators.operator_for_token(other) is None, other
    revoked = store.operators.revoke_operator("alice", 200.0)
    assert revoked is not None and revoked.revoked == 200.0
    assert store.operators.operator_for_token(token) is None
    assert not store.operators.any_operator()
    assert store.operators.revoke_operator("alice", 300.0) is None  # nothing live left to revoke


def test_a_name_has_one_live_token_and_may_get_a_new_one_once_revoked(
        store: ControllerStore) -> None:
    first, _ = store.operators.create_operator("bob", "viewer", 1.0)
    with pytest.raises(OperatorConflict, match="has a token already"):
        store.operators.create_operator("bob", "admin", 2.0)
    store.operators.revoke_operator("bob", 3.0)
    second, record = store.operators.create_operator("bob", "admin", 4.0)
    assert store.operators.operator_for_token(first) is None
    found = store.operators.operator_for_token(second)
    assert found is not None and found.role == "admin"
    listed = store.operators.operators()
    assert [(r.name, r.role, r.revoked) for r in listed] == \
        [("bob", "viewer", 3.0), ("bob", "admin", None)]
    assert [r.prefix for r in store.operators.operators(revoked=False)] == [record.prefix]


def test_only_the_hash_is_stored(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "controller.db")
    token, _ = store.operators.create_operator("carol", "admin", 1.0)
    store.close()
    raw = (tmp_path / "controller.db").read_bytes()
    wal = tmp_path / "controller.db-wal"
    raw += wal.read_bytes() if wal.exists() else b""
    assert token.split("_", 2)[2].encode() not in raw
    assert split_token(token) is not None and split_token("eop_12_x") is None


def _fleet(state: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["fleet", *args, "--state-dir", str(state)])
    return result.exit_code, result.stdout, result.stderr


def test_the_cli_creates_lists_and_revokes(tmp_path: Path) -> None:
    state = tmp_path / "fleet"
    code, out, err = _fleet(state, "operators", "list")
    assert code == 1 and "no controller store at" in err and "fleet serve creates it" in err
    # The first operator may come before the first `fleet serve`: it makes the store.
    code, out, err = _fleet(state, "operators", "create", "alice", "--role", "viewer")
    assert code == 0, err
    token = out.strip()
    assert token.startswith("eop_") and "shown only once" in err
    assert f"creating the controller store {state / 'controller.db'}" in err
    code, out, err = _fleet(state, "operators", "create", "alice", "--role", "admin")
    assert code == 1 and "edge-agent: operator 'alice' has a token already" in err
    code, out, err = _fleet(state, "operators", "create", "Bad Name", "--role", "admin")
    assert code == 2 and "operator name" in err
    code, out, err = _fleet(state, "operators", "create", "dave", "--role", "root")
    assert code == 2 and "'root' is not one of" in err
    code, out, _ = _fleet(state, "operators", "create", "dave", "--role", "admin", "--json")
    made = json.loads(out)
    assert code == 0 and made["name"] == "dave" and made["token"].startswith("eop_")

    code, out, _ = _fleet(state, "operators", "list")
    assert code == 0 and "alice" in out and "viewer" in out and token not in out
    code, out, _ = _fleet(state, "operators", "list", "--json")
    assert [(o["name"], o["role"], o["revoked"]) for o in json.loads(out)] == \
        [("alice", "viewer", None), ("dave", "admin", None)]
    assert all("hash" not in o and "token" not in o for o in json.loads(out))

    code, out, _ = _fleet(state, "operators", "revoke", "alice")
    assert code == 0 and "revoked viewer alice" in out
    code, _, err = _fleet(state, "operators", "revoke", "alice")
    assert code == 1 and "operator 'alice' has no live token" in err
    store = SQLiteStore(state / "controller.db")
    try:
        assert store.operators.operator_for_token(token) is None
        assert store.operators.operator_for_token(made["token"]) is not None
    finally:
        store.close()
