"""A rollout in waves to two real agents: `fleet rollout start --waves 1,100%` on the real
controller (`fleet serve` signing and publishing), a real Mosquitto, two `edge-agent
serve` with the real default model and their links on, clients streaming on both boxes
all along. Both boxes end ACTIVE, the second only after the first soaked, their evidence
rows exist (on the box and synced to the controller), and no client request fails.

The release is the default model with one letter of its name changed (the approach of
`test_fleet_rollout_e2e`), not gemma3:270m: another digest that loads and answers as
fast, which keeps this test well under a minute of CI.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.engine.catalog import ModelStore
from edge_agent.fleet.controller.store import SQLiteStore
from tests.brokers import Mosquitto
from tests.conftest import DEFAULT_MODEL, clone_state
from tests.fleetkit import wait_until
from tests.rolloutkit import PASSING, Controller, Repository, Streams, cli, start_box, variant

pytestmark = [pytest.mark.integration, pytest.mark.broker]

BOXES = ("store-w1", "store-w2")
RID = "rw-two"


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=BOXES).start()


@pytest.fixture
def central(broker: Mosquitto, model_cache: Path, tmp_path: Path) -> Iterator[Controller]:
    repo = Repository.create(tmp_path)
    blob = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    repo.add(variant(blob, tmp_path / "v2.gguf", b"W"), DEFAULT_MODEL, "2", gate=PASSING)
    with repo.serve(broker, tmp_path, "rollout_tick_s = 0.5\n") as controller:
        yield controller


def _rollout(central: Controller) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["fleet", "rollout", "status", RID, "--json",
                                       "--config", str(central.config)])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def test_two_agents_in_waves_end_active_with_zero_failed_requests(
        broker: Mosquitto, central: Controller, model_cache: Path, tmp_path: Path
        ) -> None:
    boxes = {name: start_box(name, broker, central,
                             clone_state(model_cache, tmp_path / f"state-{name}"), tmp_path)
             for name in BOXES}
    streams = Streams(DEFAULT_MODEL, list(boxes.values()))  # each store's assistant
    try:
        for box in boxes.values():
            box.wait_ready(central)
        old = {name: box.digest(DEFAULT_MODEL) for name, box in boxes.items()}
        streams.start()
        started = CliRunner().invoke(main, [
            "fleet", "rollout", "start", f"{DEFAULT_MODEL}@2", "--id", RID, "--waves",
            "1,100%", "--soak", "2s", "--min-executed", "1", "--abort-above", "0%",
            "--device-timeout", "5m", "--config", str(central.config)])
        assert started.exit_code == 0, started.output
        assert wait_until(lambda: _rollout(central)["state"] != "RUNNING", 150, 0.5), \
            _rollout(central)
        streams.stop()
        report = _rollout(central)
        assert report["state"] == "COMPLETED", report
        assert report["states"] == {"ACTIVE": 2}
        assert streams.failures == [] and all(n > 0 for n in streams.served.values()), \
            (streams.failures, streams.served)
        rows = {d["device"]: d for d in report["devices"]}
        first, second = sorted(BOXES, key=lambda n: rows[n]["wave"])
        assert (rows[first]["wave"], rows[second]["wave"]) == (1, 2)
        assert rows[second]["started_at"] >= rows[first]["active_at"] + 2.0  # soaked first
        for name, box in boxes.items():
            assert box.digest(DEFAULT_MODEL) != old[name]
            history = json.loads(cli("models", "history", DEFAULT_MODEL, "--json",
                                     "--state-dir", str(box.state)).stdout)
            evidence = [e for e in history["evidence"] if e["rollout_id"] == RID]
            assert [e["outcome"] for e in evidence] == ["ACTIVE"]
        store = SQLiteStore(central.ctl / "controller.db")
        try:
            assert wait_until(lambda: all(any(
                m["body"].get("event") == "rollout.evidence"
                and m["body"].get("rollout_id") == RID
                for m in store.messages(name, kind="rollout", limit=1000)) for name in BOXES),
                30, 0.5)
        finally:
            store.close()
    finally:
        streams.stop()
        for box in boxes.values():
            box.stop()
