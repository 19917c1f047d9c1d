"""The outbox: committed in batches, deleted only by the controller's acks, kept across
restarts, metrics dropped (and reported) over the budget, a corrupt file moved aside, and
a kill -9 leaving a gap-free prefix."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from edge_agent.fleet.device.link.outbox import Outbox, OutboxFull
from edge_agent.fleet.protocol.envelope import decode

DEVICE = "store-042"


def boot() -> str:
    return uuid.uuid4().hex


def committed(path: Path) -> list[tuple[str, int, str]]:
    """(boot_id, seq, class) of every row in the file, read by a separate connection."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT boot_id, seq, class FROM outbox ORDER BY id").fetchall()
    finally:
        conn.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "outbox.db"


def test_appends_are_buffered_and_committed_by_flush(path: Path) -> None:
    b = boot()
    box = Outbox(path, device=DEVICE, boot_id=b, max_bytes=1 << 20)
    seqs = [box.append("metrics", "metrics", {"n": i}) for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5]
    assert committed(path) == []  # nothing on disk before the flush
    assert box.stats().buffered == 5
    assert box.flush() == 5
    assert [r[1] for r in committed(path)] == [1, 2, 3, 4, 5]
    assert box.append("events", "audit", {"e": 1}) == 6  # seq continues across flushes
    assert box.flush() == 1 and box.flush() == 0
    rows = box.pending(10)
    assert [r.seq for r in rows] == [1, 2, 3, 4, 5, 6]
    env = decode(rows[0].payload)
    assert (env.device, env.boot_id, env.seq, env.kind, env.cls, env.body) == (
        DEVICE, b, 1, "metrics", "metrics", {"n": 0})
    assert rows[5].kind == "events" and rows[5].cls == "audit"
    box.close()


def test_commit_true_is_durable_before_append_returns(path: Path) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    box.append("metrics", "metrics", {"n": 1})
    box.append("cmd/result", "audit", {"id": "x"}, commit=True)
    assert [r[1] for r in committed(path)] == [1, 2]  # the earlier row too, in seq order
    box.close()


@pytest.mark.parametrize(("kind", "cls", "body"), [
    ("metrics", "audit", {}), ("events", "metrics", {}), ("status", "audit", {}),
    ("nope", "audit", {}), ("events", "audit", {"x": float("nan")}),
    ("events", "audit", {"x": {1, 2}}), ("events", "audit", {"x": "\ud800"}),
    ("events", "audit", {"x": "a" * (256 * 1024)}),
])
def test_bad_appends_are_refused_without_using_a_seq(path: Path, kind: str, cls: str,
                                                     body: dict) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    with pytest.raises(ValueError):
        box.append(kind, cls, body)
    assert box.append("events", "audit", {}) == 1
    box.close()


def test_ack_deletes_exactly_the_ranges(path: Path) -> None:
    b = boot()
    box = Outbox(path, device=DEVICE, boot_id=b, max_bytes=1 << 20)
    for i in range(10):
        box.append("metrics", "metrics", {"n": i})
    box.flush()
    assert box.ack({b: [[2, 3], [7, 7]]}) == 3
    assert [r[1] for r in committed(path)] == [1, 4, 5, 6, 8, 9, 10]
    assert box.stats().depth == 7
    # Repeated, overlapping, unknown boots and seqs never sent: harmless.
    assert box.ack({b: [[1, 4], [3, 5], [2, 2]], boot(): [[1, 100]]}) == 3
    assert box.ack({b: [[1, 5]]}) == 0
    assert box.ack({b: [[50, 60]]}) == 0
    assert [r[1] for r in committed(path)] == [6, 8, 9, 10]
    stats = box.stats()
    assert stats.depth == 4
    assert stats.bytes == sum(r.size for r in box.pending(100))
    box.close()


