"""The registry of command types and everything that reads it, held together: the box runs
each registered type with exactly one handler and no other, its handlers' results have the
registered shapes and their args checks agree with the registered schemas, the controller
refuses an unknown type, args off the schema and a role too low before it signs, the
simulator scripts every type, and `fleet send --help` and the manual list them all."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.config import FleetSettings, Settings, TenantPolicy
from edge_agent.engine.modelops import ModelOps
from edge_agent.fleet.controller.access import RULES
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.operators import ROLES, may
from edge_agent.fleet.controller.rollouts import driver
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.device.link.command_gate import Handler, ping
from edge_agent.fleet.device.link.core import OWN_TYPES, REBIRTH_AFTER, LinkCore
from edge_agent.fleet.device.link.dispatch import box_dispatch, unhandled
from edge_agent.fleet.device.link.handlers import box_handlers
from edge_agent.fleet.device.rollout.model_verify import model_verify_handler
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.protocol import command_types
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import (
    CAPACITY_KEYS,
    COMMAND_TYPES,
    BadArgs,
    CommandType,
    IgnoredArgs,
    lookup,
    shape,
)
from edge_agent.fleet.protocol.refusals import MALFORMED, CommandRefused
from edge_agent.fleet.sim.fleet import SCRIPT_TYPES, Simulator
from tests.support.reference_tool import load_reference

ROOT = Path(__file__).resolve().parents[3]
TYPE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")  # protocol.command's rule for `type`


def _command(type_: str, args: dict[str, Any]) -> Command:
    now = time.time()
    return Command("c" * 32, "f1", "store-1", type_, 1, now, now + 60, args, "store-1", b"")


class _Core(LinkCore):
    """A link without an owner: enough to run its own handlers."""

    def _wake(self) -> None:
        pass


def _core(handlers: dict[str, Handler] | None = None) -> _Core:
    fleet = FleetSettings.model_validate({"enabled": True, "broker": "mqtt://127.0.0.1:1",
                                          "fleet_id": "f1", "device_id": "store-1"})
    return _Core(fleet, facts=dict, handlers=handlers)


def _box(state: Path) -> dict[str, Handler]:
    """The whole box's table, as `FleetDevice` puts it together, over fakes."""
    settings = Settings(state_dir=state, tenants={"shop": TenantPolicy()})
    rollouts = RolloutManager(settings, cast(Any, None), cast(Any, None), cast(Any, None))
    verify = model_verify_handler(ModelOps.for_settings(settings),
                                  recorded=rollouts.release_digest)
    return box_dispatch(box_handlers(settings, state, purge=lambda before: 3,
                                     revoke=lambda prefix: prefix == "abcd1234",
                                     apply_live=lambda new, changes: list(changes)),
                        rollouts.handlers(), {"model.verify": verify})


# -- the registry itself ---------------------------------------------------------------------

def test_every_type_is_complete_and_within_the_protocol() -> None:
    route_role = RULES[("POST", "/commands")]
    assert command_types.ROLES == ROLES
    assert list(COMMAND_TYPES) == [t.name for t in COMMAND_TYPES.values()]
    for t in COMMAND_TYPES.values():
        assert TYPE.fullmatch(t.name), t.name
        assert t.role in ROLES and may(t.role, route_role), t  # the route lets it through
        assert "\n" not in t.description and t.description.endswith("."), t.name
        assert shape(t.result) != "any (ignored)", t.name
    assert REBIRTH_AFTER == {"config.patch"}


# -- the box ---------------------------------------------------------------------------------

def test_the_box_runs_every_registered_type_with_exactly_one_handler(tmp_path: Path) -> None:
    table = _box(tmp_path)
    assert set(_core()._handlers) == OWN_TYPES
    assert not set(table) & OWN_TYPES
    assert set(table) | OWN_TYPES == set(COMMAND_TYPES)
    assert unhandled(table) == []
    assert unhandled({}) == [t for t in COMMAND_TYPES if t not in OWN_TYPES]


def test_a_handler_twice_or_for_no_registered_type_is_refused() -> None:
    with pytest.raises(ValueError, match="no registered command type"):
        box_dispatch({"reboot": ping})
    with pytest.raises(ValueError, match="two handlers"):
        box_dispatch({"keys.revoke": ping}, {"keys.revoke": ping})
    with pytest.raises(ValueError, match="two handlers"):
        box_dispatch({"ping": ping})
    with pytest.raises(ValueError, match="answers ping itself"):
        _core({"ping": lambda command: {"pong": False}})
    assert _core({"ping": ping})._handlers["ping"] is ping  # the same one is no second


