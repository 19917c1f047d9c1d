"""The controller's store: the same tests on SQLite and on a private PostgreSQL."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.store import (
    ControllerStore,
    FleetStoreError,
    PostgresStore,
    SQLiteStore,
    open_store,
)
from edge_agent.fleet.protocol.envelope import complement, merge_ranges, to_ranges

BOOT, BOOT2 = "a" * 32, "b" * 32


def msg(seq: int, *, device: str = "d1", boot: str = BOOT, kind: str = "metrics",
        body: dict[str, Any] | None = None, ts: float | None = None,
        received: float = 1000.0) -> Inbound:
    return Inbound("f1", device, kind, boot, seq, "metrics" if kind == "metrics" else "audit",
                   float(seq) if ts is None else ts, body or {"n": seq}, received)


def test_ranges() -> None:
    assert to_ranges([1, 2, 3, 7, 5, 6, 9, 9]) == [[1, 3], [5, 7], [9, 9]]
    assert merge_ranges([[5, 6], [1, 3], [2, 4], [8, 8]]) == [[1, 6], [8, 8]]
    assert complement([[2, 3], [6, 7]], 9) == [[1, 1], [4, 5], [8, 9]]
    assert complement([[1, 9]], 9) == []


def test_ingest_stores_each_message_once_and_acks_duplicates_too(store: ControllerStore) -> None:
    first = store.ingest([msg(s) for s in (1, 2, 3, 5)] + [msg(1, device="d2")])
    assert (first.stored, first.duplicates) == (5, 0)
    assert first.ranges == {"d1": {BOOT: [[1, 3], [5, 5]]}, "d2": {BOOT: [[1, 1]]}}
    again = store.ingest([msg(s) for s in (2, 3, 4, 4, 6)])
    assert (again.stored, again.duplicates) == (2, 3)  # 4 and 6 new; 2, 3 and the 2nd 4 dups
    assert again.ranges == {"d1": {BOOT: [[2, 4], [6, 6]]}}
    assert again.payload("d1") == (b'{"v":1,"device":"d1","acks":{"' + BOOT.encode()
                                   + b'":[[2,4],[6,6]]}}')
    assert [m["seq"] for m in store.messages("d1", limit=100)] == [1, 2, 3, 4, 5, 6]
    assert store.messages("d1", limit=1)[0]["body"] == {"n": 1}  # the first copy kept


def test_the_same_seq_in_another_boot_is_another_message(store: ControllerStore) -> None:
    acks = store.ingest([msg(1), msg(1, boot=BOOT2)])
    assert acks.stored == 2
    assert acks.ranges["d1"] == {BOOT: [[1, 1]], BOOT2: [[1, 1]]}
    assert store.boots("d1") == [BOOT, BOOT2]


def test_gaps_are_seqs_neither_stored_nor_reported_dropped(store: ControllerStore) -> None:
    store.ingest([msg(s) for s in (1, 2, 5, 6, 9)])
    assert store.gaps("d1", BOOT) == [[3, 4], [7, 8]]
    dropped = {"event": "outbox.dropped", "class": "metrics", "count": 2, "bytes": 600,
               "ranges": {BOOT: [[3, 4]]}}
    store.ingest([msg(10, kind="events", body=dropped)])
    assert store.dropped("d1", BOOT) == [[3, 4]]
    assert store.gaps("d1", BOOT) == [[7, 8]]
    assert store.record_dropped("d1", {BOOT: [[7, 8]]}, 1000.0) == 1
    assert store.record_dropped("d1", {BOOT: [[7, 8]]}, 1000.0) == 0  # reported twice
    assert store.gaps("d1", BOOT) == []
    assert store.stored_ranges("d1", BOOT) == [[1, 2], [5, 6], [9, 10]]
    assert store.gaps("nobody", BOOT) == []


def test_a_dropped_report_for_a_boot_not_seen_yet_counts_once_stored(
        store: ControllerStore) -> None:
    dropped = {"event": "outbox.dropped", "ranges": {BOOT2: [[1, 5]]}}
    store.ingest([msg(1, kind="events", body=dropped), msg(1, kind="events", body=dropped)])
    store.ingest([msg(s, boot=BOOT2) for s in (6, 7)])
    assert store.gaps("d1", BOOT2) == []


def test_a_malformed_dropped_report_is_stored_but_changes_nothing(store: ControllerStore) -> None:
    bad = {"event": "outbox.dropped", "ranges": {BOOT: [[5, 1]]}}
    assert store.ingest([msg(1, kind="events", body=bad)]).stored == 1
    assert store.dropped("d1", BOOT) == []
    with pytest.raises(ValueError):
        store.record_dropped("d1", {BOOT: [[1, "x"]]}, 0.0)


def birth(bdseq: int, **extra: Any) -> dict[str, Any]:
    return {"v": 1, "type": "birth", "device": "d1", "fleet": "f1", "boot_id": BOOT,
            "bdseq": bdseq, "ts": 1.0, "agent_version": "0.1.0", "llama_cpp_version": "0.3.36",
            "models": [{"name": "smollm2:135m", "digest": "x", "active": True},
                       {"name": "other", "digest": "y", "active": False}],
            "tenants": ["default"], **extra}


def death(bdseq: int) -> dict[str, Any]:
    return {"v": 1, "type": "death", "device": "d1", "fleet": "f1", "boot_id": BOOT,
            "bdseq": bdseq, "ts": 2.0}


def test_birth_online_death_of_the_same_session_offline(store: ControllerStore) -> None:
    store.birth("f1", "d1", birth(12), 100.0)
    found = store.device("d1")
    assert found is not None
    assert (found["online"], found["bdseq"], found["agent_version"]) == (True, 12, "0.1.0")
    assert found["active_models"] == ["smollm2:135m"]
    assert store.counts() == (1, 1)
    assert store.death("f1", "d1", death(12), 200.0) is True
    found = store.device("d1")
    assert found is not None and found["online"] is False and found["last_seen"] == 200.0
    assert store.counts() == (1, 0)


def test_a_models_state_event_updates_the_view_and_only_a_newer_report_wins(
        store: ControllerStore) -> None:
    """The box's models.state (an events message, through the outbox) changes what
    `fleet devices` shows without a rebirth; of a birth and an event, the one the box sent
    later (its `ts`) is the view, whichever arrives last."""
    def state(ts: float, *models: tuple[str, str, bool]) -> Inbound:
        return msg(int(ts), kind="events", ts=ts, body={"event": "models.state", "models": [
            {"name": n, "digest": d, "active": a, "loaded": False} for n, d, a in models]})

    b = birth(12)
    b["ts"] = 100.0
    store.birth("f1", "d1", b, 100.0)
    store.ingest([state(110.0, ("gemma3:270m", "v2", True), ("gemma3:270m", "v1", False),
                        ("smollm2:135m", "s1", True))])
    found = store.device("d1")
    assert found is not None
    assert found["active_models"] == ["gemma3:270m", "smollm2:135m"]
    assert {(m["name"], m["digest"], m["active"]) for m in found["models"]} == {
        ("gemma3:270m", "v2", True), ("gemma3:270m", "v1", False),
        ("smollm2:135m", "s1", True)}
    store.ingest([state(105.0, ("gemma3:270m", "v1", True))])  # sent earlier, came late
    assert {m["digest"] for m in store.device("d1")["models"]} == {"v1", "v2", "s1"}  # type: ignore[index]
    later = birth(13)
    later["ts"] = 120.0
    store.birth("f1", "d1", later, 120.0)  # a newer birth wins again
    assert store.device("d1")["active_models"] == ["smollm2:135m"]  # type: ignore[index]
    bad = msg(130, kind="events", ts=130.0, body={"event": "models.state",
                                                  "models": [{"name": "m"}]})
    assert store.ingest([bad]).stored == 1  # stored, logged; the view is not changed
    assert store.device("d1")["active_models"] == ["smollm2:135m"]  # type: ignore[index]


def test_a_stale_death_leaves_the_newer_session_online(store: ControllerStore) -> None:
    store.birth("f1", "d1", birth(12), 100.0)
    store.birth("f1", "d1", birth(13), 101.0)  # reconnected before the old Will fired
    assert store.death("f1", "d1", death(12), 102.0) is False
    found = store.device("d1")
    assert found is not None and found["online"] is True and found["bdseq"] == 13
    assert store.death("f1", "d1", death(13), 103.0) is True


def test_a_death_first_makes_an_offline_device(store: ControllerStore) -> None:
    assert store.death("f1", "d9", death(3) | {"device": "d9"}, 50.0) is False
    assert [(d["device"], d["online"]) for d in store.devices()] == [("d9", False)]


def test_ingest_makes_devices_known_and_last_seen_moves_forward_only(
        store: ControllerStore) -> None:
    store.ingest([msg(1, received=500.0)])
    store.ingest([msg(2, received=400.0)])
    found = store.device("d1")
    assert found is not None
    assert (found["online"], found["last_seen"], found["first_seen"]) == (False, 500.0, 500.0)
    assert found["messages"] == {"metrics": 2}


def test_latest_metrics_is_the_newest_by_device_time(store: ControllerStore) -> None:
    store.ingest([msg(1, ts=30.0), msg(2, ts=10.0), msg(3, kind="events", ts=99.0)])
    latest = store.latest_metrics("d1")
    assert latest is not None and latest["seq"] == 1 and latest["body"] == {"n": 1}
    assert store.latest_metrics("nobody") is None


def test_command_streams_are_separate_and_monotonic(store: ControllerStore) -> None:
    assert [store.next_command_seq("f1/d1") for _ in range(3)] == [1, 2, 3]
    assert store.next_command_seq("f1/all") == 1
    assert store.next_command_seq("f1/d1") == 4


def test_command_seq_is_unique_under_threads(store: ControllerStore) -> None:
    got: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(20):
            seq = store.next_command_seq("f1/all")
            with lock:
                got.append(seq)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 81))


def test_commands_and_their_results(store: ControllerStore) -> None:
    command = {"v": 1, "id": "c1", "fleet": "f1", "device": "all", "type": "ping", "seq": 1,
               "issued_at": 10.0, "expires_at": 310.0, "args": {}, "sig": "x"}
    store.record_command(command, 10.0)
    store.record_command(command, 11.0)  # idempotent
    result = {"id": "c1", "type": "ping", "status": "ok", "reason": None,
              "result": {"pong": True}}
    store.ingest([msg(1, kind="cmd/result", body=result),
                  msg(1, device="d2", kind="cmd/result", body=result | {"status": "refused",
                                                                         "reason": "expired",
                                                                         "result": None})])
    assert store.command_result("d1", result | {"status": "failed"}, 12.0) is False  # first kept
    got = store.command_results("c1")
    assert [(r["device"], r["status"], r["reason"], r["result"]) for r in got] == [
        ("d1", "ok", None, {"pong": True}), ("d2", "refused", "expired", None)]


def test_reopening_keeps_everything(tmp_path: Path) -> None:
    first = open_store(None, tmp_path)
    assert isinstance(first, SQLiteStore) and first.path == tmp_path / "controller.db"
    first.ingest([msg(1)])
    first.close()
    again = open_store(f"sqlite://{tmp_path / 'controller.db'}", Path("/nonexistent"))
    assert again.ingest([msg(1)]).duplicates == 1
    again.close()


@pytest.mark.postgres
def test_postgres_reopening_keeps_everything_and_migrates_once(postgres_url: str) -> None:
    first = PostgresStore(postgres_url)
    first.ingest([msg(1)])
    first.close()
    again = open_store(postgres_url, Path("/nonexistent"))
    assert again.ingest([msg(1)]).duplicates == 1
    again.close()


def test_an_unreadable_database_is_reported_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "controller.db"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(FleetStoreError, match="left as it is"):
        SQLiteStore(path)
    assert path.read_bytes() == b"not a database" * 100


def test_an_unreachable_postgres_is_one_clear_error() -> None:
    with pytest.raises(FleetStoreError, match="cannot reach") as info:
        PostgresStore("postgresql://u:secret@127.0.0.1:1/x", connect_timeout=2)
    assert "secret" not in str(info.value)


def test_open_store_refuses_other_urls(tmp_path: Path) -> None:
    with pytest.raises(FleetStoreError, match="--db"):
        open_store("mysql://x/y", tmp_path)


def test_device_text_the_databases_would_refuse_is_made_safe(store: ControllerStore) -> None:
    """NUL (PostgreSQL text refuses it), nested values and huge numbers from a device must
    not fail a commit: a failed commit would hold back every other device's messages."""
    result = {"id": "c1", "type": {"x": 1}, "status": "failed", "reason": "bad\x00byte",
              "result": {"err": "nul\x00inside"}}
    store.ingest([msg(1, kind="cmd/result", body=result),
                  msg(2, kind="events", body={"text": "nul\x00inside"})])
    got = store.command_results("c1")[0]
    assert got["reason"] == "bad\ufffdbyte" and got["type"] == '{"x":1}'
    assert got["result"] == {"err": "nul\x00inside"}
    assert store.messages("d1", kind="events")[0]["body"] == {"text": "nul\x00inside"}
    store.birth("f1", "d1", birth(1) | {"boot_id": "a\x00b"}, 1.0)
    with pytest.raises(ValueError):
        store.record_dropped("d1", {BOOT: [[1, 2**63]]}, 0.0)
    assert store.ingest([msg(3, kind="events", body={"event": "outbox.dropped",
                                                     "ranges": {BOOT: [[1, 2**70]]}})]).stored == 1


