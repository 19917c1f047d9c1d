"""`fleet send` over the controller's API: the controller signs with its own key, records,
publishes on the real broker and collects the results; operators only; the same refusals
as the CLI, in the API's shape; every send on the audit trail."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.config.controller import load_controller_settings
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.commands import CommandSender
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.protocol.signing import load_public, verify
from tests.support.brokers import FLEET, Mosquitto, MQTTClient
from tests.support.fleetkit import Signer

pytestmark = pytest.mark.broker

DEV = "store-a"
TOPIC = f"edge/v1/{FLEET}/{DEV}/cmd"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(tmp_path / "controller.db")
    made.birth(FLEET, DEV, {"bdseq": 1, "boot_id": "b" * 32}, time.time())
    yield made
    made.close()


@pytest.fixture
def device(mosquitto: Mosquitto) -> Iterator[MQTTClient]:
    client = MQTTClient(mosquitto, DEV)
    assert not client.connect().is_failure
    client.subscribe(TOPIC)
    yield client
    client.close()


def _sender(mosquitto: Mosquitto, tmp_path: Path) -> tuple[CommandSender, Signer]:
    signer = Signer(tmp_path)
    settings = load_controller_settings(None, **{
        "state_dir": tmp_path, "broker.url": mosquitto.url,
        "broker.password_file": mosquitto.password_file("controller")})
    return CommandSender(settings, signer.key), signer


def test_an_operator_sends_a_signed_command_and_gets_the_box_result(
        store: SQLiteStore, device: MQTTClient, mosquitto: Mosquitto, tmp_path: Path) -> None:
    sender, signer = _sender(mosquitto, tmp_path)
    api = TestClient(create_app(store, ControllerMetrics(store), commands=sender))
    create = store.operators.create_operator
    alice = {"Authorization": f"Bearer {create('alice', 'operator', 1.0)[0]}"}
    viewer = {"Authorization": f"Bearer {create('vic', 'viewer', 1.0)[0]}"}
    assert api.post("/commands", json={"device": DEV, "type": "ping"},
                    headers=viewer).status_code == 403

    def answer() -> None:  # the box's result, as the ingest would store it
        if device.wait(lambda: bool(device.received(TOPIC)), 20):
            cid = json.loads(device.received(TOPIC)[0][1])["id"]
            store.command_result(DEV, {"id": cid, "status": "ok", "type": "ping",
                                       "result": {"pong": True}}, time.time())

    box = threading.Thread(target=answer)
    box.start()
    sent = api.post("/commands", json={"device": DEV, "type": "ping", "args": {"n": 1},
                                       "wait_s": 20}, headers=alice)
    box.join()
    assert sent.status_code == 200, sent.text
    body = sent.json()
    published = json.loads(device.received(TOPIC)[0][1])
    assert published == body["command"]
    assert verify(published, load_public(signer.public_path))["args"] == {"n": 1}
    assert (published["device"], published["fleet"], published["type"]) == (DEV, FLEET, "ping")
    assert [(r["device"], r["status"], r["result"]) for r in body["results"]] == \
        [(DEV, "ok", {"pong": True})]
    assert body["missing"] == []

    quick = api.post("/commands", json={"device": DEV, "type": "ping", "wait_s": 0},
                     headers=alice).json()
    assert quick["results"] == [] and quick["missing"] == [DEV]
    assert quick["command"]["seq"] == published["seq"] + 1  # the stream's next

    trail = store.audit.actions(operator="alice")
    assert [(a.action, a.target, a.status) for a in trail] == \
        [("command.send", DEV, 200), ("command.send", DEV, 200)]
    assert trail[0].request["args"] == {"n": 1}


@pytest.mark.parametrize(("body", "status", "error"), [
    ({"device": "nobody", "type": "ping"}, 404,
     "device 'nobody' has never reported to this controller"),
    ({"device": DEV, "all": True, "type": "ping"}, 400, "name one device, or all"),
    ({"type": "ping"}, 400, "name one device, or all"),
    ({"device": "bad id!", "type": "ping"}, 400, "device id"),
    ({"device": DEV, "type": "ping", "wait_s": 61}, 400, "wait_s"),
    ({"device": DEV, "type": ""}, 400, "type"),
    ({"device": DEV, "type": "ping", "args": [1]}, 400, "args"),
    ({"device": DEV, "type": "ping", "args": {"x": "y" * 70_000}}, 400,
     "the command is over"),
])
def test_what_cannot_be_sent_is_refused_in_one_shape(
        store: SQLiteStore, mosquitto: Mosquitto, tmp_path: Path, body: dict[str, object],
        status: int, error: str) -> None:
    sender, _ = _sender(mosquitto, tmp_path)
    api = TestClient(create_app(store, ControllerMetrics(store), commands=sender))
    token = store.operators.create_operator('alice', 'operator', 1.0)[0]
    auth = {"Authorization": f"Bearer {token}"}
    response = api.post("/commands", json=body, headers=auth)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and error in response.json()["error"]


def test_a_controller_without_a_key_says_so(store: SQLiteStore) -> None:
    api = TestClient(create_app(store, ControllerMetrics(store)))
    auth = {"Authorization": f"Bearer {store.operators.create_operator('alice', 'admin', 1.0)[0]}"}
    response = api.post("/commands", json={"device": DEV, "type": "ping"}, headers=auth)
    assert response.status_code == 503
    assert response.json() == {"error": "this controller has no command_signing_key_file: "
                                        "it cannot sign commands"}
    assert [(a.action, a.status) for a in store.audit.actions()] == [("command.send", 503)]


def test_the_cli_refuses_the_same_and_leaves_it_on_the_trail(store: SQLiteStore,
                                                              tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    state = ["--state-dir", str(tmp_path), "--key", str(signer.private_path)]
    nobody = CliRunner().invoke(main, ["fleet", "send", "nobody", "ping", *state])
    assert nobody.exit_code == 1
    assert "edge-agent: device 'nobody' has never reported to this controller" in nobody.stderr
    store.birth("f2", "store-b", {"bdseq": 1, "boot_id": "c" * 32}, time.time())
    both = CliRunner().invoke(main, ["fleet", "send", "--all", "ping", *state])
    assert both.exit_code == 2 and "--all needs --fleet (this controller knows 2 fleets)" in \
        both.stderr
    assert [(a.action, a.target, a.status, a.source) for a in store.audit.actions()] == [
        ("command.send", "nobody", 404, "cli"), ("command.send", "all", 400, "cli")]