def test_each_handler_takes_its_example_and_returns_the_registered_shape(
        tmp_path: Path) -> None:
    table = {**_core()._handlers, **_box(tmp_path)}
    for t in COMMAND_TYPES.values():
        t.check_args(t.example)
        out = table[t.name](_command(t.name, dict(t.example)))
        t.result.model_validate(out)


def _refused(handler: Handler, command: Command) -> bool:
    try:
        handler(command)
    except CommandRefused as exc:
        assert exc.reason == MALFORMED
        return True
    return False


SAMPLES: list[tuple[str, dict[str, Any], bool]] = [
    ("ping", {"n": 1}, True),
    ("ledger.purge", {}, True),
    ("ledger.purge", {"before": 1764500000}, True),
    ("ledger.purge", {"before": None}, True),
    ("ledger.purge", {"before": "yesterday"}, False),
    ("ledger.purge", {"before": True}, False),
    ("ledger.purge", {"before": 10**400}, False),
    ("ledger.purge", {"after": 1}, False),
    ("keys.revoke", {"prefix": "abcd1234"}, True),
    ("keys.revoke", {}, False),
    ("keys.revoke", {"prefix": 12345678}, False),
    ("keys.revoke", {"prefix": "ab/cd"}, False),
    ("keys.revoke", {"prefix": "abcd1234", "tenant": "shop"}, False),
    ("config.patch", {"set": {"telemetry.interval_s": 10}}, True),
    ("config.patch", {"set": {"tenants.shop.tokens_per_day": None}}, True),
    ("config.patch", {}, False),
    ("config.patch", {"set": {}}, False),
    ("config.patch", {"set": [1]}, False),
    ("config.patch", {"set": {"telemetry.interval_s": "10"}}, False),
    ("config.patch", {"set": {"telemetry.interval_s": True}}, False),
    ("config.patch", {"set": {f"k{i}": 1 for i in range(65)}}, False),
    ("config.patch", {"set": {"telemetry.interval_s": 10}, "dry_run": True}, False),
    ("model.verify", {"name": "m:1", "version": 2}, True),
    ("model.verify", {"name": "m", "version": "2.1-rc1"}, True),
    ("model.verify", {"name": "m:1", "digest": "sha256:" + "ab" * 32}, True),
    ("model.verify", {"name": "m:1"}, False),
    ("model.verify", {"name": "m:1", "version": 2, "digest": "sha256:" + "ab" * 32}, False),
    ("model.verify", {"name": "m:1", "version": None}, False),
    ("model.verify", {"name": "m:1", "digest": "ab" * 32}, False),
    ("model.verify", {"name": "m:1", "digest": "sha256:" + "AB" * 32}, False),
    ("model.verify", {"name": "Bad Name!", "version": 2}, False),
    ("model.verify", {"version": 2}, False),
    ("rollout.start", {"rollout_id": "r1", "name": "m:1", "version": 2}, True),
    ("rollout.start", {"rollout_id": "r1", "name": "m", "version": "2.1-rc1"}, True),
    ("rollout.start", {"rollout_id": "r1", "name": "m:1"}, False),
    ("rollout.start", {"rollout_id": "a/b", "name": "m:1", "version": 2}, False),
    ("rollout.start", {"rollout_id": "r1", "name": "Bad Name!", "version": 2}, False),
    ("rollout.start", {"rollout_id": "r1", "name": "m:1", "version": True}, False),
    ("rollout.start", {"rollout_id": "r1", "name": "m:1", "version": -1}, False),
    ("rollout.cancel", {"rollout_id": "r1"}, True),
    ("rollout.cancel", {"name": "m:1"}, True),
    ("rollout.cancel", {}, False),
    ("rollout.cancel", {"rollout_id": "r1", "name": "m:1"}, False),
    ("rollout.rollback", {"name": 7}, False),
    ("rollout.rollback", {"x": 1}, False),
]


@pytest.mark.parametrize(("type_", "args", "ok"), SAMPLES)
def test_the_registry_and_the_box_agree_on_args(tmp_path: Path, type_: str,
                                                args: dict[str, Any], ok: bool) -> None:
    """Shapes only: what the values mean (a key's bounds, a known tenant) is the box's."""
    try:
        lookup(type_).check_args(args)
        fits = True
    except BadArgs as exc:
        assert str(exc).startswith("args") and type_ in str(exc)
        fits = False
    table = {**_core()._handlers, **_box(tmp_path)}
    assert (fits, not _refused(table[type_], _command(type_, args))) == (ok, ok)


def test_types_that_read_no_args_are_the_read_only_ones() -> None:
    for t in COMMAND_TYPES.values():
        if t.args is IgnoredArgs:
            assert not t.mutating, t.name