@pytest.mark.parametrize("acks", [
    {"nothex": [[1, 2]]}, {"0" * 32: [[2, 1]]}, {"0" * 32: [[0, 1]]}, {"0" * 32: [[1]]},
    {"0" * 32: [[1, "2"]]}, {"0" * 32: [[True, 2]]}, {"0" * 32: "1-2"}, [],
])
def test_malformed_acks_delete_nothing(path: Path, acks: object) -> None:
    b = "0" * 32
    box = Outbox(path, device=DEVICE, boot_id=b, max_bytes=1 << 20)
    box.append("events", "audit", {})
    box.flush()
    with pytest.raises(ValueError):
        box.ack(acks)  # type: ignore[arg-type]
    assert box.stats().depth == 1
    box.close()


def test_sent_rows_are_offered_again_only_on_resend(path: Path) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    for i in range(5):
        box.append("metrics", "metrics", {"n": i})
    box.flush()
    first = box.pending(3)
    box.mark_sent(r.id for r in first)
    assert [r.seq for r in box.pending(10)] == [4, 5]
    assert box.resend_all(older_than_s=60) == 0  # sent just now: not overdue
    assert box.resend_all() == 3
    assert [r.seq for r in box.pending(10)] == [1, 2, 3, 4, 5]
    box.close()


def test_restart_keeps_pending_rows_and_resends_them(path: Path) -> None:
    old = boot()
    box = Outbox(path, device=DEVICE, boot_id=old, max_bytes=1 << 20)
    for i in range(4):
        box.append("metrics", "metrics", {"n": i})
    box.flush()
    box.mark_sent(r.id for r in box.pending(10))
    box.append("events", "audit", {"e": "last"})  # buffered: close commits it
    box.close()

    new = boot()
    box = Outbox(path, device=DEVICE, boot_id=new, max_bytes=1 << 20)
    assert box.append("events", "audit", {"e": "new boot"}, commit=True) == 1  # new boot: 1
    rows = box.pending(10)  # sent marks did not survive: nothing is in flight after a start
    assert [(r.boot_id, r.seq) for r in rows] == [(old, 1), (old, 2), (old, 3), (old, 4),
                                                    (old, 5), (new, 1)]
    assert decode(rows[0].payload).boot_id == old  # resent as it was
    box.ack({old: [[1, 5]]})
    box.close()

    # The same boot id reopened continues its seqs even though its rows were acked.
    box = Outbox(path, device=DEVICE, boot_id=old, max_bytes=1 << 20)
    assert box.append("events", "audit", {}, commit=True) == 6
    box.close()


def _fill(box: Outbox, n: int, cls: str = "metrics", pad: int = 900) -> list[int]:
    kind = "metrics" if cls == "metrics" else "events"
    seqs = [box.append(kind, cls, {"pad": "x" * pad}) for _ in range(n)]
    box.flush()
    return seqs


def test_budget_drops_only_metrics_oldest_first_and_reports_the_ranges(path: Path) -> None:
    b = boot()
    box = Outbox(path, device=DEVICE, boot_id=b, max_bytes=20_000)
    audit = box.append("events", "audit", {"pad": "a" * 900})  # seq 1, oldest of all
    box.flush()
    _fill(box, 15)  # seqs 2..16, ~1 KB each: under 20 KB
    assert box.stats().dropped_rows == 0
    box.append("events", "audit", {"pad": "a" * 900})  # seq 17, between the metrics
    _fill(box, 6)  # seqs 18..23: over the budget
    stats = box.stats()
    assert stats.bytes <= 20_000 * 0.9 + 1200  # down to the low-water mark (+ the report)
    rows = committed(path)
    kept = [seq for _, seq, cls in rows if cls == "metrics"]
    dropped = sorted((set(range(2, 17)) | set(range(18, 24))) - set(kept))
    assert dropped == list(range(2, 2 + len(dropped)))  # the oldest metrics went
    assert (b, audit, "audit") in rows and (b, 17, "audit") in rows  # audit stays
    report = decode(box.pending(100)[-1].payload)
    assert (report.kind, report.cls, report.seq) == ("events", "audit", 24)
    body = report.body
    assert body["event"] == "outbox.dropped" and body["class"] == "metrics"
    assert body["count"] == len(dropped) == stats.dropped_rows
    assert body["bytes"] == stats.dropped_bytes
    assert body["ranges"] == {b: [[dropped[0], dropped[-1]]]}
    box.close()


