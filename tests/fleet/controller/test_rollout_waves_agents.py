"""A rollout of gemma3:270m in waves to two real agents: `fleet rollout start --waves
1,100%` on the real controller (`fleet serve` signing and publishing), a real Mosquitto,
two `edge-agent serve` serving gemma3:270m as installed from the catalog (version 1),
their links on, clients streaming chat to it on both boxes all along. Both boxes end
ACTIVE, the second only after the first soaked, their evidence rows exist (on the box and
synced to the controller), no client request fails, and version 2 answers chats after the
switch.

gemma3:270m is a base model: its GGUF has no chat template, the catalog supplies one. The
release (the catalog's file with one letter of its name changed: another digest) carries
the catalog's template and parameters, as the central team publishes a base model (one
without would roll back before its switch: `device/test_activation`); its golden prompt
fits a base model: a chat through that template, held to its length.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from edge_agent.bench.fleet.rollout import variant
from edge_agent.cli import main
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.controller.store import SQLiteStore
from tests.conftest import clone_state
from tests.support.brokers import Mosquitto
from tests.support.fleetkit import wait_until
from tests.support.rolloutkit import Box, Controller, Repository, Streams, cli, start_box

pytestmark = [pytest.mark.integration, pytest.mark.broker]

BOXES = ("store-w1", "store-w2")
RID = "rw-two"
DEVICE_TIMEOUT_S = 300
SOAK_S = 2
GEMMA = "gemma3:270m"
BOX_ENV = {"EDGE_AGENT_DEFAULT_MODEL": GEMMA}  # loaded at start: /ready says when
# A golden prompt a base model passes: a chat through the release's template, held to
# its length, not to what it says (a base model follows no instruction, and a `prompt` is
# templated too); and the memory left with both versions loaded.
GATE = {"prompts": [{"id": "chat", "max_tokens": 4, "expect": {"max_output_tokens": 4},
                     "messages": [{"role": "user", "content": "Count to five."}]}],
        "memory_headroom_bytes": 64 << 20, "tokens_per_s_floor": None}


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=BOXES).start()


@pytest.fixture(scope="module")
def gemma_state(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's state with gemma3:270m installed from the catalog too: version 1,
    what the boxes serve before the rollout (each box a clone)."""
    state = clone_state(model_cache, tmp_path_factory.mktemp("gemma") / "state")
    store = ModelStore(state)
    store.pull(GEMMA)
    store.close()  # models.db checkpointed: clones copy one file
    return state


@pytest.fixture
def central(broker: Mosquitto, gemma_state: Path, tmp_path: Path) -> Iterator[Controller]:
    repo = Repository.create(tmp_path)
    store = ModelStore(gemma_state)
    entry, blob = store.catalog()[GEMMA], store.get(GEMMA).blob_path(gemma_state)
    store.close()
    repo.add(variant(blob, tmp_path / "v2.gguf", b"W"), GEMMA, "2", gate=GATE,
             template=entry.chat_template, parameters=entry.parameters)
    with repo.serve(broker, tmp_path, "rollout_tick_s = 0.5\n") as controller:
        yield controller


def _rollout(central: Controller) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["fleet", "rollout", "status", RID, "--json",
                                       "--config", str(central.config)])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def test_two_agents_in_waves_end_active_with_zero_failed_requests(
        broker: Mosquitto, central: Controller, gemma_state: Path, tmp_path: Path
        ) -> None:
    boxes = {name: start_box(name, broker, central,
                             clone_state(gemma_state, tmp_path / f"state-{name}"), tmp_path,
                             BOX_ENV)
             for name in BOXES}
    streams = Streams(GEMMA, list(boxes.values()), num_predict=4)  # each store's assistant
    try:
        for box in boxes.values():
            box.wait_ready(central)
        old = {name: box.digest(GEMMA) for name, box in boxes.items()}
        streams.start()
        started = CliRunner().invoke(main, [
            "fleet", "rollout", "start", f"{GEMMA}@2", "--id", RID, "--waves",
            "1,100%", "--soak", f"{SOAK_S}s", "--min-executed", "1", "--abort-above", "0%",
            "--device-timeout", f"{DEVICE_TIMEOUT_S}s", "--config", str(central.config)])
        assert started.exit_code == 0, started.output
        # The rollout ends by itself: each wave settles within the device timeout (a box
        # that has not reported by then is TIMED_OUT), then soaks. Waiting less than that
        # judged the host's load, not the rollout (151.5 s against 150 beside a CPU hog).
        assert wait_until(lambda: _rollout(central)["state"] != "RUNNING",
                          2 * (DEVICE_TIMEOUT_S + SOAK_S) + 30, 0.5), _rollout(central)
        streams.stop()
        report = _rollout(central)
        assert report["state"] == "COMPLETED", json.dumps(report)
        assert report["states"] == {"ACTIVE": 2}
        assert streams.failures == [] and all(n > 0 for n in streams.served.values()), \
            (streams.failures, streams.served)
        rows = {d["device"]: d for d in report["devices"]}
        first, second = sorted(BOXES, key=lambda n: rows[n]["wave"])
        assert (rows[first]["wave"], rows[second]["wave"]) == (1, 2)
        assert rows[second]["started_at"] >= rows[first]["active_at"] + SOAK_S  # soaked first
        for name, box in boxes.items():
            assert box.digest(GEMMA) != old[name]
            _chats_with_the_release_template(box)
            history = json.loads(cli("models", "history", GEMMA, "--json",
                                     "--state-dir", str(box.state)).stdout)
            evidence = [e for e in history["evidence"] if e["rollout_id"] == RID]
            assert [e["outcome"] for e in evidence] == ["ACTIVE"]
            assert {c["name"] for c in evidence[0]["checks"] if c["passed"]} >= {
                "prompt:chat:max_output_tokens", "memory_headroom", "served_digest"}
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


def _chats_with_the_release_template(box: Box) -> None:
    """Version 2 serves with the template its release carried: a chat is answered."""
    show = httpx.post(f"{box.base}/api/show", json={"model": GEMMA}, timeout=10).json()
    assert show["modelfile"].startswith(f"# source: release:{GEMMA}@2")
    assert "<start_of_turn>" in show["template"] and "<end_of_turn>" in show["parameters"]
    r = httpx.post(f"{box.base}/api/chat", timeout=60, json={
        "model": GEMMA, "stream": False, "options": {"num_predict": 8, "temperature": 0},
        "messages": [{"role": "user", "content": "Count to five."}]})
    assert r.status_code == 200, r.text
    text = r.json()["message"]["content"]
    assert text.strip() and "<start_of_turn>" not in text and "<end_of_turn>" not in text