# -- the simulator, the controller, the help and the manual ------------------------------------

def test_the_simulator_scripts_every_type_the_link_does_not_answer_itself(
        tmp_path: Path) -> None:
    assert SCRIPT_TYPES == set(COMMAND_TYPES) - OWN_TYPES
    sim = Simulator("mqtt://127.0.0.1:1", fleet="f1", devices=["sim-1"], password_file=None,
                    root=tmp_path, script=lambda device, command: {})
    try:
        assert set(sim.devices["sim-1"].gate.handlers) == set(COMMAND_TYPES)
    finally:
        sim.stop()


def test_the_controllers_rollout_engine_sends_only_registered_types() -> None:
    assert {driver.START, driver.CANCEL, driver.ROLLBACK} <= set(COMMAND_TYPES)
    assert all(COMMAND_TYPES[t].mutating for t in (driver.START, driver.CANCEL,
                                                   driver.ROLLBACK))


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[TestClient, SQLiteStore]]:
    store = SQLiteStore(tmp_path / "controller.db")
    store.birth("f1", "store-1", {"bdseq": 1, "boot_id": "b" * 32}, time.time())
    yield TestClient(create_app(store, ControllerMetrics(store))), store
    store.close()


def _as(store: SQLiteStore, name: str, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {store.operators.create_operator(name, role, 1.0)[0]}"}


@pytest.mark.parametrize(("type_", "args", "error"), [
    ("reboot", {}, "type: no command type 'reboot' (one of ping, rebirth, config.patch"),
    ("keys.revoke", {}, "args.prefix: Field required (keys.revoke takes {\"prefix\": string})"),
    ("config.patch", {"set": {"telemetry.interval_s": "10"}},
     "args.set.telemetry.interval_s: Input should be a valid number"),
    ("rollout.cancel", {}, "args: give rollout_id or name, one of them"),
])
def test_the_controller_refuses_what_the_registry_does_not_hold_before_signing(
        api: tuple[TestClient, SQLiteStore], type_: str, args: dict[str, Any],
        error: str) -> None:
    client, store = api
    sent = client.post("/commands", json={"device": "store-1", "type": type_, "args": args},
                       headers=_as(store, "alice", "operator"))
    assert sent.status_code == 400, sent.text
    assert error in sent.json()["error"]
    assert [(a.action, a.status) for a in store.audit.actions()] == [("command.send", 400)]


def test_the_controller_holds_an_operator_to_the_types_role(
        api: tuple[TestClient, SQLiteStore], monkeypatch: pytest.MonkeyPatch) -> None:
    client, store = api
    wipe = CommandType("box.wipe", "Wipes the box.", IgnoredArgs, IgnoredArgs, role="admin")
    monkeypatch.setattr(command_types, "COMMAND_TYPES", {**COMMAND_TYPES, "box.wipe": wipe})
    body = {"device": "store-1", "type": "box.wipe"}
    refused = client.post("/commands", json=body, headers=_as(store, "alice", "operator"))
    assert refused.status_code == 403
    assert refused.json() == {"error": "operator 'alice' is a operator: box.wipe needs admin"}
    passed = client.post("/commands", json=body, headers=_as(store, "root", "admin"))
    assert passed.status_code == 503  # past the checks: this controller has no key


def test_fleet_send_help_lists_every_type() -> None:
    out = CliRunner().invoke(main, ["fleet", "send", "--help"], terminal_width=100).output
    listed = out.split("Types (")[1]
    for t in COMMAND_TYPES.values():
        assert re.search(rf"^  {re.escape(t.name)} ", listed, re.M), t.name


def test_the_manuals_table_of_commands_is_the_registrys() -> None:
    page = (ROOT / "docs" / "fleet" / "commands.md").read_text()
    region = re.search(r"<!-- generated: command-types -->\n(.*?)<!-- end generated: "
                       r"command-types -->", page, re.S)
    assert region is not None, "docs/fleet/commands.md lost its command-types region"
    table = load_reference().command_types_table()
    assert region.group(1).strip() == table, "run python tools/reference.py --write"
    rows = [line.split("|")[1].strip(" `") for line in table.splitlines()[2:]]
    assert rows == list(COMMAND_TYPES)


def test_the_rollout_starts_help_names_every_capacity_key() -> None:
    """`fleet rollout start --capacity` takes what the protocol ships as a capacity release:
    its help names each key, so an operator never learns one from the source."""
    shown = CliRunner().invoke(main, ["fleet", "rollout", "start", "--help"],
                               terminal_width=200)
    assert shown.exit_code == 0, shown.output
    help_text = " ".join(shown.output.split())
    assert all(key in help_text for key in CAPACITY_KEYS), help_text
