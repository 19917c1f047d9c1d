"""The rollout engine (`controller.rollouts`) and `fleet rollout …` without a broker: a
SQLite store, a signed release repository, a publisher that records (or is away), the
boxes' reports fed through the store's ingest as `fleet serve`'s would be; the status
with a downloading box's progress, and `--watch`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.config.controller import ControllerSettings
from edge_agent.errors import InvalidRequest, ServiceUnavailable
from edge_agent.fleet.controller.audit import local_operator
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.rollouts import operations as rollout_ops
from edge_agent.fleet.controller.rollouts.driver import RolloutEngine
from edge_agent.fleet.controller.store import PostgresStore, SQLiteStore
from edge_agent.fleet.controller.waves import Policy, parse_waves
from edge_agent.fleet.protocol.signing import load_private, load_public, verify
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import Repo, make_repo

NAME = "simmodel:1b"
BOOT = "c" * 32


class Recorder:
    """A `commands.Publisher` stand-in: keeps what it was given; `away` refuses."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.away = False

    def publish(self, commands: Sequence[Mapping[str, Any]]) -> None:
        if self.away:
            raise ServiceUnavailable("broker mqtt://127.0.0.1:1 unreachable: refused")
        self.sent.extend(dict(c) for c in commands)

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    made = make_repo(tmp_path)
    made.add(write_tiny_gguf(tmp_path / "m.gguf"), NAME, "2")
    return made


def _fill(made: Any, state_dir: Path) -> Any:
    """Eleven known devices; `state_dir` (where the release repository is) kept on it."""
    for i in range(10):
        made.birth("f1", f"d{i}", {"bdseq": 1, "boot_id": BOOT}, 1.0)
    made.birth("f2", "other", {"bdseq": 1, "boot_id": BOOT}, 1.0)
    made.state_dir = state_dir
    return made


@pytest.fixture
def store(tmp_path: Path, repo: Repo) -> Iterator[SQLiteStore]:
    made = _fill(SQLiteStore(tmp_path / "state" / "controller.db"), tmp_path / "state")
    yield made
    made.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path, repo: Repo) -> Iterator[Any]:
    """The engine's tests on either database (the repository stays in the state dir)."""
    if request.param == "sqlite":
        made = SQLiteStore(tmp_path / "state" / "controller.db")
    else:
        made = PostgresStore(request.getfixturevalue("postgres_url"))
    yield _fill(made, tmp_path / "state")
    made.close()


def engine(store: Any, repo: Repo, clock: Clock) -> tuple[RolloutEngine, Recorder]:
    settings = ControllerSettings(state_dir=store.state_dir)
    recorder = Recorder()
    return RolloutEngine(settings, store, load_private(repo.keys.private("command")),
                         publisher=recorder, clock=clock, tick_s=0.1), recorder  # type: ignore[arg-type]


SEQ = iter(range(1, 10**6))


def tell(store: Any, device: str, rid: str, *states: str, ts: float) -> None:
    """What a box's outbox would deliver: its transitions for the rollout."""
    store.ingest([Inbound("f1", device, "rollout", BOOT, next(SEQ), "audit", ts + n / 100, {
        "event": "rollout.transition", "to": s, "rollout_id": rid, "ts": ts + n / 100},
        ts) for n, s in enumerate(states)])


def test_the_engine_signs_records_publishes_and_follows_reports(
        any_store: Any, repo: Repo) -> None:
    store = any_store
    clock = Clock()
    eng, sent = engine(store, repo, clock)
    policy = Policy(parse_waves("2,100%"), abort_above=0.5, min_executed=1, soak_s=30,
                    device_timeout_s=600)
    r = rollout_ops.start(store, store.state_dir, f"{NAME}@2", "fleet:f1", policy,
                          now=clock(), rollout_id="r1")
    assert r.devices_total == 10 and r.waves_total == 2
    plans = eng.tick()
    assert plans["r1"].wave == 1 and len(sent.sent) == 2
    public = load_public(repo.keys.public_file("command"))
    for command in sent.sent:
        verify(command, public)
        assert command["type"] == "rollout.start" and command["seq"] == 1
        assert command["args"] == {"rollout_id": "r1", "name": NAME, "version": "2"}
        assert command["expires_at"] - command["issued_at"] == pytest.approx(600)
    first = sorted(c["device"] for c in sent.sent)
    rows = {d.device: d for d in store.rollouts.rollout_devices("r1")}
    assert all(rows[d].started_at == clock() and rows[d].state == "SENT" for d in first)
    assert len(store.command_results(sent.sent[0]["id"])) == 0  # recorded as commands
    eng.tick()
    assert len(sent.sent) == 2  # nothing twice
    for device in first:
        tell(store, device, "r1", "RECEIVED", "DOWNLOADING", "ACTIVE", ts=clock())
    clock.now += 10
    assert eng.tick()["r1"].waiting_for == "wave 1 soaking, 20s left"
    clock.now += 25
    assert eng.tick()["r1"].wave == 2 and len(sent.sent) == 10
    for device in (c["device"] for c in sent.sent[2:]):
        tell(store, device, "r1", "RECEIVED", "ACTIVE", ts=clock())
    assert eng.tick()["r1"].state == "COMPLETED"
    assert eng.tick() == {}  # settled: no longer driven


