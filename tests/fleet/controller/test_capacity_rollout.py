"""A capacity change shipped as a gated release, with every real part: the controller's
signed repository, `fleet serve` driving `fleet rollout start … --capacity`, a real
Mosquitto and two `edge-agent serve` boxes with the real default model and their links on.

The release `smollm2:135m@2` is the very file both boxes serve (its golden set is what
gates the change): a short question and a long context. The rollout ships
`parallel=2,context_length=192` to both at once. The same change means different things on
the two boxes, as on a real fleet: store-cap-a keeps a context of its own for the model
(`[models."smollm2:135m"] context_length = 512` in its config file), so only `parallel`
reaches its model and its gate passes; store-cap-b takes the runtime's context, 192 tokens,
too small for the long-context prompt: its gate fails on that check, and it restores its
previous settings by itself. One failed box of two is above the rollout's 10%: it aborts.

Then `config.patch` of a capacity key: refused without `--ungated`, naming the rollout
path; taken with it, and marked in the box's evidence and the controller's audit trail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.sim.testbed import find_mosquitto
from tests.conftest import DEFAULT_MODEL, clone_state
from tests.support.brokers import Mosquitto
from tests.support.fleetkit import wait_until
from tests.support.rolloutkit import Box, Controller, Repository, cli, start_box

pytestmark = [pytest.mark.integration, pytest.mark.broker]

A, B = "store-cap-a", "store-cap-b"
RID = "cap-1"
DEVICE_TIMEOUT_S = 300
# About 250 tokens: answered in a 512-token context, refused in a 192-token one.
LONG = ("Here is the list of today's deliveries: "
        + ", ".join(f"crate {i} of apples" for i in range(40))
        + ". Which crate came first?")
GATE = {"prompts": [{"id": "hello", "prompt": "Hello", "max_tokens": 4,
                     "expect": {"max_output_tokens": 4}},
                    {"id": "long", "prompt": LONG, "max_tokens": 4,
                     "expect": {"max_output_tokens": 4}}],
        "tokens_per_s_floor": None}  # speed measured against the baseline, not held
OWN_CONTEXT = f'[models."{DEFAULT_MODEL}"]\ncontext_length = 512\n'


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = Mosquitto(tmp_path_factory.mktemp("broker"), devices=(A, B)).start()
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def central(broker: Mosquitto, model_cache: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Controller]:
    """Release 2 of the default model: the boxes' own file, with the golden set."""
    tmp = tmp_path_factory.mktemp("central")
    repo = Repository.create(tmp)
    blob = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    repo.add(blob, DEFAULT_MODEL, "2", gate=GATE)
    with repo.serve(broker, tmp, "rollout_tick_s = 0.5\n") as controller:
        yield controller


@pytest.fixture(scope="module")
def box_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("boxes")


@pytest.fixture(scope="module")
def boxes(broker: Mosquitto, central: Controller, model_cache: Path, box_dir: Path
          ) -> Iterator[dict[str, Box]]:
    """The two boxes, stopped at the end (a test that restarts one puts it back here)."""
    tmp = box_dir
    started = {name: start_box(name, broker, central,
                               clone_state(model_cache, tmp / f"state-{name}"), tmp,
                               extra=OWN_CONTEXT if name == A else "")
               for name in (A, B)}
    try:
        for box in started.values():
            box.wait_ready(central)
        yield started
    finally:
        for box in started.values():
            box.stop()


def _report(central: Controller) -> dict[str, Any]:
    done = cli("fleet", "rollout", "status", RID, "--json", "--config", str(central.config))
    return dict(json.loads(done.stdout))


def _evidence(box: Box, rollout_id: str) -> list[dict[str, Any]]:
    history = json.loads(cli("models", "history", DEFAULT_MODEL, "--json", "--state-dir",
                             str(box.state)).stdout)
    return [e for e in history["evidence"] if e["rollout_id"] == rollout_id]


def _served(box: Box) -> dict[str, Any]:
    """The default model as loaded (`/api/ps`): its context and parallel."""
    ps = httpx.get(f"{box.base}/api/ps", timeout=10).json()["models"]
    return dict(next(m for m in ps if m["name"] == DEFAULT_MODEL))


def _overlay(box: Box) -> dict[str, Any]:
    path = box.state / "config.overlay.json"
    return dict(json.loads(path.read_text())["set"]) if path.exists() else {}


def _long_answered(box: Box) -> int:
    r = httpx.post(f"{box.base}/api/generate", timeout=120, json={
        "model": DEFAULT_MODEL, "prompt": LONG, "stream": False,
        "options": {"num_predict": 4, "temperature": 0}})
    return r.status_code


