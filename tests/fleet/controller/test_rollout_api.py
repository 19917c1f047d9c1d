"""Rollouts over the controller's API, as an operator at a desk runs them: the same rules
and error text as `fleet rollout`, the same JSON as its `--json`, each action on the audit
trail with its operator, and bodies that do not parse refused in the API's one shape."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.fleet.controller.access import MAX_BODY_BYTES
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.audit import local_operator
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.store import SQLiteStore
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import Mosquitto
from tests.support.releasekit import make_repo
from tests.support.rolloutkit import Repository, cli

NAME = "simmodel:1b"
BOOT = "c" * 32


@pytest.fixture
def state(tmp_path: Path) -> Path:
    make_repo(tmp_path).add(write_tiny_gguf(tmp_path / "m.gguf"), NAME, "2")
    return tmp_path / "state"


@pytest.fixture
def store(state: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(state / "controller.db")
    for i in range(4):
        made.birth("f1", f"d{i}", {"bdseq": 1, "boot_id": BOOT}, 1.0)
    yield made
    made.close()


@pytest.fixture
def api(store: SQLiteStore, state: Path) -> TestClient:
    return TestClient(create_app(store, ControllerMetrics(store), state_dir=state))


def _auth(store: SQLiteStore, name: str, role: str) -> dict[str, str]:
    token, _ = store.operators.create_operator(name, role, 1.0)
    return {"Authorization": f"Bearer {token}"}


def _cli_json(state: Path, *args: str) -> tuple[int, object, str]:
    result = CliRunner().invoke(main, ["fleet", "rollout", *args, "--state-dir", str(state),
                                       "--json"])
    return result.exit_code, (json.loads(result.stdout) if result.stdout.strip() else None), \
        result.stderr


def test_an_operator_starts_and_drives_a_rollout_and_the_trail_names_them(
        api: TestClient, store: SQLiteStore, state: Path) -> None:
    alice = _auth(store, "alice", "operator")
    viewer = _auth(store, "vic", "viewer")
    body = {"release": f"{NAME}@2", "waves": "1,100%", "soak": "10m", "id": "r1"}
    refused = api.post("/rollouts", json=body, headers=viewer)
    assert refused.status_code == 403 and "needs operator" in refused.json()["error"]

    made = api.post("/rollouts", json=body, headers=alice)
    assert made.status_code == 201, made.text
    record = made.json()
    assert (record["id"], record["state"], record["devices_total"], record["waves_total"]) == \
        ("r1", "RUNNING", 4, 2)
    # The same JSON as `fleet rollout … --json` (keys; values of a fresh record).
    code, cli_record, err = _cli_json(state, "start", f"{NAME}@2", "--waves", "1,100%",
                                      "--id", "r2")
    assert code == 1 and "one live rollout per model name (abort it first)" in err, err
    code, paused, _ = _cli_json(state, "pause", "r1")
    assert code == 0 and isinstance(paused, dict)

    resumed = api.post("/rollouts/r1/resume", headers=alice)
    assert resumed.status_code == 200 and set(resumed.json()) == set(paused)
    assert resumed.json()["state"] == "RUNNING" and resumed.json()["reason"] == \
        "resume by alice"
    again = api.post("/rollouts/r1/resume", headers=alice)
    assert again.status_code == 409 and again.json() == \
        {"error": "rollout r1 is RUNNING: cannot go RUNNING (from PAUSED only)"}
    assert api.post("/rollouts/nope/abort", headers=alice).json() == \
        {"error": "no rollout nope"}
    assert api.post("/rollouts/r1/abort", headers=viewer).status_code == 403
    assert api.post("/rollouts/r1/abort", headers=alice).json()["state"] == "ABORTED"

    status = api.get("/rollouts/r1", headers=viewer).json()
    trail = [(a["action"], a["operator"], a["status"]) for a in status["actions"]]
    local = [a for a in status["actions"] if a["source"] == "cli"]
    assert trail[0] == ("rollout.start", "alice", 200)
    assert ("rollout.resume", "alice", 409) in trail and ("rollout.abort", "alice", 200) in trail
    assert len(local) == 1 and local[0]["action"] == "rollout.pause" and \
        local[0]["operator"].startswith("local:") and local[0]["role"] == "host"
    assert all(a["source"] == "testclient" for a in status["actions"] if a not in local)
    # A viewer's attempts never reached a handler; the access check put them on the trail.
    assert [(a.action, a.status) for a in store.audit.actions(operator="vic")] == \
        [("POST /rollouts", 403), ("POST /rollouts/r1/abort", 403)]

    code, shown, _ = _cli_json(state, "status", "r1")
    assert code == 0 and [a["action"] for a in shown["actions"]] == \
        [a["action"] for a in status["actions"]]
    human = CliRunner().invoke(main, ["fleet", "rollout", "status", "r1", "--state-dir",
                                      str(state)])
    assert "start by alice (operator, testclient): done" in human.stdout
    assert "resume by alice (operator, testclient): refused 409" in human.stdout

    audit = CliRunner().invoke(main, ["fleet", "audit", "--operator", "alice", "--json",
                                      "--state-dir", str(state)])
    assert audit.exit_code == 0, audit.stderr
    assert [a["action"] for a in json.loads(audit.stdout)] == \
        ["rollout.start", "rollout.resume", "rollout.resume", "rollout.abort", "rollout.abort"]
    assert api.get("/audit?operator=alice&target=r1", headers=viewer).json()["actions"][0][
        "request"] == {**body, "devices": "all", "abort_above": "10%", "min_executed": 3,
                       "device_timeout": "2h", "rollback_on_abort": False}

    # The model's story on the controller's side: its rollouts, and who acted on each.
    story = api.get(f"/model-history?name={NAME}", headers=viewer).json()
    assert story["name"] == NAME and [r["id"] for r in story["rollouts"]] == ["r1"]
    assert [a["operator"] for a in story["rollouts"][0]["actions"]][0] == "alice"
    assert api.get("/model-history?name=Bad Name!", headers=viewer).status_code == 400
    told = CliRunner().invoke(main, ["fleet", "models", "history", NAME, "--state-dir",
                                     str(state)])
    assert told.exit_code == 0, told.stderr
    assert "1 rollout(s)" in told.stdout and "start by alice" in told.stdout
    assert "abort by alice" in told.stdout and "ABORTED" in told.stdout


@pytest.mark.parametrize(("body", "error"), [
    ({"release": f"{NAME}@2", "waves": "10%,50%"},
     "--waves 10%,50%: the last wave must be 100%"),
    ({"release": f"{NAME}@9", "waves": "100%"}, f"no release {NAME}@9"),
    ({"release": "nonsense", "waves": "100%"}, "'nonsense' is not NAME@VERSION"),
    ({"release": f"{NAME}@2", "waves": "100%", "devices": "d9"},
     "never reported to this controller: d9"),
    ({"release": f"{NAME}@2", "waves": "100%", "soak": "forever"},
     "'forever' is not a duration such as 90s, 10m, 1h30m"),
    ({"release": f"{NAME}@2", "waves": "100%", "device_timeout": "0s"},
     "--soak is ≥ 0 and --device-timeout > 0"),
    ({"release": f"{NAME}@2", "waves": "100%", "id": "bad id"},
     "a rollout id is 1-64 of [A-Za-z0-9_-]"),
])
def test_the_api_refuses_what_the_cli_refuses_with_its_words(
        api: TestClient, store: SQLiteStore, state: Path, body: dict[str, object],
        error: str) -> None:
    auth = _auth(store, "alice", "operator")
    response = api.post("/rollouts", json=body, headers=auth)
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()) == {"error"} and error in response.json()["error"]
    args = [body["release"], "--waves", body["waves"]]
    for key in ("devices", "soak", "device_timeout", "id"):
        if key in body:
            args += [f"--{key.replace('_', '-')}", body[key]]
    result = CliRunner().invoke(main, ["fleet", "rollout", "start", *map(str, args),
                                       "--state-dir", str(state)])
    assert result.exit_code != 0 and error in result.stderr
    assert store.rollouts.rollouts() == []
    trail = store.audit.actions(operator="alice")
    assert len(trail) == 1 and trail[0].status == response.status_code and \
        error in trail[0].outcome


@pytest.mark.parametrize("raw", [
    b"", b"{", b"[]", b'"x"', b"null", b'{"release": 1, "waves": "100%"}',
    b'{"waves": "100%"}', b'{"release": "a@1", "waves": "100%", "extra": true}',
    b'{"release": "' + b"x" * 100_000 + b'@1", "waves": "100%"}',
    b'{"release": "a@1", "waves": "100%", "min_executed": 1e400}',
    b'{"release": "a@1", "waves": "100%", "min_executed": 0}',
    b"\xff\xfe" + b"{}" * 10,
])
def test_hostile_bodies_get_a_400_in_one_shape(api: TestClient, store: SQLiteStore,
                                               raw: bytes) -> None:
    auth = {**_auth(store, "alice", "operator"), "content-type": "application/json"}
    response = api.post("/rollouts", content=raw, headers=auth)
    assert response.status_code == 400, (raw[:60], response.text[:300])
    assert set(response.json()) == {"error"} and response.json()["error"]
    assert store.rollouts.rollouts() == []


@pytest.mark.broker
def test_a_running_controller_takes_tokens_and_drops_a_revoked_one_without_a_restart(
        mosquitto_factory: Callable[..., Mosquitto], tmp_path: Path) -> None:
    """`fleet serve` as the manual runs it; operators made and revoked with the CLI on its
    host while it runs; the API as a desk sees it."""
    repo = Repository.create(tmp_path)
    with repo.serve(mosquitto_factory().start(), tmp_path) as central:
        config = ["--config", str(central.config)]
        assert httpx.get(f"{central.api}/devices").json() == {"devices": []}  # no operator
        token = cli("fleet", "operators", "create", "alice", "--role", "operator",
                    *config).stdout.strip()
        auth = {"Authorization": f"Bearer {token}"}
        refused = httpx.get(f"{central.api}/devices")
        assert refused.status_code == 401 and "fleet operators create" in refused.json()["error"]
        assert httpx.get(f"{central.api}/devices", headers=auth).json() == {"devices": []}
        assert httpx.get(f"{central.api}/metrics").status_code == 200  # loopback: scrapeable
        started = httpx.post(f"{central.api}/rollouts", headers=auth,
                             json={"release": "nothing:1b@1", "waves": "100%"})
        assert started.status_code == 404 and "no release nothing:1b@1" in \
            started.json()["error"]
        cli("fleet", "operators", "revoke", "alice", *config)
        gone = httpx.get(f"{central.api}/devices", headers=auth)  # the next request, no restart
        assert gone.status_code == 401 and gone.json() == \
            {"error": "the operator token is unknown or revoked"}
        trail = json.loads(cli("fleet", "audit", "--json", *config).stdout)
        assert [(a["operator"], a["action"], a["target"], a["status"]) for a in trail] == [
            (local_operator(), "operators.create", "alice", 200),
            ("alice", "rollout.start", None, 404),
            (local_operator(), "operators.revoke", "alice", 200)]
        assert trail[1]["source"] == "127.0.0.1" and trail[1]["role"] == "operator"


def test_a_retired_box_keeps_its_history_and_no_rollout_selects_it(
        api: TestClient, store: SQLiteStore, state: Path) -> None:
    admin = _auth(store, "ada", "admin")
    operator = _auth(store, "otto", "operator")
    assert api.post("/devices/d3/retire", headers=operator).status_code == 403
    retired = api.post("/devices/d3/retire", headers=admin).json()
    assert retired["device"] == "d3" and retired["retired"]["by"] == "ada"
    assert api.post("/devices/nobody/retire", headers=admin).status_code == 404
    listed = {d["device"]: d["retired"] for d in api.get("/devices", headers=admin).json()[
        "devices"]}
    assert listed["d3"] is not None and listed["d0"] is None  # kept, marked

    refused = api.post("/rollouts", headers=operator,
                       json={"release": f"{NAME}@2", "waves": "100%", "devices": "d3"})
    assert refused.status_code == 400 and refused.json()["error"] == \
        "d3 is retired (fleet devices restore d3 first)"
    made = api.post("/rollouts", headers=operator,
                    json={"release": f"{NAME}@2", "waves": "100%", "id": "all-but-d3"})
    assert made.json()["devices_total"] == 3
    assert "d3" not in {d.device for d in store.rollouts.rollout_devices("all-but-d3")}

    shown = CliRunner().invoke(main, ["fleet", "devices", "--state-dir", str(state)])
    assert shown.exit_code == 0 and any(
        line.startswith("d3") and "retired" in line for line in shown.stdout.splitlines())
    back = CliRunner().invoke(main, ["fleet", "devices", "restore", "d3", "--state-dir",
                                     str(state)])
    assert back.exit_code == 0 and "restored d3" in back.stdout, back.stderr
    assert store.device("d3")["retired"] is None  # type: ignore[index]
    # The operator's refused retire is filed under d3 too.
    assert [(a.action, a.operator, a.status) for a in store.audit.actions(target="d3")] == [
        ("POST /devices/d3/retire", "otto", 403), ("device.retire", "ada", 200),
        ("device.restore", local_operator(), 200)]


def test_a_body_too_large_or_without_a_length_is_refused_before_it_is_read(
        api: TestClient, store: SQLiteStore) -> None:
    auth = {**_auth(store, "alice", "operator"), "content-type": "application/json"}
    big = api.post("/rollouts", content=b" " * (MAX_BODY_BYTES + 1), headers=auth)
    assert big.status_code == 413 and "at most" in big.json()["error"]

    def chunks() -> Iterator[bytes]:
        yield b'{"release": "a@1", "waves": "100%"}'

    chunked = api.post("/rollouts", content=chunks(), headers=auth)
    assert chunked.status_code == 411 and set(chunked.json()) == {"error"}
    assert store.rollouts.rollouts() == []