def test_retention_removes_old_messages_in_batches_and_keeps_loss_accounting(
        store: ControllerStore) -> None:
    """Metrics older than their retention go, audit messages by their own; what went is
    accounted for (no gap), a loss above it still shows, and nothing younger is touched."""
    from edge_agent.config.controller import RetentionSettings
    from edge_agent.fleet.controller.retention import Retention, cutoffs

    old, new = 1_000.0, 1_000.0 + 40 * 86400
    store.ingest([msg(s, received=old) for s in range(1, 8)]  # 7 old metrics
                 + [msg(8, kind="events", received=old)]  # an old audit message
                 + [msg(s, received=new) for s in (9, 11)])  # 10 never came: a loss
    settings = RetentionSettings(metrics_days=30, audit_days=365, batch=3)
    assert cutoffs(settings, new) == {"metrics": new - 30 * 86400, "audit": new - 365 * 86400}
    assert Retention(settings, store.retention, clock=lambda: new).run_once() == 7  # 3 + 3 + 1
    assert store.stored_ranges("d1", BOOT) == [[8, 9], [11, 11]]
    assert store.retention.retired("d1", BOOT) == 7 and store.retention.retired("d1", BOOT2) == 0
    assert store.gaps("d1", BOOT) == [[10, 10]]  # the purge is no loss; the loss stays
    assert store.latest_metrics("d1") is not None  # the young ones are there
    # A year on, the audit message goes too; the watermark only moves up.
    later = new + 400 * 86400
    assert Retention(settings, store.retention, clock=lambda: later).run_once() == 3
    assert store.retention.retired("d1", BOOT) == 11 and store.gaps("d1", BOOT) == []
    assert Retention(RetentionSettings(metrics_days=None, audit_days=None),
                     store.retention).run_once() == 0