def test_dropped_ranges_skip_audit_seqs_and_span_boots(path: Path) -> None:
    old = boot()
    box = Outbox(path, device=DEVICE, boot_id=old, max_bytes=64 * 1024)
    for _ in range(10):
        box.append("metrics", "metrics", {"pad": "x" * 900})
        box.append("events", "audit", {"e": 1})
    box.close()  # old: metrics at odd seqs 1..19, audit at even seqs
    new = boot()
    box = Outbox(path, device=DEVICE, boot_id=new, max_bytes=12_000)
    box.append("metrics", "metrics", {"pad": "x" * 900})
    box.flush()
    report = decode(box.pending(100)[-1].payload).body
    assert report["ranges"][old] == [[s, s] for s in range(1, 2 * report["count"], 2)][:len(
        report["ranges"][old])]
    assert all(seq % 2 == 1 for a, b in report["ranges"][old] for seq in (a, b))
    assert new not in report["ranges"]  # the newest row was not needed
    box.close()


def test_audit_is_never_dropped_even_past_the_budget(path: Path) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=64 * 1024)
    _fill(box, 100, cls="audit")  # ~ 100 KB of audit
    _fill(box, 3)
    stats = box.stats()
    assert stats.bytes > 64 * 1024
    classes = [cls for _, _, cls in committed(path)]
    assert classes.count("audit") >= 100  # the 100, and the drop report
    assert "metrics" not in classes
    assert stats.dropped_rows == 3
    box.close()


def test_metrics_are_refused_when_the_buffer_itself_is_full(path: Path) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=64 * 1024)
    for _ in range(50):
        box.append("metrics", "metrics", {"pad": "x" * 1000})
    with pytest.raises(OutboxFull):
        for _ in range(20):
            box.append("metrics", "metrics", {"pad": "x" * 1000})
    seq = box.append("events", "audit", {})  # audit is still taken, next seq, no gap
    box.flush()
    assert [s for _, s, _ in committed(path)][-1] == seq
    assert box.stats().refused == 1
    box.close()


def test_a_flush_that_fails_keeps_its_rows(path: Path) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    box.append("events", "audit", {})
    writer = sqlite3.connect(path, timeout=0)
    writer.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    box._db.conn.execute("PRAGMA busy_timeout = 0")  # noqa: SLF001
    with pytest.raises(sqlite3.OperationalError):
        box.flush()
    writer.rollback()
    writer.close()
    assert box.stats().buffered == 1
    assert box.append("events", "audit", {}) == 2
    assert box.flush() == 2
    assert [s for _, s, _ in committed(path)] == [1, 2]
    box.close()


def test_a_corrupt_outbox_is_moved_aside_and_a_new_one_works(path: Path) -> None:
    path.write_bytes(b"this is not a database, " * 200)
    Path(f"{path}-wal").write_bytes(b"junk wal")
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    moved = box.corrupt_moved
    assert moved is not None and moved.parent == path.parent
    assert moved.name.startswith("outbox.db.corrupt-") and moved.name.endswith("Z")
    assert moved.read_bytes().startswith(b"this is not a database")  # kept, not deleted
    assert Path(f"{moved}-wal").read_bytes() == b"junk wal"
    rows = box.pending(10)
    event = decode(rows[0].payload)
    assert (event.seq, event.kind, event.cls) == (1, "events", "audit")
    assert event.body["event"] == "outbox.corrupt"
    assert event.body["moved_to"] == str(moved)
    assert box.append("metrics", "metrics", {"n": 1}, commit=True) == 2
    box.close()
    again = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    assert again.corrupt_moved is None  # the new file is sound
    again.close()


