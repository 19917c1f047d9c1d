"""The periodic review against a real box: a production release of the default model
(its rollback target the version the box came with) rolled out through `fleet serve` and a
real Mosquitto to `edge-agent serve`; `fleet review --verify` asks the box, by a signed
`model.verify`, whether the rollback target's blob is there, intact and loads — yes; once
that blob is removed from the box, the review flags it, naming the box, and exits 1."""

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
from tests.support.rolloutkit import PASSING, Controller, Repository, cli, get_json, start_box

pytestmark = [pytest.mark.integration, pytest.mark.broker]

DEV = "store-rv"


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV,)).start()


@pytest.fixture
def central(broker: Mosquitto, model_cache: Path, tmp_path: Path
            ) -> Iterator[tuple[Controller, str]]:
    """Release 1 is the default model as the box has it; release 2, a production one,
    names 1 as its rollback target. Yields the controller and release 1's digest."""
    repo = Repository.create(tmp_path)
    blob = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    first = tmp_path / "v1.gguf"
    first.write_bytes(blob.read_bytes())
    repo.add(first, DEFAULT_MODEL, "1", gate=PASSING)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"kind": k}) + "\n" for k in (
        "ollama", "openai", "schema", "tools", "long_context")))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"accuracy": 0.91}))
    repo.add(variant(blob, tmp_path / "v2.gguf", b"T"), DEFAULT_MODEL, "2", gate=PASSING,
             options=["--stage", "production", "--license", "Apache-2.0",
                      "--eval-samples", str(samples), "--eval-results", str(results),
                      "--build", "llama.cpp 0.3.36 Q4_1", "--route", "local",
                      "--degradation", "upstream pool", "--rollback-target", "1",
                      "--review-by", "2099-01-01"])
    digest = ModelStore(model_cache).get(DEFAULT_MODEL).digest
    with repo.serve(broker, tmp_path, settings="rollout_tick_s = 0.3\n") as controller:
        yield controller, digest


def _review(central: Controller) -> tuple[int, dict]:
    done = cli("fleet", "review", "--verify", "--sample", "1", "--wait", "60", "--json",
               "--config", str(central.config), check=False)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def test_the_review_flags_a_rollback_target_removed_from_a_box(
        broker: Mosquitto, central: tuple[Controller, str], model_cache: Path,
        tmp_path: Path) -> None:
    controller, first = central
    state = clone_state(model_cache, tmp_path / "state")
    box = start_box(DEV, broker, controller, state, tmp_path)
    try:
        box.wait_ready(controller)
        started = json.loads(cli("fleet", "rollout", "start", f"{DEFAULT_MODEL}@2",
                                 "--waves", "100%", "--json",
                                 "--config", str(controller.config)).stdout)

        def state_of() -> str:
            found = get_json(f"{controller.api}/rollouts/{started['id']}") or {}
            return str(found.get("state"))

        assert wait_until(lambda: state_of() == "COMPLETED", 240, 0.5), state_of()
        # The box says it serves the model (what the sample is drawn from).
        assert wait_until(lambda: any(m["name"] == DEFAULT_MODEL for m in (
            get_json(f"{controller.api}/devices/{DEV}") or {}).get("models", [])), 30, 0.5)

        code, found = _review(controller)
        m = found["models"][0]
        assert (m["name"], m["version"], m["rollout"]) == (DEFAULT_MODEL, "2", started["id"])
        assert [(a["device"], a["present"], a["verified"], a["loads"])
                for a in m["verified"]] == [(DEV, True, True, True)], m
        assert m["flags"] == [] and code == 0, m["flags"]

        (state / "blobs" / f"sha256-{first.removeprefix('sha256:')}").unlink()
        code, found = _review(controller)
        m = found["models"][0]
        assert code == 1
        assert [(a["device"], a["present"]) for a in m["verified"]] == [(DEV, False)], m
        assert any(f.startswith("rollback target 1 is missing or broken on 1 of 1 box(es) "
                                f"asked: {DEV}: ") for f in m["flags"]), m["flags"]
    finally:
        box.stop()