def test_the_retention_thread_survives_a_failed_pass(caplog: pytest.LogCaptureFixture) -> None:
    from edge_agent.config.controller import RetentionSettings
    from edge_agent.fleet.controller.retention import Retention

    calls: list[dict[str, float]] = []
    done = threading.Event()

    class Store:
        def purge_messages(self, before: Any, batch: int = 5000) -> int:
            calls.append(dict(before))
            if len(calls) == 1:
                raise RuntimeError("the database went away")
            done.set()
            return 0

    retention = Retention(RetentionSettings(metrics_days=1, audit_days=None, every_s=0.05),
                          Store())
    retention.start()
    try:
        assert done.wait(10)
    finally:
        retention.stop()
    assert set(calls[0]) == {"metrics"}  # audit kept for ever: no cutoff
    assert "this pass failed" in caplog.text
    idle = Retention(RetentionSettings(metrics_days=None, audit_days=None), Store())
    idle.start()
    assert idle._thread is None  # noqa: SLF001 - nothing to purge, no thread


def test_loss_accounting_per_boot_as_an_operator_reads_it(store: ControllerStore) -> None:
    """Stored 1-3, 6 and 9-10 of one boot, 4-5 reported dropped, 7-8 never seen: 2 seqs
    missing; two duplicates counted on that boot; the other boot whole; the outbox backlog
    from the newest metrics."""
    store.ingest([msg(s) for s in (1, 2, 3, 6, 9)])
    store.ingest([msg(2), msg(3)])  # duplicates
    store.record_dropped("d1", {BOOT: [[4, 5]]}, 1000.0)
    store.ingest([msg(10, body={"outbox": {"depth": 42, "oldest_age_s": 3.5}}, ts=50.0)])
    store.ingest([msg(s, boot=BOOT2) for s in (1, 2)])
    loss = store.loss("d1")
    by_boot = {b["boot_id"]: b for b in loss["boots"]}
    assert by_boot[BOOT] == {
        "boot_id": BOOT, "highest_seq": 10, "stored": 6, "gaps": [[7, 8]], "missing": 2,
        "dropped": [[4, 5]], "retired_through": 0, "duplicates": 2}
    assert by_boot[BOOT2]["missing"] == 0 and by_boot[BOOT2]["duplicates"] == 0
    assert (loss["missing"], loss["duplicates"]) == (2, 2)
    assert loss["outbox"] == {"depth": 42, "oldest_age_s": 3.5, "reported": 50.0}
    assert store.loss("nobody") == {"device": "nobody", "boots": [], "missing": 0,
                                    "duplicates": 0, "outbox": None}


def test_every_table_the_controller_stores_is_listed_in_one_place() -> None:
    """`controller.schema`'s table names every table its steps create, and no other."""
    import re

    from edge_agent.fleet.controller import schema
    created = {m for _, steps in schema.SCHEMA for s in steps
               for m in re.findall(r"CREATE TABLE (\w+)", s)}
    listed = set(re.findall(r"^\| `(\w+)` \|", schema.__doc__ or "", re.M))
    assert created == listed
    assert len(created) == 21