def test_a_capacity_change_goes_active_where_its_gate_passes_and_rolls_back_where_not(
        broker: Mosquitto, central: Controller, boxes: dict[str, Box], box_dir: Path
        ) -> None:
    before = {name: _served(box) for name, box in boxes.items()}
    assert before[A]["context_length"] == 512 and before[B]["context_length"] == 512
    started = cli("fleet", "rollout", "start", f"{DEFAULT_MODEL}@2", "--id", RID,
                  "--capacity", "parallel=2,context_length=192", "--waves", "100%",
                  "--abort-above", "10%", "--min-executed", "2",
                  "--device-timeout", f"{DEVICE_TIMEOUT_S}s", "--config", str(central.config))
    assert "capacity parallel=2,context_length=192" in started.stdout, started.stdout
    assert wait_until(lambda: _report(central)["state"] != "RUNNING",
                      DEVICE_TIMEOUT_S + 60, 0.5), _report(central)
    report = _report(central)
    assert report["state"] == "ABORTED", json.dumps(report)
    assert "1 of 2 finished devices failed" in report["reason"], report["reason"]
    assert report["config"] == {"parallel": 2, "context_length": 192}
    assert {d["device"]: d["state"] for d in report["devices"]} == {
        A: "ACTIVE", B: "ROLLED_BACK"}, json.dumps(report["devices"])

    # A: serving with the new settings (its own context kept), written to the overlay,
    # which `edge-agent serve` applies over the config file at every start.
    assert wait_until(lambda: _evidence(boxes[A], RID), 30, 0.5)
    [active] = _evidence(boxes[A], RID)
    assert active["outcome"] == "ACTIVE", active
    capacity = active["parameters"]["capacity"]
    assert capacity["change"] == {"parallel": 2, "context_length": 192}
    assert capacity["after"]["parallel"] == 2 and capacity["after"]["context_length"] == 512
    passed = {c["name"] for c in active["checks"] if c["passed"]}
    assert {"prompt:hello:max_output_tokens", "prompt:long:max_output_tokens",
            "prompt:hello:baseline", "prompt:long:baseline", "tokens_per_s",
            "ttft_vs_baseline", "burst", "served_digest"} <= passed, active["checks"]
    assert _served(boxes[A])["parallel"] == 2
    assert _served(boxes[A])["context_length"] == 512
    assert _overlay(boxes[A]) == {"runtime.parallel": 2, "runtime.context_length": 192}

    # B: rolled back by itself, the failing check named, its previous settings serving.
    [back] = _evidence(boxes[B], RID)
    assert back["outcome"] == "ROLLED_BACK", back
    assert back["reason"].startswith("gate check prompt:long:answered failed"), back["reason"]
    failed = {c["name"] for c in back["checks"] if not c["passed"]}
    assert {"prompt:long:answered", "prompt:long:baseline"} <= failed, back["checks"]
    assert back["parameters"]["capacity"]["before"]["context_length"] == 512
    assert back["parameters"]["capacity"]["after"]["context_length"] == 192
    assert _overlay(boxes[B]) == {}
    assert _served(boxes[B]) == {**_served(boxes[B]), "context_length": 512,
                                 "parallel": before[B]["parallel"]}
    assert _long_answered(boxes[B]) == 200
    shown = cli("models", "history", DEFAULT_MODEL, "--state-dir", str(boxes[B].state)).stdout
    assert "capacity  {\"context_length\": 192, \"parallel\": 2}: context_length 512→192" \
        in shown, shown

    # A restart keeps what passed the gate: the overlay beats the config file.
    boxes[A].stop()
    boxes[A] = start_box(A, broker, central, boxes[A].state, box_dir, extra=OWN_CONTEXT)
    boxes[A].wait_ready(central)
    assert (_served(boxes[A])["parallel"], _served(boxes[A])["context_length"]) == (2, 512)
    for name, row in ((A, active), (B, back)):
        print("checks", name, json.dumps([(c["name"], c["passed"], c["figure"])
                                          for c in row["checks"]]))
    print("evidence", json.dumps({A: {k: active[k] for k in ("outcome", "reason")},
                                  B: {k: back[k] for k in ("outcome", "reason")}}))
    print("parameters", json.dumps({A: active["parameters"], B: back["parameters"]}))


def test_a_capacity_key_by_config_patch_needs_ungated_and_is_marked(
        central: Controller, boxes: dict[str, Box]) -> None:
    patch = ["fleet", "send", B, "config.patch", "--config", str(central.config), "--json",
             "--arg", 'set={"runtime.threads": 2}']
    refused = json.loads(cli(*patch, check=False).stdout)["results"][0]
    said = json.dumps(refused["result"])
    assert (refused["status"], refused["reason"]) == ("refused", "malformed"), refused
    assert "capacity setting" in said and "fleet rollout start" in said \
        and "--ungated" in said, said
    assert "runtime.threads" not in _overlay(boxes[B])

    sent = json.loads(cli(*patch, "--ungated").stdout)
    taken = sent["results"][0]
    assert taken["status"] == "ok", taken
    assert taken["result"]["ungated"] is True
    assert taken["result"]["on_restart"] == ["runtime.threads"]
    assert _overlay(boxes[B]) == {"runtime.threads": 2}
    marked = _evidence(boxes[B], f"config.patch:{sent['command']['id']}")
    assert [e["outcome"] for e in marked] == ["UNGATED"], marked
    assert marked[0]["parameters"]["ungated"] is True
    assert marked[0]["parameters"]["change"] == {"runtime.threads": 2}
    assert (marked[0]["parameters"]["before"]["threads"],
            marked[0]["parameters"]["after"]["threads"]) == (1, 2)

    store = SQLiteStore(central.ctl / "controller.db")
    try:
        actions = [(a.action, a.status) for a in store.audit.actions()]
    finally:
        store.close()
    # The refused one went out as any command; the ungated one is marked as such.
    assert actions.count(("command.send", 200)) == 1, actions
    assert actions.count(("command.send.ungated", 200)) == 1, actions