def test_a_damaged_page_is_caught_by_the_integrity_check(path: Path) -> None:
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    for _ in range(200):
        box.append("metrics", "metrics", {"pad": "x" * 500})
    box.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page + 8: 3 * page] = os.urandom(page - 8)  # scribble over a page body
    path.write_bytes(bytes(data))
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20)
    assert box.corrupt_moved is not None
    assert box.corrupt_moved.stat().st_size == len(data)
    box.close()


_CHILD = """
import sys, uuid
from pathlib import Path
from edge_agent.fleet.device.link.outbox import Outbox
box = Outbox(Path(sys.argv[1]), device="store-042", boot_id=sys.argv[2], max_bytes=1 << 30)
n = 0
while True:
    for _ in range(10):
        box.append("metrics", "metrics", {"n": n, "pad": "x" * 200})
        n += 1
    box.flush()
    print(n, flush=True)
"""


def test_kill_9_mid_append_loop_leaves_a_gap_free_prefix(path: Path) -> None:
    b = boot()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), b],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    reported = 0
    deadline = time.monotonic() + 30
    while reported < 3000 and time.monotonic() < deadline:
        reported = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    seqs = [s for (s,) in conn.execute("SELECT seq FROM outbox WHERE boot_id = ? ORDER BY seq",
                                       [b])]
    (last,) = conn.execute("SELECT last_seq FROM boots WHERE boot_id = ?", [b]).fetchone()
    conn.close()
    assert seqs == list(range(1, len(seqs) + 1))  # no gap, from 1
    assert len(seqs) >= reported  # every flush it reported is there
    assert last == len(seqs)
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 30)
    assert box.stats().depth == len(seqs)
    box.close()


def test_outbox_throughput_figure(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Benchmark-style, not asserted: rows/s appended and flushed in batches of 100, then
    sent (marked) and acked in batches of 100."""
    b = boot()
    box = Outbox(path, device=DEVICE, boot_id=b, max_bytes=1 << 30)
    n, body = 20_000, {"pad": "x" * 240}
    start = time.perf_counter()
    for i in range(n):
        box.append("metrics", "metrics", body)
        if i % 100 == 99:
            box.flush()
    appended = time.perf_counter() - start
    size = box.pending(1)[0].size
    start = time.perf_counter()
    acked = 0
    while rows := box.pending(100):
        box.mark_sent(r.id for r in rows)
        acked += box.ack({b: [[rows[0].seq, rows[-1].seq]]})
    drained = time.perf_counter() - start
    box.close()
    assert acked == n
    with capsys.disabled():
        print(f"\noutbox: {n / appended:,.0f} rows/s appended+flushed (batches of 100), "
              f"{n / drained:,.0f} rows/s pending+mark_sent+ack, "
              f"{size}-byte rows, synchronous=FULL")


def test_stats_report_depth_bytes_and_age(path: Path) -> None:
    now = [1000.0]
    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 20, clock=lambda: now[0])
    assert box.stats()[:4] == (0, 0, 0.0, 0)
    box.append("metrics", "metrics", {"n": 1})
    now[0] = 1010.0
    assert box.stats().oldest_age_s == 10.0  # buffered rows count too
    box.flush()
    box.append("events", "audit", {"n": 2}, commit=True)
    now[0] = 1030.0
    stats = box.stats()
    assert (stats.depth, stats.oldest_age_s, stats.buffered) == (2, 30.0, 0)
    assert stats.bytes == sum(r.size for r in box.pending(10))
    box.close()


def test_producers_on_many_threads_get_gap_free_seqs(path: Path) -> None:
    import threading

    box = Outbox(path, device=DEVICE, boot_id=boot(), max_bytes=1 << 30)
    got: list[int] = []
    lock = threading.Lock()

    def produce() -> None:
        for i in range(500):
            seq = box.append("metrics", "metrics", {"i": i})
            with lock:
                got.append(seq)

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        box.flush()  # the owner thread commits meanwhile
    for t in threads:
        t.join()
    box.flush()
    assert sorted(got) == list(range(1, 2001))
    assert [s for _, s, _ in committed(path)] == list(range(1, 2001))  # committed in order
    box.close()
