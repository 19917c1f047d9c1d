"""A capacity release on the box, on paper (a real ModelOps and rollout store, a paper
loader and probe: `test_rollout.py`'s kit): the runtime staged with the new settings and
kept only once the gate passed, restored by itself when it fails, refused on a box that
serves another version, rolled back by an operator after it went ACTIVE; and
`config.patch` of a capacity key, refused unless ungated. The real engine and fleet:
`tests/fleet/controller/test_capacity_rollout.py`."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.errors import InvalidRequest
from edge_agent.fleet.controller.rollouts.operations import parse_capacity
from edge_agent.fleet.device.link.overlay import (
    apply_overlay,
    config_patch_handler,
    load_overlay,
)
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import BadArgs, lookup
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.rollout_states import ACTIVE, REJECTED, ROLLED_BACK
from edge_agent.ledger.evidence import evidence_for
from tests.support.pace import SETTLE_S
from tests.support.rollout_support import DirReleases, PaperLoader, ScriptedProbe, write_gguf

NAME = "m:1"
GATE = {"prompts": [{"id": "hello", "prompt": "Say hello", "max_tokens": 8,
                     "expect": {"contains": ["hello"]}}], "tokens_per_s_floor": None}


class Box:
    def __init__(self, tmp_path: Path) -> None:
        state = tmp_path / "state"
        self.store = ModelStore(state)
        self.loader = PaperLoader(self.store)
        self.ops = ModelOps(self.store, self.loader)  # type: ignore[arg-type]
        served = write_gguf(tmp_path / "v1.gguf", context_length=256)
        self.digest = self.ops.import_file(served, NAME, by="test").digest
        self.releases = DirReleases()
        self.releases.add(NAME, "1", served, {"gate": GATE})
        self.releases.add(NAME, "2", write_gguf(tmp_path / "v2.gguf", context_length=257),
                          {"gate": GATE})
        self.settings = Settings(state_dir=state)
        # The answer depends on the runtime: "hello" unless parallel is 3.
        self.probe = ScriptedProbe(self.store, {self.digest: lambda r: "bye" if
                                                self.settings.runtime.parallel == 3
                                                else "hello"})

    def manager(self) -> RolloutManager:
        return RolloutManager(self.settings, self.ops, self.releases, self.probe,
                              poll_s=0.01, retry_base_s=0.01)

    def evidence(self, rid: str) -> dict[str, Any]:
        return next(e for e in evidence_for(self.settings.state_dir / "ledger.db", NAME)
                    if e["rollout_id"] == rid)


async def _roll(box: Box, rid: str, version: str, config: dict[str, Any],
                then: Any = None) -> Any:
    manager = box.manager()
    await manager.start()
    try:
        assert manager.begin(rid, NAME, version, config=config)["accepted"]
        r = await manager.settled(rid, SETTLE_S)
        if then is not None:
            await then(manager)
        return r
    finally:
        await manager.stop()


def test_a_passing_capacity_release_serves_and_persists_its_settings(tmp_path: Path) -> None:
    box = Box(tmp_path)
    r = asyncio.run(_roll(box, "c1", "1", {"parallel": 2, "context_length": 1024}))
    assert (r.state, r.target_digest, r.previous_digest) == (ACTIVE, box.digest, box.digest)
    assert (box.settings.runtime.parallel, box.settings.runtime.context_length) == (2, 1024)
    assert load_overlay(box.settings.state_dir) == {"runtime.parallel": 2,
                                                    "runtime.context_length": 1024}
    steps = [e[0] for e in box.loader.log]
    assert steps[-4:] == ["drain", "unload", "load", "undrain"], box.loader.log
    ev = box.evidence("c1")
    assert ev["outcome"] == "ACTIVE"
    assert ev["parameters"]["capacity"]["before"]["parallel"] == "auto"
    assert ev["parameters"]["capacity"]["after"]["parallel"] == 2
    assert {"prompt:hello:contains", "prompt:hello:baseline", "burst"} <= {
        c["name"] for c in ev["checks"] if c["passed"]}
    # What a restart applies over the config file.
    again = apply_overlay(Settings(state_dir=box.settings.state_dir), box.settings.state_dir)
    assert (again.runtime.parallel, again.runtime.context_length) == (2, 1024)


def test_a_failing_capacity_release_restores_the_previous_settings_by_itself(
        tmp_path: Path) -> None:
    box = Box(tmp_path)
    r = asyncio.run(_roll(box, "c2", "1", {"parallel": 3}))
    assert r.state == ROLLED_BACK and r.restored
    assert r.reason.startswith("gate check prompt:hello:contains failed"), r.reason
    assert box.settings.runtime.parallel == "auto"
    assert load_overlay(box.settings.state_dir) == {}
    ev = box.evidence("c2")
    assert ev["outcome"] == "ROLLED_BACK"
    failed = {c["name"]: c for c in ev["checks"] if not c["passed"]}
    assert failed["prompt:hello:baseline"]["figure"] == "regressed"
    assert "burst" in failed
    # Loaded again with the previous settings: the last swap ends admitted.
    assert [e[0] for e in box.loader.log][-4:] == ["drain", "unload", "load", "undrain"]


def test_a_value_out_of_bounds_rolls_back_before_anything_changes(tmp_path: Path) -> None:
    box = Box(tmp_path)
    r = asyncio.run(_roll(box, "c3", "1", {"context_length": 8}))
    assert r.state == ROLLED_BACK and "gate check config failed" in r.reason
    assert "drain" not in [e[0] for e in box.loader.log]
    assert box.settings.runtime.context_length == 4096


def test_a_kv_cache_type_ships_within_the_settings_own_bounds(tmp_path: Path) -> None:
    box = Box(tmp_path)
    r = asyncio.run(_roll(box, "k1", "1", {"kv_cache_type": "q8_0"}))
    assert r.state == ACTIVE and box.settings.runtime.kv_cache_type == "q8_0"
    assert load_overlay(box.settings.state_dir) == {"runtime.kv_cache_type": "q8_0"}
    ev = box.evidence("k1")["parameters"]["capacity"]
    assert (ev["before"]["kv_cache_type"], ev["after"]["kv_cache_type"]) == ("f16", "q8_0")
    for rid, bad in (("k2", "q5_1"), ("k3", 8)):
        r = asyncio.run(_roll(box, rid, "1", {"kv_cache_type": bad}))
        assert r.state == ROLLED_BACK and "gate check config failed" in r.reason
        assert box.settings.runtime.kv_cache_type == "q8_0"


def test_a_quantized_kv_cache_without_flash_attention_never_reaches_the_model(
        tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.settings.runtime.flash_attn = "off"
    r = asyncio.run(_roll(box, "k4", "1", {"kv_cache_type": "q4_0"}))
    assert r.state == ROLLED_BACK and "gate check config failed" in r.reason
    check = next(c for c in box.evidence("k4")["checks"] if c["name"] == "config")
    assert "kv_cache_type 'q4_0' needs flash attention" in json.dumps(check), check
    assert "drain" not in [e[0] for e in box.loader.log]


def test_a_box_serving_another_version_rejects_it_before_anything_changes(
        tmp_path: Path) -> None:
    box = Box(tmp_path)
    r = asyncio.run(_roll(box, "c4", "2", {"parallel": 2}))
    assert (r.state, r.reason) == (REJECTED, "not_serving")
    assert box.loader.log == [] and box.settings.runtime.parallel == "auto"


def test_an_operator_rolls_an_active_capacity_release_back(tmp_path: Path) -> None:
    box = Box(tmp_path)
    box.settings.runtime.threads = 1  # what the config file said
    (box.settings.state_dir / "config.overlay.json").write_text(
        json.dumps({"v": 1, "set": {"telemetry.interval_s": 9}}))

    async def back(manager: RolloutManager) -> None:
        answer = manager.rollback("c5")
        assert answer["accepted"] and answer["state"] == ROLLED_BACK, answer
        deadline = time.monotonic() + SETTLE_S
        while not manager.store.get("c5").restored:  # once the model loaded again
            assert time.monotonic() < deadline, box.loader.log
            await asyncio.sleep(0.01)
        assert box.loader.log[-1][0] == "undrain"

    r = asyncio.run(_roll(box, "c5", "1", {"threads": 2, "parallel": 2}, back))
    assert r.state == ACTIVE
    assert manager_row(box, "c5") == ROLLED_BACK
    assert (box.settings.runtime.threads, box.settings.runtime.parallel) == (1, "auto")
    assert load_overlay(box.settings.state_dir) == {"telemetry.interval_s": 9}


def test_a_restart_during_the_gate_puts_the_previous_settings_back(tmp_path: Path) -> None:
    """A kill -9 after the overlay took the new settings but before ACTIVE was committed:
    the box starts with them (the overlay applies at start); the row says GATING, so the
    resume converges it to ROLLED_BACK and puts the overlay and the runtime back."""
    from edge_agent.fleet.device.rollout.store import RolloutStore
    from edge_agent.fleet.protocol.rollout_states import ACTIVATING, GATING, STAGED

    box = Box(tmp_path)
    state = box.settings.state_dir
    store = RolloutStore(state / "rollouts.db")
    store.create("c6", NAME, "1", config={"parallel": 2})
    store.transition("c6", STAGED, target_digest=box.digest)
    store.transition("c6", ACTIVATING, previous_digest=box.digest, config={
        "change": {"parallel": 2}, "overlay_before": {},
        "values_before": {"runtime.parallel": "auto"}})
    store.transition("c6", GATING)
    store.close()
    (state / "config.overlay.json").write_text(
        json.dumps({"v": 1, "set": {"runtime.parallel": 2, "telemetry.interval_s": 9}}))
    box.settings = apply_overlay(Settings(state_dir=state), state)  # the start
    assert box.settings.runtime.parallel == 2

    async def restart() -> Any:
        manager = box.manager()
        await manager.start()
        try:
            return await manager.settled("c6", SETTLE_S)
        finally:
            await manager.stop()

    r = asyncio.run(restart())
    assert (r.state, r.reason, r.restored) == (ROLLED_BACK, "interrupted during gating", True)
    assert box.settings.runtime.parallel == "auto"
    assert load_overlay(state) == {"telemetry.interval_s": 9}
    # Loaded again with them (nothing was loaded yet here: nothing to unload first).
    assert [e[0] for e in box.loader.log] == ["drain", "load", "undrain"]


def manager_row(box: Box, rid: str) -> str:
    from edge_agent.fleet.device.rollout.store import RolloutStore

    store = RolloutStore(box.settings.state_dir / "rollouts.db")
    try:
        row = store.get(rid)
        assert row is not None
        return row.state
    finally:
        store.close()


# -- config.patch of a capacity key -------------------------------------------------------

def _patch(args: dict[str, Any]) -> Command:
    return Command("p1", "f", "d", "config.patch", 1, 0.0, 1.0, args, "d", b"")


def test_config_patch_of_a_capacity_key_needs_ungated_and_is_recorded(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    seen: list[tuple[str, dict[str, Any]]] = []
    handle = config_patch_handler(lambda: settings, tmp_path, lambda _n, keys: list(keys),
                                  lambda c, _b, _a, changes: seen.append((c.id, changes)))
    for key in ("runtime.parallel", "runtime.context_length", "models.m:1.draft_tokens"):
        with pytest.raises(CommandRefused) as refused:
            handle(_patch({"set": {key: 4}}))
        assert "capacity setting" in refused.value.message
        assert "fleet rollout start NAME@VERSION --capacity" in refused.value.message
        assert "--ungated" in refused.value.message
    assert load_overlay(tmp_path) == {} and seen == []
    done = handle(_patch({"set": {"runtime.threads": 2, "models.m:1.draft_tokens": 3,
                                  "telemetry.interval_s": 7}, "ungated": True}))
    assert done == {"set": {"runtime.threads": 2, "models.m:1.draft_tokens": 3,
                            "telemetry.interval_s": 7},
                    "live": ["telemetry.interval_s"],
                    "on_restart": ["models.m:1.draft_tokens", "runtime.threads"],
                    "ungated": True}
    assert seen == [("p1", {"runtime.threads": 2, "models.m:1.draft_tokens": 3})]
    again = apply_overlay(Settings(state_dir=tmp_path), tmp_path)
    assert again.runtime.threads == 2 and again.model_override("m:1").draft_tokens == 3
    # Text (a draft model's name, "auto") ships only through a capacity release.
    with pytest.raises(CommandRefused):
        handle(_patch({"set": {"runtime.parallel": "auto"}, "ungated": True}))


def test_the_controller_reads_capacity_and_holds_it_to_the_schema() -> None:
    assert parse_capacity("parallel=8, context_length=2048,draft_model=smollm2:135m,"
                          "kv_cache_type=q8_0") == {
        "parallel": 8, "context_length": 2048, "draft_model": "smollm2:135m",
        "kv_cache_type": "q8_0"}
    for bad in ("parallel", "batch_size=8", "parallel=8,parallel=4", "=3"):
        with pytest.raises(InvalidRequest):
            parse_capacity(bad)
    start = lookup("rollout.start")
    start.check_args({"rollout_id": "r", "name": "m:1", "version": 1,
                      "config": {"parallel": 2}})
    for config in ({"batch_size": 2}, {"parallel": True}, {}, {"threads": 1.5}):
        with pytest.raises(BadArgs):
            start.check_args({"rollout_id": "r", "name": "m:1", "version": 1,
                              "config": config})
