"""The device's rollout state machine: transitions committed and published in order, the
persisted rows, one rollout per name, REJECTED final and FAILED retried up to the limit,
the maintenance window and defer_while_busy holding STAGED, cancel and rollback commands,
the drain path, and kill -9 in DOWNLOADING, VERIFYING, ACTIVATING, right after the switch,
in GATING and after a ROLLED_BACK commit, converging on restart.

A real ModelOps on tiny GGUFs, a real local release source (files on disk, resumable
copies with the transfer's checks); the loader and the probe are paper ones (no model is
loaded here: `test_health_gate.py` runs the real engine)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from edge_agent.cli import main as cli
from edge_agent.config import Settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.rollout.outcomes import ReleaseFailed, ReleaseRejected
from edge_agent.fleet.device.rollout.rules import backoff_s, hold_reason
from edge_agent.fleet.device.rollout.runner import RolloutManager
from edge_agent.fleet.device.rollout.store import IllegalTransition, NameBusy, RolloutStore
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.refusals import CommandRefused
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    CANCELLED,
    DOWNLOADING,
    FAILED,
    GATING,
    RECEIVED,
    REJECTED,
    ROLLED_BACK,
    STAGED,
    VERIFYING,
)
from edge_agent.ledger.evidence import evidence_for
from tests.support.pace import SETTLE_S
from tests.support.rollout_support import DirReleases, PaperLoader, ScriptedProbe, write_gguf

NAME = "m:1"
ROOT = Path(__file__).resolve().parents[3]
HAPPY = [RECEIVED, DOWNLOADING, VERIFYING, STAGED, ACTIVATING, GATING, ACTIVE]
GATE = {"prompts": [{"id": "hello", "prompt": "Say hello", "max_tokens": 8,
                     "expect": {"contains": ["hello"]}}],
        "tokens_per_s_floor": 0.8, "ttft_ms_max": 1000}


@dataclass
class Box:
    tmp: Path
    settings: Settings
    store: ModelStore
    loader: PaperLoader
    ops: ModelOps
    releases: DirReleases
    probe: ScriptedProbe
    old: str
    new: str
    emitted: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    hooks: list[tuple[str, str]] = field(default_factory=list)
    skew: list[float] = field(default_factory=lambda: [0.0])  # the clock, moved on
    local: list[datetime] = field(default_factory=lambda: [datetime(2026, 1, 1, 3, 0)])

    def manager(self, **kwargs: Any) -> RolloutManager:
        def emit(kind: str, cls: str, body: Any) -> bool:
            self.emitted.append((kind, cls, dict(body)))
            return True

        def hook(event: str, r: Any) -> None:
            self.hooks.append((event, r.id))

        kwargs.setdefault("poll_s", 0.01)
        kwargs.setdefault("retry_base_s", 0.01)
        return RolloutManager(self.settings, self.ops, self.releases, self.probe,
                              emit=emit, hook=hook, clock=lambda: time.time() + self.skew[0],
                              local_now=lambda: self.local[0], **kwargs)

    def transitions(self) -> list[dict[str, Any]]:
        return [b for k, _c, b in self.emitted if b["event"] == "rollout.transition"]


def make_box(tmp_path: Path, *, gate: Any = GATE, fleet: dict[str, Any] | None = None,
             room: bool = True, floats: int = 24) -> Box:
    state = tmp_path / "state"
    v1 = write_gguf(tmp_path / "v1.gguf", context_length=256, floats=floats)
    v2 = write_gguf(tmp_path / "v2.gguf", context_length=257, floats=floats)
    store = ModelStore(state)
    loader = PaperLoader(store, room=room)
    ops = ModelOps(store, loader)  # type: ignore[arg-type]
    old = ops.import_file(v1, NAME, by="test").digest
    releases = DirReleases()
    new = releases.add(NAME, "2", v2, {"gate": gate}).sha256
    probe = ScriptedProbe(store, {old: lambda r: "hello there", new: lambda r: "hello you"})
    settings = Settings(state_dir=state, fleet=fleet or {})
    return Box(tmp_path, settings, store, loader, ops, releases, probe, old, new)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _roll(box: Box, rid: str = "r1", version: str = "2", *, timeout: float = SETTLE_S,
                **kwargs: Any) -> Any:
    manager = box.manager(**kwargs)
    await manager.start()
    try:
        answer = manager.begin(rid, NAME, version)
        assert answer["accepted"], answer
        return await manager.settled(rid, timeout)
    finally:
        await manager.stop()


async def reach(manager: RolloutManager, rid: str, state: str, timeout: float = SETTLE_S) -> Any:
    deadline = time.monotonic() + timeout
    while (r := manager.store.get(rid)).state != state:
        assert time.monotonic() < deadline, f"{rid} is {r.state}, not {state}"
        await asyncio.sleep(0.01)
    return r


def command(type_: str, args: dict[str, Any]) -> Command:
    return Command("c1", "f", "d", type_, 1, 0.0, 1.0, args, "d", b"")


# -- the whole way, persisted and published ------------------------------------------------

def test_a_rollout_goes_through_every_state_committed_and_published(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    r = run(_roll(box))
    assert r.state == ACTIVE and not r.live and r.reason is None
    assert box.ops.show(NAME).digest == box.new  # the pointer moved, by the rollout
    entry = box.ops.history(NAME)[0]
    assert (entry.action, entry.digest, entry.previous, entry.by) == (
        "activate", box.new, box.old, "rollout:r1")
    assert [t["to"] for t in box.transitions()] == HAPPY
    assert all(k == "rollout" and c == "audit" for k, c, _b in box.emitted)
    assert [e for e, _ in box.hooks] == [*HAPPY[:5], "switched", GATING, ACTIVE]
    # Persisted: the row and its transitions, read back by a fresh store.
    store = RolloutStore(box.settings.state_dir / "rollouts.db")
    row = store.get("r1")
    assert row is not None and (row.target_digest, row.previous_digest) == (box.new, box.old)
    assert set(row.timings) == set(HAPPY[:-1]) and all(v >= 0 for v in row.timings.values())
    assert [t.to_state for t in store.transitions("r1")] == HAPPY
    assert row.release and row.release["sha256"] == box.new
    checks = {c["name"]: c for c in (row.gate or {})["checks"]}
    assert checks["prompt:hello:contains"]["passed"] and checks["served_digest"]["passed"]
    assert checks["tokens_per_s"]["figure"] == 1.0  # the same speed: ratio 1
    store.close()
    # The old version was measured first (the floor's baseline), then the new one gated.
    assert [d for d, _ in box.probe.calls] == [box.old, box.new]
    # Beside: the new version loaded while both were held; the old one let go after.
    log = box.loader.log
    assert ("hold", NAME, box.old) in log and ("load", NAME, box.new) in log
    assert log.index(("hold", NAME, box.new)) < log.index(("load", NAME, box.new))
    assert ("unhold", NAME, box.old) in log and not box.loader.held
    # One evidence row, in the ledger and as an audit message.
    rows = evidence_for(box.settings.state_dir / "ledger.db", NAME)
    assert len(rows) == 1 and rows[0]["outcome"] == ACTIVE
    ev = rows[0]
    assert (ev["rollout_id"], ev["digest"], ev["previous_digest"]) == ("r1", box.new, box.old)
    assert ev["llama_cpp_version"] and ev["agent_version"] and ev["hardware"]["ram_bytes"] > 0
    assert {c["name"] for c in ev["checks"]} >= {"prompt:hello:contains", "ttft_ms"}
    assert set(ev["timings"]) >= {DOWNLOADING, GATING}
    sent = [b for _k, _c, b in box.emitted if b["event"] == "rollout.evidence"]
    assert len(sent) == 1 and sent[0]["id"] == "r1/1"
    # The download's work dir is gone once staged.
    assert not (box.settings.state_dir / "rollouts" / "r1").exists()


def test_a_failed_gate_switches_back_keeps_the_new_version_and_names_the_check(
        tmp_path: Path) -> None:
    box = make_box(tmp_path)
    box.probe.script[box.new] = lambda r: "goodbye"
    r = run(_roll(box))
    assert r.state == ROLLED_BACK and r.restored
    assert r.reason is not None and "prompt:hello:contains" in r.reason \
        and "missing" in r.reason
    assert r.details["failed"] == ["prompt:hello:contains"]
    assert box.ops.show(NAME).digest == box.old
    assert {v.digest for v in box.ops.versions(NAME)} == {box.old, box.new}  # kept
    history = box.ops.history(NAME)
    assert [(h.digest, h.by) for h in history[:2]] == [(box.old, "rollout:r1"),
                                                       (box.new, "rollout:r1")]
    ev = evidence_for(box.settings.state_dir / "ledger.db", NAME)[0]
    failed = [c for c in ev["checks"] if not c["passed"]]
    assert ev["outcome"] == ROLLED_BACK and [c["name"] for c in failed] == [
        "prompt:hello:contains"]
    assert "goodbye" in failed[0]["detail"]
    assert ("unload", NAME, box.new) in box.loader.log and not box.loader.held


def test_a_slow_release_fails_the_tokens_per_s_floor(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    box.probe.speed = {box.old: 50.0, box.new: 30.0}  # 0.6x
    r = run(_roll(box))
    assert r.state == ROLLED_BACK and "tokens_per_s" in (r.reason or "")
    check = next(c for c in r.gate["checks"] if c["name"] == "tokens_per_s")
    assert (check["figure"], check["limit"], check["passed"]) == (0.6, 0.8, False)


def test_without_room_for_both_the_name_is_drained_for_the_switch(tmp_path: Path) -> None:
    box = make_box(tmp_path, room=False)
    box.loader.busy(NAME, 0)  # the old version loaded, idle
    r = run(_roll(box))
    assert r.state == ACTIVE
    log = box.loader.log
    assert log.index(("drain", NAME)) < log.index(("undrain", NAME))
    assert not box.loader.held and not box.loader.draining
    # Old unloaded before the new one loaded (never both), the new one loaded after the
    # switch, before admitting again.
    assert log.index(("unload", NAME, box.old)) < log.index(("load", NAME, box.new)) \
        < log.index(("undrain", NAME))


def test_a_name_that_stays_busy_through_the_drain_fails_and_is_retried(
        tmp_path: Path) -> None:
    box = make_box(tmp_path, room=False, fleet={"rollout_max_failures": 2})
    box.loader.busy(NAME, 1)  # a request that never ends

    async def scenario() -> Any:
        manager = box.manager()
        manager.activator.act.drain_timeout_s = 0.1
        await manager.start()
        manager.begin("r1", NAME, "2")
        r = await manager.settled("r1", SETTLE_S)
        await manager.stop()
        return r

    r = run(scenario())
    assert (r.state, r.reason, r.failures, r.live) == (FAILED, "drain_timeout", 2, False)
    assert r.details["busy"] == 1
    assert box.ops.show(NAME).digest == box.old  # nothing was switched
    assert not box.loader.draining and box.loader.log.count(("drain", NAME)) == 2
    assert [t["to"] for t in box.transitions()][-3:] == [STAGED, ACTIVATING, FAILED]


def test_a_target_already_active_ends_active_without_a_switch(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    box.ops.import_file(box.releases.releases[(NAME, "2")].path, NAME, by="operator")
    r = run(_roll(box))
    assert (r.state, r.reason) == (ACTIVE, "already active")
    assert [t["to"] for t in box.transitions()] == [RECEIVED, STAGED, ACTIVATING, ACTIVE]


# -- one per name, final and retried outcomes -------------------------------------------------

def test_one_rollout_per_name(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"maintenance_window": "02:00-03:00"})  # 03:00: outside
    other = write_gguf(tmp_path / "o.gguf", context_length=300)
    box.releases.add("other:1", "1", other)

    async def scenario() -> None:
        manager = box.manager()
        await manager.start()
        assert manager.begin("r1", NAME, "2")["accepted"]
        await reach(manager, "r1", STAGED)  # held by the window
        second = manager._start_handler(command("rollout.start", {
            "rollout_id": "r2", "name": NAME, "version": "2"}))
        assert second["accepted"] is False and second["refused"] == "busy"
        assert second["live"]["rollout_id"] == "r1"
        assert manager.begin("r1", NAME, "2") == {"accepted": True, "created": False,
                                                  **manager.store.get("r1").summary()}
        assert manager.begin("o1", "other:1", "1")["accepted"]  # another name: fine
        assert manager.cancel("r1")["state"] == CANCELLED
        assert manager.begin("r2", NAME, "2")["created"]
        await manager.stop()

    run(scenario())
    assert any(b["event"] == "rollout.refused" for _k, _c, b in box.emitted)
    # The store itself refuses a second live row for a name, whoever asks.
    store = RolloutStore(box.settings.state_dir / "rollouts.db")
    with pytest.raises(NameBusy):
        store.create("r3", NAME, "3")
    store.close()


def test_rejected_is_final(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    box.releases.lookup_errors = [ReleaseRejected("disk_full", "not enough disk",
                                                  need=10, free=1)]
    r = run(_roll(box))
    assert (r.state, r.reason, r.live) == (REJECTED, "disk_full", False)
    assert r.details == {"need": 10, "free": 1, "message": "not enough disk"}
    assert box.releases.lookups == 1 and box.ops.show(NAME).digest == box.old


def test_a_release_the_box_does_not_know_is_rejected(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    r = run(_roll(box, version="9"))
    assert (r.state, r.reason) == (REJECTED, "unknown")


def test_a_bad_gate_spec_is_rejected_before_download(tmp_path: Path) -> None:
    box = make_box(tmp_path, gate={"prompts": [{"prompt": "x", "expect": {"nope": 1}}]})
    r = run(_roll(box))
    assert (r.state, r.reason) == (REJECTED, "bad_gate") and box.releases.copied == 0


def test_failed_is_retried_with_backoff_up_to_the_limit(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"rollout_max_failures": 3})
    box.releases.lookup_errors = [ReleaseFailed("unreachable") for _ in range(5)]
    r = run(_roll(box))
    assert (r.state, r.reason, r.live, r.failures, r.attempts) == (
        FAILED, "unreachable", False, 3, 3)
    assert box.releases.lookups == 3
    assert [t["to"] for t in box.transitions()] == [
        RECEIVED, FAILED, RECEIVED, FAILED, RECEIVED, FAILED]
    assert [backoff_s(n, 30) for n in (1, 2, 3, 20)] == [30, 60, 120, 3600]


def test_a_failure_then_success_is_active_on_the_second_attempt(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    box.releases.lookup_errors = [ReleaseFailed("metadata_expired")]
    r = run(_roll(box))
    assert (r.state, r.attempts, r.failures) == (ACTIVE, 2, 1)


def test_a_corrupt_download_fails_and_the_retry_downloads_again(tmp_path: Path) -> None:
    box = make_box(tmp_path, floats=200_000)
    release = box.releases.releases[(NAME, "2")]
    dest = box.settings.state_dir / "rollouts" / "r1"
    dest.mkdir(parents=True)
    (dest / f"{release.sha256}.part").write_bytes(b"\0" * 1000)  # a damaged partial file
    r = run(_roll(box))
    assert (r.state, r.failures) == (ACTIVE, 1)
    reasons = [t["reason"] for t in box.transitions() if t["to"] == FAILED]
    assert reasons == ["hash_mismatch"]


# -- holding STAGED -----------------------------------------------------------------------------

@pytest.mark.parametrize(("minute", "window", "held"), [
    (3 * 60, "02:00-05:00", False), (1 * 60 + 59, "02:00-05:00", True),
    (5 * 60, "02:00-05:00", True), (23 * 60, "22:00-05:00", False),
    (4 * 60, "22:00-05:00", False), (12 * 60, "22:00-05:00", True), (0, None, False)])
def test_the_maintenance_window(minute: int, window: str | None, held: bool) -> None:
    why = hold_reason(minute=minute, window=window, busy=0, defer=False, staged_for_s=0,
                      deadline_s=1)
    assert (why is not None) == held
    if held:
        assert window is not None and window in why


def test_defer_while_busy_holds_until_idle_or_the_deadline() -> None:
    common = {"minute": 0, "window": None, "deadline_s": 60.0}
    assert hold_reason(busy=2, defer=True, staged_for_s=10, **common) == \
        "busy: 2 request(s) running or queued"
    assert hold_reason(busy=2, defer=False, staged_for_s=10, **common) is None
    assert hold_reason(busy=0, defer=True, staged_for_s=10, **common) is None
    assert hold_reason(busy=2, defer=True, staged_for_s=61, **common) is None  # activates
    # The deadline never overrides the window.
    assert hold_reason(minute=0, window="02:00-05:00", busy=2, defer=True,
                       staged_for_s=1e9, deadline_s=1) is not None


def test_the_window_holds_staged_until_its_time(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"maintenance_window": "22:00-05:00"})
    box.local[0] = datetime(2026, 1, 1, 12, 0)

    async def scenario() -> None:
        manager = box.manager()
        await manager.start()
        manager.begin("r1", NAME, "2")
        await reach(manager, "r1", STAGED)
        await asyncio.sleep(0.1)
        r = manager.store.get("r1")
        assert r.state == STAGED and box.ops.show(NAME).digest == box.old
        held = [b for _k, _c, b in box.emitted if b["event"] == "rollout.held"]
        assert len(held) == 1 and "22:00-05:00" in held[0]["held_by"]  # said once
        box.local[0] = datetime(2026, 1, 2, 0, 30)  # past midnight: inside
        assert (await manager.settled("r1", SETTLE_S)).state == ACTIVE
        await manager.stop()

    run(scenario())


def test_defer_while_busy_holds_staged_then_the_deadline_lets_it_go(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"defer_while_busy": True, "defer_deadline_s": 600})
    box.loader.busy(NAME, 3)  # never ending: the speed check waits for them settle_s

    async def scenario() -> None:
        manager = box.manager(settle_s=0.2)
        await manager.start()
        manager.begin("r1", NAME, "2")
        await reach(manager, "r1", STAGED)
        await asyncio.sleep(0.1)
        assert manager.store.get("r1").state == STAGED
        box.skew[0] += 601  # the deadline passed: activated although busy
        assert (await manager.settled("r1", SETTLE_S)).state == ACTIVE
        await manager.stop()

    run(scenario())


def test_defer_while_busy_activates_once_idle(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"defer_while_busy": True})
    box.loader.busy(NAME, 1)

    async def scenario() -> None:
        manager = box.manager()
        await manager.start()
        manager.begin("r1", NAME, "2")
        await reach(manager, "r1", STAGED)
        await asyncio.sleep(0.1)
        assert manager.store.get("r1").state == STAGED
        box.loader.busy(NAME, 0)
        assert (await manager.settled("r1", SETTLE_S)).state == ACTIVE
        await manager.stop()

    run(scenario())


# -- commands ----------------------------------------------------------------------------------

def test_handlers_check_their_args_and_return_at_once(tmp_path: Path) -> None:
    box = make_box(tmp_path, floats=400_000)
    box.releases.chunk_delay_s = 0.05  # a download of seconds

    async def scenario() -> None:
        manager = box.manager()
        await manager.start()
        handlers = manager.handlers()
        assert set(handlers) == {"rollout.start", "rollout.cancel", "rollout.rollback"}
        for type_, args in [("rollout.start", {"rollout_id": "r1", "name": NAME}),
                            ("rollout.start", {"rollout_id": "a/b", "name": NAME,
                                               "version": "2"}),
                            ("rollout.start", {"rollout_id": "r1", "name": "Bad Name!",
                                               "version": "2"}),
                            ("rollout.start", {"rollout_id": "r1", "name": NAME,
                                               "version": True}),
                            ("rollout.cancel", {}), ("rollout.rollback", {"x": 1})]:
            with pytest.raises(CommandRefused) as refused:
                handlers[type_](command(type_, args))
            assert refused.value.reason == "malformed"
        started = time.monotonic()
        out = await asyncio.to_thread(handlers["rollout.start"], command(
            "rollout.start", {"rollout_id": "r1", "name": NAME, "version": 2}))
        assert time.monotonic() - started < 0.5 and out["state"] == RECEIVED
        while manager.store.get("r1").state != DOWNLOADING:
            await asyncio.sleep(0.01)
        part = box.settings.state_dir / "rollouts" / "r1"
        out = await asyncio.to_thread(handlers["rollout.cancel"],
                                      command("rollout.cancel", {"name": NAME}))
        assert out["accepted"] and out["state"] == CANCELLED
        # Its task ended and took the partial file; the transfer's thread stops at its next
        # chunk, and then nothing more is copied: quiet for ten chunks' time, the file short.
        assert (await manager.settled("r1", SETTLE_S)).state == CANCELLED
        assert not part.exists()
        quiet_s, deadline = 10 * box.releases.chunk_delay_s, time.monotonic() + SETTLE_S
        copied, since = box.releases.copied, time.monotonic()
        while time.monotonic() - since < quiet_s:
            assert time.monotonic() < deadline, "the transfer goes on after the cancel"
            if box.releases.copied != copied:
                copied, since = box.releases.copied, time.monotonic()
            await asyncio.sleep(0.01)
        assert copied < box.releases.releases[(NAME, "2")].length  # the transfer stopped
        await manager.stop()

    run(scenario())
    assert box.ops.show(NAME).digest == box.old


def test_rollback_of_an_active_rollout_and_refusals(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    run(_roll(box))

    async def scenario() -> None:
        manager = box.manager()
        await manager.start()
        assert manager.cancel("r1")["accepted"] is False  # ACTIVE: cancel is no way back
        out = manager.handlers()["rollout.rollback"](command("rollout.rollback",
                                                             {"name": NAME}))
        assert out["accepted"] and out["state"] == ROLLED_BACK
        assert box.ops.show(NAME).digest == box.old
        assert manager.rollback("r1")["state"] == ROLLED_BACK  # again: the same answer
        assert manager.rollback("nope")["refused"] == "unknown"
        await manager.stop()

    run(scenario())
    assert box.ops.history(NAME)[0].by == "rollout:r1"


def test_a_rollback_asked_while_gating_fails_the_gate(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    manager_box: list[RolloutManager] = []

    def slow(r: Any) -> str:
        manager_box[0].rollback("r1")  # arrives while the golden prompt runs
        return "hello you"

    box.probe.script[box.new] = slow

    async def scenario() -> Any:
        manager = box.manager()
        manager_box.append(manager)
        await manager.start()
        manager.begin("r1", NAME, "2")
        r = await manager.settled("r1", SETTLE_S)
        await manager.stop()
        return r

    r = run(scenario())
    assert r.state == ROLLED_BACK and "rollback_requested" in r.reason
    assert box.ops.show(NAME).digest == box.old


def test_illegal_transitions_are_refused(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "rollouts.db")
    store.create("r1", NAME, "2")
    with pytest.raises(IllegalTransition):
        store.transition("r1", GATING)
    store.transition("r1", REJECTED, reason="x")
    with pytest.raises(IllegalTransition):
        store.transition("r1", DOWNLOADING)
    assert store.live_for(NAME) is None
    store.close()


# -- kill -9 and restart --------------------------------------------------------------------------

def _kill_child(box: Box, kill_at: str, manifest: dict[str, Any]) -> None:
    release = box.releases.releases[(NAME, "2")]
    box.store.close()
    spec = {"name": NAME, "version": "2", "file": str(release.path), "rollout_id": "r1",
            "manifest": manifest, "kill_at": kill_at}
    child = subprocess.run([sys.executable, "-m", "tests.support.rollout_child",
                            str(box.settings.state_dir), json.dumps(spec)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr[-2000:]


@pytest.mark.parametrize(("kill_at", "state", "ends", "reason"), [
    (DOWNLOADING, DOWNLOADING, ACTIVE, None),
    (VERIFYING, VERIFYING, ACTIVE, None),
    (ACTIVATING, ACTIVATING, ROLLED_BACK, "interrupted during activation"),
    ("switched", ACTIVATING, ROLLED_BACK, "interrupted during activation"),
    (GATING, GATING, ROLLED_BACK, "interrupted during gating"),
])
def test_kill_9_converges_on_restart(tmp_path: Path, kill_at: str, state: str, ends: str,
                                     reason: str | None) -> None:
    box = make_box(tmp_path, floats=400_000)  # 1.6 MB: a transfer of 25 chunks
    release = box.releases.releases[(NAME, "2")]
    _kill_child(box, kill_at, release.manifest)
    found = RolloutStore(box.settings.state_dir / "rollouts.db")
    assert found.get("r1").state == state
    found.close()
    box.store.close()
    active = ModelStore(box.settings.state_dir).active_digest(NAME)
    assert active == (box.new if kill_at in ("switched", GATING) else box.old)
    partial = box.settings.state_dir / "rollouts" / "r1" / f"{box.new}.part"
    if kill_at == DOWNLOADING:
        assert release.length // 2 <= partial.stat().st_size < release.length
    r = run(_restart(box))
    assert (r.state, r.reason) == (ends, reason)
    assert r.restored
    now = box.ops.show(NAME).digest
    assert now == (box.new if ends == ACTIVE else box.old)  # never neither, never unchecked
    if kill_at == DOWNLOADING:  # resumed from its offset, not from zero
        assert box.releases.copied <= release.length // 2 + 64 * 1024
    if ends == ROLLED_BACK:  # the interrupted attempt has its evidence row
        ev = evidence_for(box.settings.state_dir / "ledger.db", NAME)[0]
        assert (ev["outcome"], ev["reason"]) == (ROLLED_BACK, reason)
        assert {v.digest for v in box.ops.versions(NAME)} == {box.old, box.new}


async def _restart(box: Box) -> Any:
    manager = box.manager()
    await manager.start()
    r = await manager.settled("r1", SETTLE_S)
    await manager.stop()
    return r


def test_kill_9_after_a_rolled_back_commit_finishes_the_switch_back(tmp_path: Path) -> None:
    box = make_box(tmp_path, gate={"prompts": [{"prompt": "x", "expect": {
        "contains": "never said"}}]})
    _kill_child(box, ROLLED_BACK, box.releases.releases[(NAME, "2")].manifest)
    box.store.close()
    assert ModelStore(box.settings.state_dir).active_digest(NAME) == box.new  # cut there
    r = run(_restart(box))
    assert r.state == ROLLED_BACK and r.restored and "never said" in r.reason
    assert box.ops.show(NAME).digest == box.old


def test_restart_in_staged_waits_again_and_in_failed_retries(tmp_path: Path) -> None:
    box = make_box(tmp_path, fleet={"maintenance_window": "04:00-05:00"})
    box.releases.lookup_errors = [ReleaseFailed("unreachable")]

    async def first() -> None:
        manager = box.manager(retry_base_s=600)
        await manager.start()
        manager.begin("r1", NAME, "2")
        r = await reach(manager, "r1", FAILED)
        assert r.live and r.retry_at > time.time() + 500  # waiting for its retry
        await manager.stop()

    run(first())
    box.skew[0] += 601  # the retry is due when the box comes back

    async def second() -> None:
        manager = box.manager()
        await manager.start()
        await reach(manager, "r1", STAGED)  # retried, fetched, held by the window again
        await manager.stop()

    run(second())
    resumed = [b for _k, _c, b in box.emitted if b["event"] == "rollout.resumed"]
    assert [b["state"] for b in resumed] == [FAILED]
    box.local[0] = datetime(2026, 1, 1, 4, 30)
    assert run(_restart(box)).state == ACTIVE


# -- models history shows the evidence ----------------------------------------------------------

def test_models_history_prints_the_evidence(tmp_path: Path) -> None:
    box = make_box(tmp_path)
    box.probe.script[box.new] = lambda r: "goodbye"
    run(_roll(box))
    state = str(box.settings.state_dir)
    result = CliRunner().invoke(cli, ["models", "history", NAME, "--state-dir", state])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "release evidence" in out and "r1" in out and "ROLLED_BACK" in out
    assert "FAIL prompt:hello:contains" in out and "ok   served_digest" in out
    result = CliRunner().invoke(cli, ["models", "history", NAME, "--json", "--state-dir",
                                      state])
    data = json.loads(result.output)
    assert [e["rollout_id"] for e in data["evidence"]] == ["r1"]
    assert data["evidence"][0]["checks"][0]["name"] == "prompt:hello:contains"

