"""Controller rollouts in the store (`rollout_queries`): the same tests on SQLite and on a
private PostgreSQL — one live rollout per name, the boxes' reports applied by the ingest
(their download progress too), commands claimed once and published, the engine's
conditional decisions, the migrations."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.errors import NotFound
from edge_agent.fleet.controller import store as store_module
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.rollout_records import (
    DownloadProgress,
    NewRollout,
    RolloutConflict,
)
from edge_agent.fleet.controller.rollouts.operations import ACTIONS
from edge_agent.fleet.controller.rollouts.operations import report as status_report
from edge_agent.fleet.controller.schema import SCHEMA
from edge_agent.fleet.controller.store import (
    ControllerStore,
    PostgresStore,
    SQLiteStore,
    StoreConflict,
)
from edge_agent.fleet.controller.waves import (
    ABORTED,
    PAUSED,
    PENDING,
    REFUSED,
    RUNNING,
    SENT,
    Policy,
    parse_waves,
)
from tests.support.fleetkit import wait_until

BOOT = "b" * 32
POLICY = Policy(parse_waves("1,100%"), abort_above=0.1, min_executed=2, soak_s=5,
                device_timeout_s=60, rollback_on_abort=True)


def _open(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> ControllerStore:
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "controller.db")
    return PostgresStore(request.getfixturevalue("postgres_url"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ControllerStore]:
    made = _open(request.param, tmp_path, request)
    yield made
    made.close()


def new(rid: str = "r1", name: str = "gemma3:270m", devices: int = 3) -> NewRollout:
    return NewRollout(rid, name, "2", "all", POLICY,
                      {f"d{i}": ("f1", 1 if i == 0 else 2) for i in range(devices)})


class Seqs:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


SEQ = Seqs()


def report(device: str, body: dict[str, Any], *, ts: float, kind: str = "rollout",
           received: float = 1000.0) -> Inbound:
    return Inbound("f1", device, kind, BOOT, SEQ(), "audit", ts, {**body, "ts": ts}, received)


def transition(device: str, to: str, ts: float, rid: str = "r1", **extra: Any) -> Inbound:
    return report(device, {"event": "rollout.transition", "to": to, "rollout_id": rid,
                           "state": to, "reason": extra.pop("reason", None), **extra}, ts=ts,
                  received=extra.pop("received", 1000.0 + ts))


def command(device: str, type_: str, cid: str, seq: int = 1) -> dict[str, Any]:
    return {"v": 1, "id": cid, "fleet": "f1", "device": device, "type": type_, "seq": seq,
            "issued_at": 1.0, "expires_at": 100.0, "args": {"rollout_id": "r1"}, "sig": "x"}


def devices_of(store: ControllerStore, rid: str = "r1") -> dict[str, Any]:
    return {d.device: d for d in store.rollouts.rollout_devices(rid)}


def test_one_live_rollout_per_name(store: ControllerStore) -> None:
    r = store.rollouts.create_rollout(new(), now=1.0)
    assert (r.state, r.live, r.settled, r.wave, r.waves_total, r.devices_total) == (
        RUNNING, True, False, 0, 2, 3)
    assert r.policy() == POLICY
    assert {d.state for d in store.rollouts.rollout_devices("r1")} == {PENDING}
    with pytest.raises(RolloutConflict, match="one live rollout per model name"):
        store.rollouts.create_rollout(new("r2"), now=2.0)
    with pytest.raises(RolloutConflict, match="exists already"):
        store.rollouts.create_rollout(new("r1", name="other:1b"), now=2.0)
    store.rollouts.create_rollout(new("r3", name="other:1b"), now=3.0)  # another name: fine
    store.rollouts.set_rollout_state("r1", ABORTED, ACTIONS["abort"][1], reason="abort", now=4.0)
    assert store.rollouts.create_rollout(new("r2"), now=5.0).state == RUNNING  # r1 no longer live
    assert [r.id for r in store.rollouts.rollouts()] == ["r2", "r3", "r1"]
    assert [r.id for r in store.rollouts.rollouts(unsettled=True)] == ["r2", "r3", "r1"]


def test_operator_transitions_follow_the_rules(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    to, allowed = ACTIONS["resume"]
    with pytest.raises(RolloutConflict, match="is RUNNING"):
        store.rollouts.set_rollout_state("r1", to, allowed, reason="resume", now=2.0)
    paused = store.rollouts.set_rollout_state("r1", PAUSED, ACTIONS["pause"][1], reason="p",
                                              now=2.0)
    assert (paused.state, paused.live, paused.reason) == (PAUSED, True, "p")
    with pytest.raises(NotFound):
        store.rollouts.set_rollout_state("nope", PAUSED, ACTIONS["pause"][1], reason="p", now=2.0)


def test_reports_reach_the_devices_rows_newest_first_wins(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    acks = store.ingest([transition("d0", "RECEIVED", 10), transition("d0", "DOWNLOADING", 11),
                         transition("d1", "RECEIVED", 10),
                         transition("d9", "RECEIVED", 10),  # not in the rollout
                         transition("d2", "RECEIVED", 10, rid="someone-else")])
    assert acks.stored == 5
    rows = devices_of(store)
    assert (rows["d0"].state, rows["d0"].reported_ts) == ("DOWNLOADING", 11)
    assert rows["d1"].state == "RECEIVED" and rows["d2"].state == PENDING
    store.ingest([transition("d0", "RECEIVED", 9)])  # older, arriving late: ignored
    assert devices_of(store)["d0"].state == "DOWNLOADING"
    store.ingest([transition("d0", "ACTIVE", 20, received=1500.0)])
    store.ingest([transition("d0", "ROLLED_BACK", 30, reason="rollback requested")])
    d0 = devices_of(store)["d0"]
    assert (d0.state, d0.active_at, d0.finished_at, d0.reason) == (
        "ROLLED_BACK", 1500.0, 1500.0, "rollback requested")


def test_failed_counts_as_final_only_once_the_box_stops_retrying(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    store.ingest([transition("d0", "FAILED", 10, details={"failures": 1, "limit": 3},
                             reason="unreachable")])
    d0 = devices_of(store)["d0"]
    assert (d0.state, d0.retrying, d0.finished_at) == ("FAILED", True, None)
    store.ingest([transition("d0", "FAILED", 20, details={"failures": 3, "limit": 3})])
    d0 = devices_of(store)["d0"]
    assert (d0.retrying, d0.finished_at) == (False, 1020.0)


def test_refusals_from_events_and_results(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    store.rollouts.claim_commands("r1", {"d0": command("d0", "rollout.start", "c0"),
                                "d1": command("d1", "rollout.start", "c1")}, 2.0)
    busy = {"event": "rollout.refused", "accepted": False, "refused": "busy",
            "rollout_id": "r1", "name": "gemma3:270m",
            "live": {"rollout_id": "other", "state": "STAGED"}}
    store.ingest([report("d0", busy, ts=10)])
    assert devices_of(store)["d0"].state == REFUSED
    assert devices_of(store)["d0"].reason == "refused: busy (rollout other (STAGED) on the box)"
    pulling = {**busy, "live": {"pull": "gemma3:270m@2", "pid": 812}}
    store.ingest([report("d2", pulling, ts=10)])
    assert devices_of(store)["d2"].reason == \
        "refused: busy (models pull gemma3:270m@2 (pid 812) on the box)"
    expired = {"id": "c1", "type": "rollout.start", "status": "refused", "reason": "expired",
               "result": None}
    ok = {"id": "c0", "type": "rollout.start", "status": "ok", "result": {"accepted": True}}
    store.ingest([report("d1", expired, ts=11, kind="cmd/result"),
                  report("d0", ok, ts=12, kind="cmd/result")])
    rows = devices_of(store)
    assert (rows["d1"].state, rows["d1"].reason) == (REFUSED, "refused: expired")
    assert rows["d0"].state == REFUSED  # an ok result never un-refuses
    assert store.command_results("c1")[0]["status"] == "refused"  # stored as before
    # Busy is not the end: the device is retrying, not finished; a refusal is.
    assert (rows["d0"].retrying, rows["d0"].finished_at) == (True, None)
    assert rows["d1"].retrying is False and rows["d1"].finished_at is not None


def test_a_busy_box_gets_a_new_start_and_only_a_busy_one(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    store.rollouts.claim_commands("r1", {"d0": command("d0", "rollout.start", "c0"),
                                "d1": command("d1", "rollout.start", "c1")}, 2.0)
    store.rollouts.mark_published(["c0", "c1"], 3.0)
    busy = {"id": "c0", "type": "rollout.start", "status": "ok",
            "result": {"accepted": False, "refused": "busy"}}
    expired = {"id": "c1", "type": "rollout.start", "status": "refused", "reason": "expired",
               "result": None}
    store.ingest([report("d0", busy, ts=10, kind="cmd/result"),
                  report("d1", expired, ts=10, kind="cmd/result")])
    assert devices_of(store)["d0"].retrying is True
    again = {"d0": command("d0", "rollout.start", "c2"),
             "d1": command("d1", "rollout.start", "c3")}
    claim = store.rollouts.claim_commands
    assert claim("r1", again, 40.0, require_state="RUNNING") == []  # no retry
    assert store.rollouts.claim_commands("r1", again, 40.0, require_state="RUNNING",
                                         retry=True) == ["d0"]
    store.rollouts.mark_published(["c2"], 41.0)
    d0 = devices_of(store)["d0"]
    assert (d0.state, d0.retrying, d0.command_id) == (SENT, False, "c2")
    assert d0.started_at == 3.0  # its device timeout counts from the first start
    assert [c["id"] for c in store.rollouts.unpublished_commands("r1")] == []
    # The second start goes ahead: the box reports, as for any start.
    store.ingest([transition("d0", "RECEIVED", 50)])
    assert devices_of(store)["d0"].state == "RECEIVED"


def test_a_bad_report_is_stored_and_changes_nothing(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    acks = store.ingest([transition("d0", "EXPLODED", 10),
                         report("d0", {"event": "rollout.transition", "rollout_id": 5}, ts=11)])
    assert acks.stored == 2
    assert devices_of(store)["d0"].state == PENDING


def progress(device: str, done: int, ts: float, rid: str = "r1") -> Inbound:
    return report(device, {"event": "rollout.progress", "rollout_id": rid,
                           "name": "gemma3:270m", "bytes": done, "total": 1000,
                           "rate_bps": 250, "eta_s": (1000 - done) / 250}, ts=ts)


def test_the_latest_download_progress_is_kept_and_shown_while_downloading(
        store: ControllerStore) -> None:
    r = store.rollouts.create_rollout(new(), now=1.0)
    store.ingest([transition("d0", "DOWNLOADING", 10), progress("d0", 200, 11),
                  progress("d0", 600, 13), progress("d1", 100, 11),  # d1: still PENDING
                  progress("d2", 100, 11, rid="someone-else")])
    store.ingest([progress("d0", 400, 12)])  # older, arriving late: ignored
    rows = devices_of(store)
    assert rows["d0"].progress == DownloadProgress(600, 1000, 250.0, 1.6, 13.0)
    assert rows["d2"].progress is None
    shown = {d["device"]: d["progress"]
             for d in status_report(r, store.rollouts.rollout_devices("r1"), 20.0)["devices"]}
    assert shown["d0"] == {"bytes": 600, "total": 1000, "rate_bps": 250.0, "eta_s": 1.6,
                           "ts": 13.0, "percent": 60.0}
    assert shown["d1"] is None  # only a DOWNLOADING device's is shown
    acks = store.ingest([report("d0", {"event": "rollout.progress", "rollout_id": "r1",
                                       "bytes": 5, "total": 1, "rate_bps": 1}, ts=14),
                         report("d0", {"event": "rollout.progress", "rollout_id": "r1",
                                       "bytes": "9", "total": 10, "rate_bps": 1}, ts=14)])
    assert acks.stored == 2 and devices_of(store)["d0"].progress.bytes == 600  # type: ignore
    store.ingest([transition("d0", "VERIFYING", 15)])
    d0 = devices_of(store)["d0"]
    assert d0.to_json()["progress"] is None and d0.progress is not None  # kept, not shown
    # A retry downloads again: the earlier attempt's figures are not this download's.
    store.ingest([transition("d0", "FAILED", 16, details={"failures": 1, "limit": 3}),
                  transition("d0", "RECEIVED", 17), transition("d0", "DOWNLOADING", 18)])
    assert devices_of(store)["d0"].to_json()["progress"] is None
    store.ingest([progress("d0", 100, 19)])
    assert devices_of(store)["d0"].to_json()["progress"]["bytes"] == 100


def test_commands_are_claimed_once_and_published(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    starts = {d: command(d, "rollout.start", f"s-{d}") for d in ("d0", "d1")}
    assert store.rollouts.claim_commands("r1", starts, 2.0, require_state=RUNNING) == ["d0", "d1"]
    again = {"d0": command("d0", "rollout.start", "s-d0-again")}
    assert store.rollouts.claim_commands("r1", again, 3.0, require_state=RUNNING) == []
    rows = devices_of(store)
    assert (rows["d0"].state, rows["d0"].command_id, rows["d0"].started_at) == (
        SENT, "s-d0", None)
    assert [c["id"] for c in store.rollouts.unpublished_commands("r1")] == ["s-d0", "s-d1"]
    store.rollouts.mark_published(["s-d0"], 5.0)
    assert [c["id"] for c in store.rollouts.unpublished_commands("r1")] == ["s-d1"]
    assert devices_of(store)["d0"].started_at == 5.0
    cancel = {"d0": command("d0", "rollout.cancel", "k-d0", 2)}
    assert store.rollouts.claim_commands("r1", cancel, 6.0) == ["d0"]
    assert store.rollouts.claim_commands("r1", {"d0": command("d0", "rollout.cancel", "k2", 3)},
                                         7.0) == []
    assert devices_of(store)["d0"].cancel_sent and not devices_of(store)["d0"].rollback_sent
    store.rollouts.set_rollout_state("r1", PAUSED, ACTIONS["pause"][1], reason="p", now=8.0)
    assert store.rollouts.claim_commands("r1", {"d2": command("d2", "rollout.start", "s-d2")}, 9.0,
                                         require_state=RUNNING) == []  # paused meanwhile: not sent


def test_the_engines_decision_applies_only_to_the_state_it_read(store: ControllerStore) -> None:
    store.rollouts.create_rollout(new(), now=1.0)
    assert store.rollouts.apply_plan("r1", expect=RUNNING, state=RUNNING, wave=1, reason=None,
                                     settled=False, timed_out=[], skipped=[], now=2.0)
    r = store.rollouts.rollout("r1")
    assert r is not None and (r.wave, r.wave_started_at) == (1, 2.0)
    store.rollouts.set_rollout_state("r1", ABORTED, ACTIONS["abort"][1], reason="abort", now=3.0)
    assert not store.rollouts.apply_plan("r1", expect=RUNNING, state=RUNNING, wave=2, reason=None,
                                         settled=False, timed_out=[], skipped=[], now=4.0)
    assert store.rollouts.apply_plan("r1", expect=ABORTED, state=ABORTED, wave=1, reason=None,
                                     settled=True, timed_out=["d0"], skipped=["d1", "d2"], now=5.0)
    r = store.rollouts.rollout("r1")
    assert r is not None and (r.state, r.settled, r.reason, r.live) == (
        ABORTED, True, "abort", False)
    rows = devices_of(store)
    assert (rows["d0"].outcome, rows["d0"].finished_at) == ("timed_out", 5.0)
    assert rows["d1"].outcome == "skipped" and rows["d1"].reason == "rollout stopped first"
    assert store.rollouts.rollouts(unsettled=True) == []
    store.rollouts.set_rollout_state("r1", "ROLLED_BACK", ACTIONS["rollback"][1], reason="rb",
                                     now=6.0)
    assert [r.id for r in store.rollouts.rollouts(unsettled=True)] == ["r1"]  # work again


def test_next_command_seqs_share_the_streams_with_fleet_send(store: ControllerStore) -> None:
    assert store.next_command_seq("f1/d0") == 1
    assert store.rollouts.next_command_seqs(["f1/d0", "f1/d1"]) == {"f1/d0": 2, "f1/d1": 1}
    assert store.next_command_seq("f1/d1") == 2


def _migrated(kind: str, before: str, fill: Callable[[ControllerStore], object], tmp_path: Path,
              request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              also: tuple[str, ...] = ()) -> ControllerStore:
    """A store made with the schema steps before `before` (and the later ones `also`
    names: columns today's code writes as it fills) and filled by `fill`, then opened
    again with every step."""
    monkeypatch.setattr(store_module, "SCHEMA", tuple(s for s in SCHEMA
                                                      if s[0] < before or s[0] in also))
    first = _open(kind, tmp_path, request)
    fill(first)
    first.close()
    monkeypatch.setattr(store_module, "SCHEMA", SCHEMA)
    return _open(kind, tmp_path, request)


KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_of_the_previous_schema_gains_the_rollouts_and_keeps_its_data(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    again = _migrated(kind, "m003", lambda first: first.ingest(
        [report("d0", {"event": "hello"}, ts=1, kind="events")]), tmp_path, request,
        monkeypatch)
    try:
        assert len(again.messages("d0", kind="events")) == 1
        assert again.rollouts.create_rollout(new(), now=1.0).state == RUNNING
    finally:
        again.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_without_the_progress_columns_gains_them_and_keeps_its_rollouts(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fill(first: ControllerStore) -> None:
        first.rollouts.create_rollout(new(), now=1.0)
        first.ingest([transition("d0", "DOWNLOADING", 10)])

    # `fill` is today's code: it writes a rollout's capacity config (m013) too.
    again = _migrated(kind, "m004", fill, tmp_path, request, monkeypatch,
                      also=("m013_capacity_rollouts",))
    try:
        d0 = devices_of(again)["d0"]
        assert (d0.state, d0.progress) == ("DOWNLOADING", None)
        again.ingest([progress("d0", 500, 11)])
        assert devices_of(again)["d0"].progress == DownloadProgress(500, 1000, 250.0, 2.0,
                                                                   11.0)
    finally:
        again.close()


@pytest.mark.postgres
def test_a_deadlock_with_another_writer_is_a_conflict_that_leaves_nothing_behind(
        postgres_url: str) -> None:
    """The circle is closed by hand: another session holds d1's row, the ingest takes d0's
    and waits for d1's, the other session then asks for d0's. PostgreSQL rolls the ingest
    back whole; the store says so as a `StoreConflict`, and the same batch, tried again,
    goes through once."""
    import psycopg

    store = PostgresStore(postgres_url)
    other = psycopg.connect(postgres_url)
    watcher = psycopg.connect(postgres_url, autocommit=True)
    try:
        store.rollouts.create_rollout(new(devices=2), now=1.0)
        batch = [transition("d0", "RECEIVED", 10), transition("d1", "RECEIVED", 10)]
        # This side waits long before looking for a circle: the ingest is the one it ends.
        other.execute("SET deadlock_timeout = '60s'")
        other.execute("UPDATE rollout_devices SET reason = 'held' WHERE device = 'd1'")
        failed: list[Exception] = []

        def ingest() -> None:
            try:
                store.ingest(batch)
            except Exception as exc:
                failed.append(exc)

        thread = threading.Thread(target=ingest)
        thread.start()
        assert wait_until(lambda: watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()").fetchone() == (1,), timeout=10)
        other.execute("UPDATE rollout_devices SET reason = 'held' WHERE device = 'd0'")
        thread.join(timeout=30)
        other.rollback()
        assert len(failed) == 1 and isinstance(failed[0], StoreConflict), failed
        assert failed[0].status_code == 503 and failed[0].retry_after == 1.0
        assert "deadlock detected" in str(failed[0])
        assert store.messages("d0") == [] and store.counts() == (0, 0)
        assert {d.state for d in store.rollouts.rollout_devices("r1")} == {PENDING}
        acks = store.ingest(batch)
        assert (acks.stored, acks.duplicates) == (2, 0)
        assert {d.state for d in store.rollouts.rollout_devices("r1")} == {"RECEIVED"}
    finally:
        other.close()
        watcher.close()
        store.close()


@pytest.mark.postgres
def test_two_controllers_taking_the_same_boxes_messages_in_either_order_never_deadlock(
        postgres_url: str) -> None:
    """A shared subscription hands each controller some of every box's messages, in no
    particular order: the ingest locks rows in the boxes' order, so two batches over the
    same boxes wait on each other and never in a circle."""
    stores = [PostgresStore(postgres_url), PostgresStore(postgres_url)]
    try:
        stores[0].rollouts.create_rollout(new(devices=20), now=1.0)
        boxes = [f"d{i}" for i in range(20)]
        batches = [[[transition(d, "DOWNLOADING", 10 + n) for d in order] for n in range(40)]
                   for order in (boxes, boxes[::-1])]
        errors: list[Exception] = []
        start = threading.Barrier(2)

        def feed(store: ControllerStore, mine: list[list[Inbound]]) -> None:
            start.wait()
            for batch in mine:
                try:
                    store.ingest(batch)
                except Exception as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=feed, args=pair) for pair in zip(stores, batches,
                                                                              strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == []
        rows = devices_of(stores[0])
        assert {(d.state, d.reported_ts) for d in rows.values()} == {("DOWNLOADING", 49)}
    finally:
        for store in stores:
            store.close()
