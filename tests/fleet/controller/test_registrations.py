"""Boxes registered before they report (`registrations`): on both databases, through the
API (admin only, on the audit trail), from the CLI, in `/metrics` and in the console's
fleet list; never selected by a rollout until their first birth."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.fleet.controller import registrations
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.audit import local_operator
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.store import ControllerStore, SQLiteStore
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import make_repo

BOOT = "c" * 32


def test_a_registration_lists_a_box_as_never_seen_until_its_birth(
        store: ControllerStore) -> None:
    assert store.register(["s1", "s2"], fleet="f1", by="ada", now=10.0) == ["s1", "s2"]
    assert store.register(["s2", "s3"], fleet="other", by="bob", now=20.0) == ["s3"]
    assert store.registrations()["s2"] == {"fleet": "f1", "at": 10.0, "by": "ada"}
    listed = {d["device"]: d for d in registrations.listed(store)}
    assert sorted(listed) == ["s1", "s2", "s3"]
    s1 = listed["s1"]
    assert s1["never_seen"] and not s1["online"] and s1["last_seen"] is None
    assert s1["agent_version"] is None and s1["models"] == [] and s1["loss"]["missing"] == 0
    assert s1["registered"] == {"at": 10.0, "by": "ada"}
    assert store.devices() == []  # what rollouts select from: nothing reported yet

    store.birth("f1", "s1", {"bdseq": 1, "boot_id": BOOT, "agent_version": "9.9.9"}, 30.0)
    store.birth("f1", "walk-in", {"bdseq": 1, "boot_id": BOOT}, 31.0)
    listed = {d["device"]: d for d in registrations.listed(store)}
    assert not listed["s1"]["never_seen"] and listed["s1"]["online"]
    assert listed["s1"]["agent_version"] == "9.9.9"
    assert listed["s1"]["registered"] == {"at": 10.0, "by": "ada"}
    assert listed["walk-in"]["registered"] is None and not listed["walk-in"]["never_seen"]
    assert [d["device"] for d in store.devices()] == ["s1", "walk-in"]
    assert registrations.one(store, "s3")["never_seen"]  # type: ignore[index]
    assert registrations.one(store, "nobody") is None

    assert store.unregister("s3") and not store.unregister("s3")
    assert store.unregister("s1")  # its history stays: it reported
    assert [d["device"] for d in registrations.listed(store)] == ["s1", "s2", "walk-in"]


def test_admins_register_through_the_api_and_rollouts_wait_for_a_birth(
        tmp_path: Path) -> None:
    make_repo(tmp_path).add(write_tiny_gguf(tmp_path / "m.gguf"), "simmodel:1b", "2")
    state = tmp_path / "state"
    store = SQLiteStore(state / "controller.db")
    try:
        store.birth("f1", "d0", {"bdseq": 1, "boot_id": BOOT}, 1.0)
        api = TestClient(create_app(store, ControllerMetrics(store), state_dir=state))
        create = store.operators.create_operator
        admin = {"Authorization": f"Bearer {create('ada', 'admin', 1.0)[0]}"}
        operator = {"Authorization": f"Bearer {create('otto', 'operator', 1.0)[0]}"}
        body = {"devices": ["d1", "d2", "d0"], "fleet": "f1"}
        assert api.post("/devices", json=body, headers=operator).status_code == 403
        made = api.post("/devices", json=body, headers=admin)
        assert made.status_code == 200, made.text
        assert made.json() == {"fleet": "f1", "registered": ["d0", "d1", "d2"], "known": []}
        again = api.post("/devices", json={"devices": ["d1"], "fleet": "f1"}, headers=admin)
        assert again.json() == {"fleet": "f1", "registered": [], "known": ["d1"]}
        for bad, words in (({"devices": ["no/slash"]}, "device"),
                           ({"devices": []}, "devices"),
                           ({"devices": ["d9"], "fleet": "a b"}, "fleet"),
                           ({"devices": ["d9"], "extra": 1}, "extra")):
            refused = api.post("/devices", json=bad, headers=admin)
            assert refused.status_code == 400 and words in refused.json()["error"], bad

        listed = {d["device"]: d for d in api.get("/devices", headers=admin).json()["devices"]}
        assert [listed[d]["never_seen"] for d in ("d0", "d1", "d2")] == [False, True, True]
        assert listed["d1"]["registered"]["by"] == "ada"
        assert api.get("/devices/d2", headers=admin).json()["never_seen"] is True
        assert api.get("/devices/d7", headers=admin).status_code == 404
        scraped = api.get("/metrics", headers=admin).text
        assert "edge_fleet_devices_never_seen 2.0" in scraped
        assert "edge_fleet_devices 1.0" in scraped

        started = api.post("/rollouts", headers=operator, json={
            "release": "simmodel:1b@2", "waves": "100%", "id": "r1"})
        assert started.status_code == 201 and started.json()["devices_total"] == 1
        named = api.post("/rollouts", headers=operator, json={
            "release": "simmodel:1b@2", "waves": "100%", "devices": "d1", "id": "r2"})
        assert named.status_code == 400, named.text

        page = api.get("/", headers=admin)
        assert page.status_code == 200 and "never seen" in page.text and "d2" in page.text

        assert api.post("/devices/d1/unregister", headers=operator).status_code == 403
        assert api.post("/devices/d1/unregister", headers=admin).json() == {
            "device": "d1", "registered": None}
        gone = api.post("/devices/d1/unregister", headers=admin)
        assert gone.status_code == 404 and "is not registered" in gone.json()["error"]
        # (a body that does not parse never reaches the route: not an action)
        trail = [(a.action, a.operator, a.status) for a in store.audit.actions()
                 if a.action.startswith("device.")]
        assert trail == [("device.register", "ada", 200), ("device.register", "ada", 200)] + \
            [("device.register", "ada", 400)] * 2 + \
            [("device.unregister", "ada", 200), ("device.unregister", "ada", 404)]
    finally:
        store.close()


def test_the_cli_registers_and_lists_never_seen_boxes(tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path)]
    run = CliRunner().invoke
    made = run(main, ["fleet", "devices", "register", "store-1", "store-2", "--fleet",
                      "acme", *state])
    assert made.exit_code == 0, made.output
    assert made.stdout.strip() == "registered 2 device(s) in fleet acme: store-1, store-2"
    again = run(main, ["fleet", "devices", "register", "store-2", "--fleet", "acme", "--json",
                       *state])
    assert json.loads(again.stdout) == {"fleet": "acme", "registered": [], "known": ["store-2"]}
    table = run(main, ["fleet", "devices", *state])
    rows = [line.split() for line in table.stdout.splitlines()[1:] if line.strip()]
    assert [(r[0], r[1], " ".join(r[2:4])) for r in rows] == [
        ("store-1", "acme", "never seen"), ("store-2", "acme", "never seen")]
    listed = json.loads(run(main, ["fleet", "devices", "--json", *state]).stdout)
    assert {d["device"]: d["registered"]["by"] for d in listed} == {
        "store-1": local_operator(), "store-2": local_operator()}
    bad = run(main, ["fleet", "devices", "register", "bad/id", *state])
    assert bad.exit_code == 2 and "device" in bad.stderr
    gone = run(main, ["fleet", "devices", "unregister", "store-1", *state])
    assert gone.exit_code == 0 and gone.stdout.strip() == "unregistered store-1"
    assert [d["device"] for d in json.loads(
        run(main, ["fleet", "devices", "--json", *state]).stdout)] == ["store-2"]