def test_a_broker_away_holds_the_commands_back_never_the_decision(
        any_store: Any, repo: Repo) -> None:
    store = any_store
    clock = Clock()
    eng, sent = engine(store, repo, clock)
    policy = Policy(parse_waves("100%"), device_timeout_s=60)
    rollout_ops.start(store, store.state_dir, f"{NAME}@2", "d1,d2,d3", policy, now=clock(),
                      rollout_id="r2")
    sent.away = True
    assert eng.tick() == {}  # recorded, not published
    recorded = store.rollouts.unpublished_commands("r2")
    assert len(recorded) == 3
    assert all(d.started_at is None for d in store.rollouts.rollout_devices("r2"))
    clock.now += 120  # no device times out while its command never left
    sent.away = False
    eng.tick()
    assert [c["id"] for c in sent.sent] == [c["id"] for c in recorded]  # the same commands
    assert store.rollouts.unpublished_commands("r2") == []
    assert all(d.started_at == clock() for d in store.rollouts.rollout_devices("r2"))


def test_a_busy_box_is_sent_a_new_start_for_what_is_left_of_its_timeout(
        any_store: Any, repo: Repo) -> None:
    """A box that refused as busy (a `models pull` of the name there) gets a new signed
    rollout.start after rollout_busy_retry_s, valid for what is left of its device
    timeout; it then goes ACTIVE and the rollout completes with nothing counted failed."""
    store = any_store
    clock = Clock()
    eng, sent = engine(store, repo, clock)
    policy = Policy(parse_waves("100%"), abort_above=0.0, min_executed=1,
                    device_timeout_s=600)
    rollout_ops.start(store, store.state_dir, f"{NAME}@2", "d1,d2", policy, now=clock(),
                      rollout_id="r5")
    eng.tick()
    first = {c["device"]: c for c in sent.sent}
    tell(store, "d1", "r5", "RECEIVED", "ACTIVE", ts=clock())
    store.ingest([Inbound("f1", "d2", "cmd/result", BOOT, next(SEQ), "audit", clock(), {
        "id": first["d2"]["id"], "type": "rollout.start", "status": "ok",
        "result": {"accepted": False, "refused": "busy", "live": {"pull": f"{NAME}@2",
                                                                   "pid": 9}}}, clock())])
    clock.now += 10
    plan = eng.tick()["r5"]
    assert (plan.state, plan.retry, plan.counts.get("failed", 0)) == ("RUNNING", (), 0)
    assert len(sent.sent) == 2
    clock.now += 30  # rollout_busy_retry_s
    assert eng.tick()["r5"].retry == ("d2",)
    again = sent.sent[2]
    verify(again, load_public(repo.keys.public_file("command")))
    assert (again["device"], again["type"], again["args"]) == ("d2", "rollout.start",
                                                               first["d2"]["args"])
    assert again["id"] != first["d2"]["id"] and again["seq"] == 2
    assert again["expires_at"] - again["issued_at"] == pytest.approx(600 - 40)
    eng.tick()
    assert len(sent.sent) == 3  # asked once until it answers again
    tell(store, "d2", "r5", "RECEIVED", "ACTIVE", ts=clock())
    plan = eng.tick()["r5"]
    assert plan.state == "COMPLETED" and (plan.counts["succeeded"], plan.counts["failed"]) == (
        2, 0)


