"""A model rollout end to end, with every real part: the controller's signed repository
(`fleet keygen`, `fleet release init|add`), `fleet serve` serving it and ingesting, a real
Mosquitto, and `edge-agent serve` with the real default model and its link on. The central
team starts a rollout with `fleet send`; the box looks the release up through TUF,
downloads it from the controller, installs it, switches while clients stream, runs the
gate and reports every state. A release whose golden prompt fails rolls back by itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_agent.bench.fleet.rollout import variant
from edge_agent.engine.models.catalog import ModelStore
from tests.conftest import DEFAULT_MODEL, clone_state
from tests.support.brokers import Mosquitto
from tests.support.fleetkit import wait_until
from tests.support.rolloutkit import PASSING, Controller, Repository, Streams, cli, start_box

pytestmark = [pytest.mark.integration, pytest.mark.broker]

DEV = "store-ro"
FAILING = {"prompts": [{"id": "marker", "prompt": "Say hi", "max_tokens": 4,
                        "expect": {"contains": ["zebra-quartz-7731"]}}],
           "tokens_per_s_floor": None}


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV,)).start()


@pytest.fixture
def central(broker: Mosquitto, model_cache: Path, tmp_path: Path) -> Iterator[Controller]:
    """The central team's side: keys, a repository with releases 2 (passing gate) and 3
    (failing gate) of the default model, and `fleet serve` serving and ingesting."""
    repo = Repository.create(tmp_path)
    blob = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    for version, letter, gate in (("2", b"T", PASSING), ("3", b"U", FAILING)):
        repo.add(variant(blob, tmp_path / f"v{version}.gguf", letter), DEFAULT_MODEL,
                 version, gate=gate)
    with repo.serve(broker, tmp_path) as controller:
        yield controller


def _rollout_states(central: Controller, rollout_id: str) -> list[str]:
    """The states the controller has stored for one rollout, in order."""
    from edge_agent.fleet.controller.store import SQLiteStore

    store = SQLiteStore(central.ctl / "controller.db")
    try:
        rows = store.messages(DEV, kind="rollout", limit=10_000)
    finally:
        store.close()
    bodies = sorted((m["body"] for m in rows if m["body"].get("rollout_id") == rollout_id
                     and m["body"].get("event") == "rollout.transition"),
                    key=lambda b: b["ts"])
    return [b["to"] for b in bodies]


def _active_in_view(central: Controller, name: str) -> str | None:
    """The digest `fleet devices --json` says is active for `name` on the box."""
    devices = json.loads(cli("fleet", "devices", "--config", str(central.config),
                             "--json").stdout)
    found = [m["digest"] for d in devices if d["device"] == DEV for m in d["models"]
             if m["name"] == name and m["active"]]
    return found[0] if found else None


def test_a_rollout_goes_active_with_zero_failed_requests_and_a_bad_one_rolls_back(
        broker: Mosquitto, central: Controller, model_cache: Path, tmp_path: Path
        ) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    box = start_box(DEV, broker, central, state, tmp_path)
    streams = Streams(DEFAULT_MODEL, [box], per_box=2)  # a store's assistants
    try:
        box.wait_ready(central)
        old = box.digest(DEFAULT_MODEL)
        streams.start()
        sent = cli("fleet", "send", DEV, "rollout.start", "--config", str(central.config),
                   "--arg", "rollout_id=r1", "--arg", f"name={DEFAULT_MODEL}",
                   "--arg", "version=2", "--json")
        assert json.loads(sent.stdout)["results"][0]["result"]["accepted"] is True
        assert wait_until(lambda: "ACTIVE" in _rollout_states(central, "r1"), 180, 0.5), \
            _rollout_states(central, "r1")
        streams.stop()
        assert streams.failures == [] and streams.served[DEV] > 0
        assert _rollout_states(central, "r1") == [
            "RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "ACTIVATING", "GATING", "ACTIVE"]
        new = box.digest(DEFAULT_MODEL)
        assert new != old
        # The controller's view follows without a rebirth (the box's models.state event).
        assert wait_until(lambda: _active_in_view(central, DEFAULT_MODEL) == new, 30, 0.5), \
            _active_in_view(central, DEFAULT_MODEL)
        table = cli("fleet", "devices", "--config", str(central.config)).stdout
        assert f"{DEFAULT_MODEL}@{new[:12]}" in table, table

        cli("fleet", "send", DEV, "rollout.start", "--config", str(central.config),
            "--arg", "rollout_id=r2", "--arg", f"name={DEFAULT_MODEL}", "--arg", "version=3")
        assert wait_until(lambda: "ROLLED_BACK" in _rollout_states(central, "r2"), 180, 0.5), \
            _rollout_states(central, "r2")
        assert box.digest(DEFAULT_MODEL) == new  # version 2 serves again, by itself

        history = json.loads(cli("models", "history", DEFAULT_MODEL, "--json",
                                 "--state-dir", str(state)).stdout)
        outcomes = {e["rollout_id"]: e for e in history["evidence"]}
        assert outcomes["r1"]["outcome"] == "ACTIVE"
        assert outcomes["r2"]["outcome"] == "ROLLED_BACK"
        assert "marker" in json.dumps(outcomes["r2"]["checks"])  # the failing check named
    finally:
        streams.stop()
        box.stop()
