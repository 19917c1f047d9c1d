"""The activation's check before anything loads: a release that would take the chat
template away (a base model published without `--template`, replacing a version that
serves chats with the catalog's) rolls back before the switch, so no chat is refused; one
that brings its template goes on. A real ModelOps on tiny GGUFs; a paper loader and probe
(`tests/support/rollout_support.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.models.entries import ManifestExtras
from edge_agent.fleet.device.rollout import health_gate
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.device.rollout.store import Rollout
from edge_agent.fleet.protocol.rollout_states import ACTIVE, ROLLED_BACK
from edge_agent.ledger.evidence import evidence_for
from tests.support.pace import SETTLE_S
from tests.support.rollout_support import DirReleases, PaperLoader, ScriptedProbe, write_gguf

NAME = "base:1"
TEMPLATE = "{% for m in messages %}<turn>{{ m['content'] }}</turn>{% endfor %}"
GATE = {"prompts": [{"id": "hi", "prompt": "Hello", "max_tokens": 4}],
        "tokens_per_s_floor": None}


def _roll(tmp_path: Path, *, old_template: str | None, release_template: str | None
          ) -> tuple[Rollout, ModelStore, str, PaperLoader]:
    """Version 1 installed and active with `old_template`, then a rollout of version 2
    whose release brings `release_template` (its GGUF has none)."""
    state = tmp_path / "state"
    store = ModelStore(state)
    loader = PaperLoader(store)
    ops = ModelOps(store, loader)  # type: ignore[arg-type]
    old = store.import_file(write_gguf(tmp_path / "v1.gguf", context_length=256), NAME,
                            by="test", extras=ManifestExtras(chat_template=old_template)
                            ).digest
    releases = DirReleases()
    releases.add(NAME, "2", write_gguf(tmp_path / "v2.gguf", context_length=257),
                 {"gate": GATE, "chat_template": release_template})
    manager = RolloutManager(Settings(state_dir=state), ops, releases, ScriptedProbe(store),
                             poll_s=0.01, retry_base_s=0.01)

    async def roll() -> Rollout:
        await manager.start()
        try:
            assert manager.begin("r1", NAME, "2")["accepted"]
            return await manager.settled("r1", SETTLE_S)
        finally:
            await manager.stop()

    return asyncio.run(roll()), store, old, loader


def test_a_release_without_the_template_the_name_chats_with_rolls_back_before_the_switch(
        tmp_path: Path) -> None:
    r, store, old, loader = _roll(tmp_path, old_template=TEMPLATE, release_template=None)
    assert (r.state, r.restored) == (ROLLED_BACK, True)
    assert r.reason == "gate check chat_template failed: none (limit present)"
    assert store.active_digest(NAME) == old
    assert [h.action for h in store.history(NAME) if h.by == "rollout:r1"] == [
        "install"]  # installed (kept for diagnosis), never switched to
    assert loader.log == []  # nothing loaded, held or drained
    (ev,) = evidence_for(tmp_path / "state" / "ledger.db", NAME)
    assert ev["outcome"] == ROLLED_BACK
    assert [(c["name"], c["passed"]) for c in ev["checks"]] == [("chat_template", False)]
    assert "--template" in ev["checks"][0]["detail"]


@pytest.mark.parametrize(("old_template", "release_template"), [
    (TEMPLATE, TEMPLATE),  # the release carries it
    (None, None),  # a completion model stays one
    (None, TEMPLATE),  # a release may bring a template the name never had
])
def test_a_release_that_keeps_chats_answered_goes_active(
        tmp_path: Path, old_template: str | None, release_template: str | None) -> None:
    r, store, old, _ = _roll(tmp_path, old_template=old_template,
                             release_template=release_template)
    assert r.state == ACTIVE, r.reason
    assert store.active_digest(NAME) != old
    assert store.get(NAME).chat_template == release_template


def test_check_template_names_what_went_missing() -> None:
    assert health_gate.check_template("t", "t").passed \
        and health_gate.check_template(None, None).passed
    assert health_gate.check_template(None, "t").passed
    lost = health_gate.check_template("t", None)
    assert (lost.name, lost.passed, lost.figure, lost.limit) == (
        "chat_template", False, "none", "present")