def test_a_start_never_published_is_withdrawn_when_the_rollout_stops(
        any_store: Any, repo: Repo) -> None:
    store = any_store
    clock = Clock()
    eng, sent = engine(store, repo, clock)
    rollout_ops.start(store, store.state_dir, f"{NAME}@2", "d1,d2", Policy(
        parse_waves("100%")), now=clock(), rollout_id="r4")
    sent.away = True
    eng.tick()
    rollout_ops.act(store, "r4", "abort", now=clock())
    sent.away = False
    assert eng.tick()["r4"].settled
    assert sent.sent == []  # neither the starts nor cancels of starts that never left
    assert {d.outcome for d in store.rollouts.rollout_devices("r4")} == {"skipped"}
    assert store.rollouts.unpublished_commands("r4") == [] and eng.tick() == {}


def test_without_a_key_rollouts_wait(store: SQLiteStore, repo: Repo,
                                     caplog: pytest.LogCaptureFixture) -> None:
    settings = ControllerSettings(state_dir=store.state_dir)
    recorder = Recorder()
    eng = RolloutEngine(settings, store, None, publisher=recorder)  # type: ignore[arg-type]
    rollout_ops.start(store, store.state_dir, f"{NAME}@2", "all",
                      Policy(parse_waves("100%")), now=1.0, rollout_id="r3")
    assert eng.tick() == {} and eng.tick() == {}
    assert recorder.sent == []
    assert sum("no command_signing_key_file" in m for m in caplog.messages) == 1  # said once


def test_selectors() -> None:
    known = [{"device": d, "fleet": f} for d, f in (
        ("store-001", "north"), ("store-002", "north"), ("store-010", "south"),
        ("lab-1", "south"))]
    assert list(rollout_ops.select_devices(known, "all")) == [
        "lab-1", "store-001", "store-002", "store-010"]
    assert list(rollout_ops.select_devices(known, "fleet:north")) == ["store-001",
                                                                       "store-002"]
    assert list(rollout_ops.select_devices(known, "store-0?0,lab-1")) == ["lab-1",
                                                                           "store-010"]
    assert rollout_ops.select_devices(known, "fleet:south,store-001") == {
        "lab-1": "south", "store-001": "north", "store-010": "south"}
    for bad, why in (("store-999", "never reported"), ("fleet:east", "selects no device"),
                     ("a/b", "device"), ("", "comma-separated"), ("x*", "no device")):
        with pytest.raises(InvalidRequest, match=why):
            rollout_ops.select_devices(known, bad)


def test_refs() -> None:
    assert rollout_ops.parse_ref("gemma3:270m@2") == ("gemma3:270m", "2")
    assert rollout_ops.parse_ref("smollm2@1.5-q4") == ("smollm2:latest", "1.5-q4")
    for bad in ("gemma3:270m", "@2", "gemma3@", "gemma3@/x"):
        with pytest.raises(InvalidRequest):
            rollout_ops.parse_ref(bad)


def cli(config: Path, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, ["fleet", "rollout", *args, "--config", str(config)])
    assert result.exit_code == code, result.output
    return result.output


def test_the_cli_writes_the_store_and_refuses_what_it_cannot_start(
        store: SQLiteStore, repo: Repo, tmp_path: Path) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(f'state_dir = "{store.state_dir}"\n'
                      f'command_signing_key_file = "{repo.keys.private("command")}"\n')
    out = cli(config, "start", f"{NAME}@2", "--devices", "fleet:f1", "--waves",
              "1,10%,50%,100%", "--soak", "10m", "--id", "c1")
    assert "rollout c1: simmodel:1b@2 to 10 device(s) in 3 wave(s) (1, 4, 5)" in out
    assert "fleet serve drives it" in out
    assert "one live rollout per model name" in cli(
        config, "start", f"{NAME}@2", "--waves", "100%", code=1)
    assert "no release simmodel:1b@9" in cli(config, "start", f"{NAME}@9", "--waves",
                                             "100%", code=1)
    assert "last wave must be 100%" in cli(config, "start", "other:1b@2", "--waves", "1,50%",
                                          code=2)
    assert "not a percentage" in cli(config, "start", "other:1b@2", "--waves", "100%",
                                     "--abort-above", "10", code=2)
    assert "never reported" in cli(config, "start", f"{NAME}@2", "--waves", "100%",
                                   "--devices", "nobody", code=2)
    report = json.loads(cli(config, "status", "c1", "--json"))
    assert (report["state"], report["devices_total"], report["policy"]["soak"]) == (
        "RUNNING", 10, "10m")
    assert report["states"] == {"PENDING": 10} and report["phases"]["waiting"] == 10
    assert [w["devices"] for w in report["waves_detail"]] == [1, 4, 5]
    listing = cli(config, "status")
    assert "c1" in listing and "RUNNING" in listing and "0/3" in listing
    assert "PAUSED" in cli(config, "pause", "c1")
    assert "is PAUSED: cannot go PAUSED" in cli(config, "pause", "c1", code=1)
    assert "no rollout nope" in cli(config, "status", "nope", code=1)
    assert "no rollout nope" in cli(config, "abort", "nope", code=1)
    assert json.loads(cli(config, "abort", "c1", "--json"))["state"] == "ABORTED"
    text = cli(config, "status", "c1")
    assert "ABORTED" in text and f"abort by {local_operator()}" in text
    # Each action from the controller host's CLI is on the trail, refused ones too.
    assert [(a.action, a.status) for a in store.audit.actions(target="c1")][-3:] == \
        [("rollout.pause", 200), ("rollout.pause", 409), ("rollout.abort", 200)]
    assert {a.operator for a in store.audit.actions()} == {local_operator()}


def test_the_cli_needs_a_store(tmp_path: Path) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(f'state_dir = "{tmp_path / "empty"}"\n')
    assert "no controller store" in cli(config, "status", code=1)


def test_the_status_shows_a_downloading_boxs_progress_and_watches_to_the_end(
        store: SQLiteStore, repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(f'state_dir = "{store.state_dir}"\n')
    cli(config, "start", f"{NAME}@2", "--devices", "d0,d1", "--waves", "100%", "--id", "p1")
    tell(store, "d0", "p1", "RECEIVED", "DOWNLOADING", ts=10)
    tell(store, "d1", "p1", "RECEIVED", "DOWNLOADING", "VERIFYING", ts=10)
    store.ingest([Inbound("f1", device, "rollout", BOOT, next(SEQ), "audit", 11, {
        "event": "rollout.progress", "rollout_id": "p1", "bytes": 42_000_000,
        "total": 100_000_000, "rate_bps": 3_100_000, "eta_s": 18.7, "ts": 11}, 11)
        for device in ("d0", "d1")])
    rows = {line.split()[0]: line for line in cli(config, "status", "p1").splitlines()
            if line.startswith("d")}
    assert " 42%  3.1 MB/s  ETA 0:19" in rows["d0"]
    assert "%" not in rows["d1"] and "VERIFYING" in rows["d1"]  # done downloading
    shown = {d["device"]: d["progress"]
             for d in json.loads(cli(config, "status", "p1", "--json"))["devices"]}
    assert shown["d0"] == {"bytes": 42_000_000, "total": 100_000_000, "rate_bps": 3_100_000,
                           "eta_s": 18.7, "ts": 11.0, "percent": 42.0}
    assert shown["d1"] is None
    assert "--watch follows one rollout" in cli(config, "status", "--watch", code=2)
    assert "--watch follows one rollout" in cli(config, "status", "--watch", "3", code=2)
    assert "at least 0.5 seconds" in cli(config, "status", "p1", "--watch", "0.1", code=2)
    assert "takes seconds, not 'p2'" in cli(config, "status", "p1", "--watch", "p2", code=2)

    def end_later(after_s: float, state: str) -> threading.Thread:
        def end() -> None:  # what fleet serve would do: the operator's state, settled
            time.sleep(after_s)
            if state == "ABORTED":
                rollout_ops.act(store, "p1", "abort", now=time.time())
            assert store.rollouts.apply_plan("p1", expect=state, state=state, wave=1,
                                             reason=None, settled=True, timed_out=[],
                                             skipped=[], now=time.time())
        thread = threading.Thread(target=end)
        thread.start()
        return thread

    # No terminal: --watch waits for the end, then prints the report once.
    ender, t0 = end_later(0.8, "ABORTED"), time.monotonic()
    out = json.loads(cli(config, "status", "p1", "--watch", "0.5", "--json"))
    ender.join()
    assert out["state"] == "ABORTED" and out["settled"] and time.monotonic() - t0 >= 0.8
    # In a terminal: redrawn every interval until it has ended.
    rollout_ops.act(store, "p1", "rollback", now=time.time())  # work again: unsettled
    monkeypatch.setattr("edge_agent.cli.fleet.rollout.is_terminal", lambda stream: True)
    ender = end_later(0.8, "ROLLED_BACK")
    text = cli(config, "status", "p1", "--watch", "0.5")
    ender.join()
    draws = text.split("rollout p1: simmodel:1b@2")
    assert len(draws) >= 3 and "ROLLED_BACK" in draws[-1], text  # two draws or more
    # The ID may follow --watch too (its default interval then).
    assert "rollout p1: simmodel:1b@2" in cli(config, "status", "--watch", "p1")
