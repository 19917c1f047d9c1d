"""What the box syncs on its own: metrics (counter deltas, percentiles from the ledger,
hardware, outbox), ledger summaries (exactly once across restarts and crashes, redaction
counts without values), events (model changes, readiness, errors), the privacy screen,
and ticks that fail without stopping the next. Real Outbox, real LedgerWriter, real
Prometheus registry, real ModelOps on tiny GGUFs; a live server for the end-to-end check
that no prompt text or PII value reaches any payload."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.request import DoneEvent, Timings, Usage
from edge_agent.engine.scheduling.prompt_cache import PromptCache
from edge_agent.errors import RateLimited
from edge_agent.fleet.device.link.outbox import Outbox
from edge_agent.fleet.device.reporting import ledger_summary
from edge_agent.fleet.device.reporting.ledger_summary import LedgerSummaries
from edge_agent.fleet.device.reporting.privacy import WITHHELD, screen
from edge_agent.fleet.device.reporting.sync import Sync
from edge_agent.fleet.protocol.envelope import Envelope, decode
from edge_agent.ledger.writer import LedgerWriter
from edge_agent.telemetry.hardware import HardwareSampler, Reading
from edge_agent.telemetry.metrics import Metrics
from tests.ggufgen import write_tiny_gguf

DEVICE = "store-042"
MARKER = "zq-sync-marker-7f3a9c41"
EMAIL = "marta.kowalska@example.com"
PHONE = "(415) 555-2671"
IBAN = "DE89 3704 0044 0532 0130 00"


@pytest.fixture
def outbox(tmp_path: Path) -> Outbox:
    box = Outbox(tmp_path / "outbox.db", device=DEVICE, boot_id=uuid.uuid4().hex,
                 max_bytes=1 << 24)
    yield box
    box.close()


@pytest.fixture
def writer(tmp_path: Path) -> LedgerWriter:
    w = LedgerWriter(tmp_path / "ledger.db", window_s=0.01)
    yield w
    w.close()


def sent(box: Outbox, kind: str | None = None) -> list[Envelope]:
    box.flush()
    envs = [decode(r.payload) for r in box.pending(100_000)]
    return [e for e in envs if kind is None or e.kind == kind]


def make_sync(tmp_path: Path, box: Outbox, **kwargs: Any) -> Sync:
    return Sync(emit=box.append, ledger_path=tmp_path / "ledger.db",
                state_path=tmp_path / "fleet-sync.json", outbox_stats=box.stats, **kwargs)


def request_row(writer: LedgerWriter, *, tenant: str = "local", model: str = "m:1",
                status: int = 200, ttft: float = 10.0, tpot: float = 2.0,
                prompt: int = 10, cached: int = 0, completion: int = 5,
                served: bool = True, error_type: str | None = None,
                end_user: str | None = None) -> str:
    """A row as the server writes it (RequestContext + Observer), its id returned."""
    rid = uuid.uuid4().hex
    row: dict[str, Any] = {"id": rid, "trace_id": f"t-{rid[:8]}", "ts": 1.0e9, "tenant": tenant,
                           "dialect": "openai", "endpoint": "/v1/chat/completions",
                           "model": model, "status": status, "total_ms": ttft + 5}
    if status == 200:
        row.update(model_digest="ab" * 32 if served else None, ttft_ms=ttft, tpot_ms=tpot,
                   prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                   done_reason="stop")
    else:
        row["error_type"] = error_type or "rate_limit_error"
    if end_user:
        row["end_user"] = end_user
    writer.record(row)
    return rid


def done(prompt: int, cached: int, completion: int, eval_ms: float) -> DoneEvent:
    return DoneEvent("stop", Usage(prompt, cached, completion),
                     Timings(eval_ns=int(eval_ms * 1e6), total_ns=int(eval_ms * 2e6)))


# -- metrics -------------------------------------------------------------------------------

def fake_loaded(name: str, waiting: int, running: int) -> SimpleNamespace:
    stats = SimpleNamespace(running=running, kv_used=1, kv_total=2, last_step_tokens=0,
                            drafted=0, draft_accepted=0, put_back=0)
    return SimpleNamespace(info=SimpleNamespace(name=name), memory=1, parallel=4,
                           worker=SimpleNamespace(stats=stats, queued=waiting, threads_now=2))


def test_metrics_carry_per_model_deltas_and_percentiles_of_the_interval(
        tmp_path: Path, outbox: Outbox, writer: LedgerWriter) -> None:
    metrics = Metrics(lambda: [fake_loaded("m:1", 3, 1)])  # type: ignore[arg-type, list-item]
    sync = make_sync(tmp_path, outbox, metrics=metrics.registry)
    # Interval 1: ten requests of m:1 (TTFT 10..100 ms, TPOT 1..10 ms), one of m:2, a 429.
    for i in range(1, 11):
        metrics.observe_done("m:1", "openai", done(100, 40, 5, 4 * i), i / 100)
        request_row(writer, ttft=10.0 * i, tpot=float(i))
    metrics.observe_done("m:2", "ollama", done(7, 0, 1, 1), 0.5)
    request_row(writer, model="m:2", ttft=500.0, completion=1)
    metrics.observe_error("m:1", "openai", RateLimited("slow down"))
    request_row(writer, status=429)
    for status in ("ok", "ok", "timeout"):  # three of them went to the pool
        metrics.observe_upstream("pool", "saturated", status)
    assert writer.flush()
    assert sync.tick_metrics(now=1000.0)
    [m] = sent(outbox, "metrics")
    assert m.cls == "metrics"
    body = m.body
    assert body["interval"]["end"] == 1000.0
    one = body["models"]["m:1"]
    assert one["requests"] == {"200": 10, "429": 1}
    assert one["tokens"] == {"in": 1000, "out": 50, "cached": 400, "cached_share": 0.4}
    # Nearest rank: p50 is the 5th of 10, p95 the 10th.
    assert one["ttft_ms"] == {"p50": 50.0, "p95": 100.0, "n": 10}
    assert one["tpot_ms"] == {"p50": 5.0, "p95": 10.0, "n": 10}
    assert one["queue"] == {"waiting": 3, "running": 1}
    two = body["models"]["m:2"]
    assert two["requests"] == {"200": 1} and two["tokens"]["out"] == 1
    assert two["ttft_ms"] == {"p50": 500.0, "p95": 500.0, "n": 1}
    assert two["tpot_ms"] is None  # one output token: no TPOT (as the histogram)
    assert body["rejections"] == {"quota": 1}
    assert body["upstream"] == {"requests": 3, "share": round(3 / 12, 4), "by": {
        "pool": {"saturated": {"ok": 2, "timeout": 1}}}}
    assert body["outbox"]["depth"] == 0 and body["outbox"]["buffered"] >= 0
    [errors] = sent(outbox, "events")
    assert errors.cls == "audit"
    assert errors.body == {"event": "errors", "interval": body["interval"], "errors": [
        {"model": "m:1", "status": 429, "type": "rate_limit_error", "count": 1}]}
    # Interval 2: only what happened since.
    for ttft in (20.0, 30.0):
        metrics.observe_done("m:1", "openai", done(10, 0, 3, 2), ttft / 1000)
        request_row(writer, ttft=ttft, tpot=1.5)
    assert writer.flush()
    assert sync.tick_metrics(now=1060.0)
    second = sent(outbox, "metrics")[1].body
    assert second["interval"] == {"start": 1000.0, "end": 1060.0}
    one = second["models"]["m:1"]
    assert one["requests"] == {"200": 2}
    assert one["tokens"] == {"in": 20, "out": 6, "cached": 0, "cached_share": 0.0}
    assert one["ttft_ms"] == {"p50": 20.0, "p95": 30.0, "n": 2}
    assert "m:2" not in second["models"] and second["rejections"] == {}
    assert second["upstream"] == {"requests": 0, "share": 0.0, "by": {}}
    assert len(sent(outbox, "events")) == 1  # no new errors: no new event


class FakeReader:
    name = "fake"

    def read(self) -> list[Reading]:
        gpu = (("gpu", "0"), ("name", "NVIDIA H200"))
        return [Reading("cpu_utilization_ratio", 0.25), Reading("memory_used_bytes", 3e9),
                Reading("memory_total_bytes", 8e9), Reading("state_disk_free_bytes", 5e10),
                Reading("load_average", 1.5, (("period", "1m"),)),
                Reading("temperature_celsius", math.nan, (("sensor", "acpi/0"),)),
                Reading("gpu_utilization_ratio", 0.5, gpu),
                Reading("gpu_memory_used_bytes", 1e9, gpu),
                Reading("gpu_temperature_celsius", 61.0, gpu),
                Reading("gpu_power_watts", 120.0, gpu)]


def test_metrics_carry_hardware_readings_and_work_without_a_ledger(tmp_path: Path,
                                                                   outbox: Outbox) -> None:
    sampler = HardwareSampler(readers=[FakeReader()])
    sampler.sample()
    sync = make_sync(tmp_path, outbox, hardware=lambda: sampler.snapshot)
    assert sync.tick_metrics(now=5.0)  # no ledger.db yet, no registry: still a message
    hw = sent(outbox, "metrics")[0].body["hardware"]
    assert hw["cpu_utilization_ratio"] == 0.25 and hw["memory_total_bytes"] == 8e9
    assert hw["state_disk_free_bytes"] == 5e10 and hw["load_average"] == {"1m": 1.5}
    assert hw["temperature_celsius"] == {"acpi/0": None}  # NaN is not JSON: null
    assert hw["gpus"] == [{"gpu": "0", "name": "NVIDIA H200", "utilization_ratio": 0.5,
                           "memory_used_bytes": 1e9, "temperature_celsius": 61.0,
                           "power_watts": 120.0}]


# -- ledger summaries ----------------------------------------------------------------------

def test_ledger_summary_counts_rows_and_redactions_without_values(
        tmp_path: Path, outbox: Outbox, writer: LedgerWriter) -> None:
    ids = [request_row(writer, tenant="shop", prompt=10, cached=4, completion=3,
                       end_user="enduserdigest0123456789") for _ in range(3)]
    request_row(writer, tenant="office", model="m:2")
    request_row(writer, tenant="shop", status=429)
    request_row(writer, tenant="shop", model="please tell me about my secret", status=404,
                error_type="not_found_error")  # a client's string: not a name to send
    for entity, start in (("EMAIL", 3), ("PHONE", 20), ("EMAIL", 40)):
        writer.record({"request_id": ids[0], "direction": "prompt", "message_index": 0,
                       "entity_type": entity, "detector": "regex", "detector_version": "1",
                       "operator": "tag", "start": start, "end": start + 7,
                       "policy_version": "1"}, "redactions")
    writer.record({"request_id": ids[1], "direction": "response", "message_index": 0,
                   "entity_type": "IBAN", "detector": "regex", "detector_version": "1",
                   "operator": "tag", "start": 0, "end": 6, "policy_version": "1"},
                  "redactions")
    writer.record({"request_id": ids[0], "direction": "prompt", "message_index": 0,
                   "role": "user", "text": f"{MARKER} <EMAIL>", "ts": 1.0}, "contents")
    assert writer.flush()
    ops = ModelOps(ModelStore(tmp_path / "models"))
    ops.import_file(write_tiny_gguf(tmp_path / "m.gguf"), "m:1", by="test")
    # m:1 is installed, so its failed rows (no digest) keep the name; m:2 was served.
    sync = make_sync(tmp_path, outbox, models=ops)
    assert sync.tick_ledger(now=100.0)
    [msg] = sent(outbox, "ledger")
    assert msg.cls == "audit"
    body = msg.body
    assert body["requests"] == 6 and body["rows"] == {"after": 0, "through": 6}
    assert body["interval"] == {"start": 1.0e9, "end": 100.0}  # first: from the first row
    assert body["by"] == [
        {"tenant": "office", "model": "m:2", "status": 200, "error_type": "", "requests": 1,
         "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 5},
        {"tenant": "shop", "model": "(other)", "status": 404, "error_type": "not_found_error",
         "requests": 1, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0},
        {"tenant": "shop", "model": "m:1", "status": 200, "error_type": "", "requests": 3,
         "prompt_tokens": 30, "cached_tokens": 12, "completion_tokens": 9},
        {"tenant": "shop", "model": "m:1", "status": 429, "error_type": "rate_limit_error",
         "requests": 1, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}]
    assert body["redactions"] == [
        {"tenant": "shop", "entity_type": "EMAIL", "direction": "prompt", "count": 2},
        {"tenant": "shop", "entity_type": "IBAN", "direction": "response", "count": 1},
        {"tenant": "shop", "entity_type": "PHONE", "direction": "prompt", "count": 1}]
    assert body["rejected_rows"] == []
    raw = outbox.pending(100)[0].payload
    for never in (MARKER, "secret", "enduserdigest", ids[0]):
        assert never.encode() not in raw
    assert sync.tick_ledger(now=160.0) and len(sent(outbox, "ledger")) == 1  # nothing new


def test_a_restart_neither_skips_nor_double_counts(tmp_path: Path, outbox: Outbox,
                                                   writer: LedgerWriter) -> None:
    def summaries() -> list[dict[str, Any]]:
        return [e.body for e in sent(outbox, "ledger")]

    for _ in range(4):
        request_row(writer)
    assert writer.flush()
    assert make_sync(tmp_path, outbox).tick_ledger(now=10.0)
    for _ in range(3):
        request_row(writer)
    assert writer.flush()
    # Restart: a new Sync on the same files continues after the persisted watermark.
    assert make_sync(tmp_path, outbox).tick_ledger(now=20.0)
    first, second = summaries()
    assert (first["rows"], first["requests"]) == ({"after": 0, "through": 4}, 4)
    assert (second["rows"], second["requests"]) == ({"after": 4, "through": 7}, 3)
    assert second["interval"] == {"start": 10.0, "end": 20.0}

    # A crash before the summary reached the outbox: the next start sends that range.
    for _ in range(2):
        request_row(writer)
    assert writer.flush()

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError("disk gone")

    crashed = Sync(emit=broken, ledger_path=tmp_path / "ledger.db",
                   state_path=tmp_path / "fleet-sync.json")
    assert not crashed.tick_ledger(now=30.0) and crashed.failures["ledger"] == 1
    request_row(writer)  # committed after the intent: belongs to the next range
    assert writer.flush()
    assert make_sync(tmp_path, outbox).tick_ledger(now=40.0)
    third = summaries()[2]
    assert (third["rows"], third["requests"]) == ({"after": 7, "through": 9}, 2)
    assert third["interval"] == {"start": 20.0, "end": 30.0}  # the range as first planned

    # A crash after the outbox commit, before the watermark moved: the same range again,
    # identical, so the controller can drop it; then on from there.
    sync = make_sync(tmp_path, outbox)
    original = LedgerSummaries.commit

    def die(self: LedgerSummaries, rng: Any) -> None:
        raise KeyboardInterrupt  # the process dies here

    LedgerSummaries.commit = die  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            sync.tick_ledger(now=50.0)
    finally:
        LedgerSummaries.commit = original  # type: ignore[method-assign]
    assert make_sync(tmp_path, outbox).tick_ledger(now=60.0)
    fourth, fifth = summaries()[3:]
    assert fourth == fifth and fourth["rows"] == {"after": 9, "through": 10}
    request_row(writer)
    assert writer.flush()
    assert make_sync(tmp_path, outbox).tick_ledger(now=70.0)
    sixth = summaries()[5]
    assert sixth["rows"] == {"after": 10, "through": 11}
    distinct = {(b["rows"]["after"], b["rows"]["through"]): b["requests"] for b in summaries()}
    assert sum(distinct.values()) == 11  # every row once, in ranges that tile 0..11
    bounds = sorted(distinct)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


def test_a_ledger_whose_rowids_went_back_is_summarised_from_its_start(
        tmp_path: Path, outbox: Outbox, writer: LedgerWriter) -> None:
    for _ in range(5):
        request_row(writer)
    assert writer.flush()
    sync = make_sync(tmp_path, outbox)
    assert sync.tick_ledger(now=1.0)
    db = sqlite3.connect(tmp_path / "ledger.db")
    db.execute("DELETE FROM requests")  # `ledger.purge` of everything
    db.commit()
    db.close()
    for _ in range(2):
        request_row(writer, tenant="after-purge")
    assert writer.flush()
    assert sync.tick_ledger(now=2.0)
    last = sent(outbox, "ledger")[-1].body
    assert last["rows"] == {"after": 0, "through": 2} and last["requests"] == 2
    assert {r["tenant"] for r in last["by"]} == {"after-purge"}


def test_the_ledger_is_read_only_and_never_where_text_lives(
        tmp_path: Path, outbox: Outbox, writer: LedgerWriter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rid = request_row(writer, end_user="digest")
    writer.record({"request_id": rid, "direction": "prompt", "message_index": 0,
                   "entity_type": "EMAIL", "start": 0, "end": 5}, "redactions")
    writer.record({"request_id": rid, "direction": "prompt", "role": "user",
                   "text": MARKER, "ts": 1.0}, "contents")
    assert writer.flush()
    read: set[tuple[str, str]] = set()
    connect = sqlite3.connect

    def watched(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)

        def authorizer(action: int, table: str | None, column: str | None, *_: Any) -> int:
            if action == sqlite3.SQLITE_READ:
                read.add((table or "", column or ""))
            elif action not in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_TRANSACTION,
                                sqlite3.SQLITE_FUNCTION):
                return sqlite3.SQLITE_DENY  # anything but reading: refused
            return sqlite3.SQLITE_OK

        conn.set_authorizer(authorizer)
        return conn

    monkeypatch.setattr(ledger_summary.sqlite3, "connect", watched)
    sync = make_sync(tmp_path, outbox)
    assert sync.tick_ledger(now=1.0) and sync.tick_metrics(now=2.0)
    monkeypatch.undo()
    tables = {t for t, _ in read}
    assert tables <= {"requests", "redactions", "rejected_rows"}
    assert {"contents"}.isdisjoint(tables)
    for forbidden in (("requests", "end_user"), ("requests", "trace_id"),
                      ("redactions", "start"), ("redactions", "end")):
        assert forbidden not in read
    assert ("redactions", "entity_type") in read


# -- events --------------------------------------------------------------------------------

class FakeLoader:
    def __init__(self) -> None:
        self.models: list[SimpleNamespace] = []

    def loaded(self) -> list[SimpleNamespace]:
        return self.models


def test_events_for_model_changes_and_readiness(tmp_path: Path, outbox: Outbox) -> None:
    a, b, c = (write_tiny_gguf(tmp_path / f"v{i}.gguf", context_length=256 + i)
               for i in range(3))
    loader = FakeLoader()
    ops = ModelOps(ModelStore(tmp_path / "state"), loader)  # type: ignore[arg-type]
    first = ops.import_file(a, "m:1", by="test")
    ready = [False]
    sync = make_sync(tmp_path, outbox, models=ops, ready=lambda: ready[0])

    def events() -> list[dict[str, Any]]:
        return [e.body for e in sent(outbox, "events") if e.body["event"] != "models.state"]

    def states() -> list[set[tuple[str, str, bool, bool]]]:
        """Each models.state sent: the whole list, as the birth carries it."""
        return [{(m["name"], m["digest"], m["active"], m["loaded"]) for m in e.body["models"]}
                for e in sent(outbox, "events") if e.body["event"] == "models.state"]

    assert sync.tick_events()
    # The first poll: the birth told what is installed; readiness is reported, and the
    # whole model state once (the birth's may be stale by then).
    assert events() == [{"event": "readiness", "ready": False, "previous": None}]
    assert states() == [{("m:1", first.digest, True, False)}]
    second = ops.import_file(b, "m:1", by="test")  # a new version, active at once
    other = ops.import_file(c, "other:1", by="test")
    loader.models = [SimpleNamespace(info=second, in_use=0)]
    ready[0] = True
    assert sync.tick_events()
    assert events()[1:] == [
        {"event": "model.installed", "name": "other:1", "digest": other.digest},
        {"event": "model.activated", "name": "m:1", "digest": second.digest,
         "previous": first.digest},
        {"event": "model.loaded", "name": "m:1", "digest": second.digest},
        {"event": "readiness", "ready": True, "previous": False}]
    assert states()[1:] == [{("m:1", first.digest, False, False),
                             ("m:1", second.digest, True, True),
                             ("other:1", other.digest, True, False)}]
    assert sync.tick_events() and len(events()) == 5  # nothing changed: nothing sent
    assert len(states()) == 2
    ops.activate("m:1", first.digest, by="test")  # a rollback through ModelOps
    ops.remove("other:1", by="test")
    loader.models = []
    assert sync.tick_events()
    assert events()[5:] == [
        {"event": "model.activated", "name": "m:1", "digest": first.digest,
         "previous": second.digest},
        {"event": "model.removed", "name": "other:1", "previous": other.digest},
        {"event": "model.unloaded", "name": "m:1", "digest": second.digest}]
    # A hook reports a change as it happens; the poll does not repeat it.
    ops.activate("m:1", second.digest, by="test")
    sync.model_event("model.activated", "m:1", second.digest, previous=first.digest)
    assert sync.tick_events()
    assert events()[8:] == [{"event": "model.activated", "name": "m:1",
                             "digest": second.digest, "previous": first.digest}]
    with pytest.raises(ValueError):
        sync.model_event("model.exploded", "m:1")
    assert all(e.cls == "audit" for e in sent(outbox, "events"))


# -- failures and the runner ---------------------------------------------------------------

def test_a_failing_tick_is_logged_once_and_the_next_ones_still_run(
        tmp_path: Path, outbox: Outbox, caplog: pytest.LogCaptureFixture) -> None:
    calls = [0]

    def flaky() -> bool:
        calls[0] += 1
        if calls[0] <= 3:
            raise RuntimeError("probe failed")
        return True

    metrics = Metrics(lambda: [])
    metrics_emits = [0]

    def emit(kind: str, cls: str, body: Any, *, commit: bool = False) -> int:
        if kind == "metrics":
            metrics_emits[0] += 1
            if metrics_emits[0] == 1:
                raise OSError("outbox full")
        return outbox.append(kind, cls, body, commit=commit)

    sync = Sync(emit=emit, ledger_path=tmp_path / "ledger.db",
                state_path=tmp_path / "fleet-sync.json", metrics=metrics.registry,
                ready=flaky, events_interval_s=0.02, metrics_interval_s=0.05,
                ledger_interval_s=0.05)
    metrics.observe_done("m:1", "openai", done(5, 0, 2, 1), 0.01)  # before the failure

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(sync.run(stop))
        deadline = time.monotonic() + 20
        while (calls[0] < 5 or metrics_emits[0] < 3) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 5)

    caplog.set_level(logging.DEBUG, logger="edge_agent.fleet.device.reporting.sync")
    asyncio.run(main())
    assert sync.failures["events"] == 3 and sync.failures["metrics"] == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2  # once for events, once for metrics
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert [e.body for e in sent(outbox, "events")][0] == {
        "event": "readiness", "ready": True, "previous": None}
    first = sent(outbox, "metrics")[0].body
    # The failed interval is covered by the next message: the request before it is there.
    assert first["models"]["m:1"]["requests"] == {"200": 1}
    assert sum(m.body["models"].get("m:1", {}).get("requests", {}).get("200", 0)
               for m in sent(outbox, "metrics")) == 1


def test_intervals_change_live_and_are_checked(tmp_path: Path, outbox: Outbox) -> None:
    sync = make_sync(tmp_path, outbox)
    sync.set_intervals(metrics_s=10, ledger_s=30)
    assert sync.intervals["metrics"] == 10 and sync.intervals["ledger"] == 30
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError):
            sync.set_intervals(metrics_s=bad)


# -- the privacy screen --------------------------------------------------------------------

def test_the_privacy_screen_lets_only_names_ids_and_numbers_through() -> None:
    long_name = "hf.co/" + "a" * 150 + ":q4_k_m"
    body = {"models": {long_name: {"n": 1}, "m:1": {"ttft": math.inf}},
            "tenant": "shop", "digest": "ab" * 32, "gpu": "NVIDIA H200",
            "note": "My email is " + EMAIL + " and please keep it " * 3,
            "line": "two\nlines", "blob": b"raw",
            "list": [1, 2.5, None, True, "x " * 40, "y" * 190],
            f"a key that is a whole sentence, {MARKER}, long enough": 3}
    out, withheld = screen(body)
    assert out["models"] == {long_name: {"n": 1}, "m:1": {"ttft": None}}
    assert (out["tenant"], out["digest"], out["gpu"]) == ("shop", "ab" * 32, "NVIDIA H200")
    assert out["note"] == out["line"] == out["blob"] == WITHHELD
    # A long string without spaces passes only when it is a model name (at most 200).
    assert out["list"] == [1, 2.5, None, True, WITHHELD, "y" * 190]
    assert not any(MARKER in k for k in out)
    assert sorted(withheld) == ["(key)", "blob", "line", "list[4]", "note"]


def test_withheld_strings_are_counted_and_logged_once(
        tmp_path: Path, outbox: Outbox, caplog: pytest.LogCaptureFixture) -> None:
    sampler = HardwareSampler(readers=[])
    sampler.snapshot = [Reading("temperature_celsius", 40.0,
                                (("sensor", f"{MARKER} " * 4),))]
    sync = make_sync(tmp_path, outbox, hardware=lambda: sampler.snapshot)
    assert sync.tick_metrics(now=1.0) and sync.tick_metrics(now=2.0)
    assert sync.withheld == 2
    assert len([r for r in caplog.records if "withheld" in r.getMessage()]) == 1
    assert all(MARKER.encode() not in r.payload for r in outbox.pending(100))
    assert not any(MARKER in r.getMessage() for r in caplog.records)


# -- end to end: a live server, PII in prompts, nothing of it in any payload ----------------

@pytest.mark.integration
def test_no_prompt_text_or_pii_value_reaches_any_payload(model_cache: Path,
                                                         tmp_path: Path) -> None:
    import httpx

    from edge_agent.api.ops import readiness_problems
    from edge_agent.config import load_settings
    from edge_agent.telemetry.hardware import default_readers
    from tests.conftest import DEFAULT_MODEL, clone_state, free_port, start_server

    state = clone_state(model_cache, tmp_path / "state")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[tenants.local]\nredact_prompt = true\n[retention]\ncontent_hours = 24\n')
    settings = load_settings(cfg, state_dir=state, **{"server.port": free_port(),
                                                      "runtime.context_length": 512})
    live = start_server(settings)
    box = Outbox(tmp_path / "outbox.db", device=DEVICE, boot_id=uuid.uuid4().hex,
                 max_bytes=1 << 24)
    try:
        parts = live.app.state.parts
        sampler = HardwareSampler(readers=default_readers(state))
        sampler.sample()
        sync = Sync(emit=box.append, ledger_path=state / "ledger.db",
                    state_path=state / "fleet-sync.json", metrics=parts.metrics.registry,
                    hardware=lambda: sampler.snapshot, outbox_stats=box.stats,
                    models=parts.ops, ready=lambda: not readiness_problems(parts))
        assert sync.tick_events()
        prompt = (f"{MARKER}: my email is {EMAIL}, my phone {PHONE} and my IBAN {IBAN}. "
                  "Please confirm.")
        with httpx.Client(base_url=live.base_url, timeout=60) as client:
            for i in range(3):
                r = client.post("/v1/chat/completions", headers={"X-Request-Id": f"{MARKER}-{i}"},
                                json={"model": DEFAULT_MODEL, "max_tokens": 6, "user": EMAIL,
                                      "messages": [{"role": "user", "content": prompt}]})
                assert r.status_code == 200
            r = client.post("/api/generate", json={"model": DEFAULT_MODEL, "prompt": prompt,
                                                   "stream": False,
                                                   "options": {"num_predict": 4}})
            assert r.status_code == 200
            # The marker as a model name: a client's string in the ledger's model column.
            assert client.post("/api/generate", json={"model": MARKER, "prompt": prompt}
                               ).status_code == 404
        assert parts.ledger.flush()
        assert sync.tick_metrics() and sync.tick_ledger() and sync.tick_events()
        envs = sent(box)
        kinds = {e.kind for e in envs}
        assert {"metrics", "ledger", "events"} <= kinds
        ledger = next(e.body for e in envs if e.kind == "ledger")
        entities = {r["entity_type"] for r in ledger["redactions"]}
        assert {"EMAIL", "PHONE", "IBAN"} <= entities
        assert {r["model"] for r in ledger["by"]} == {DEFAULT_MODEL, "(other)"}
        served = next(e.body for e in envs if e.kind == "metrics")["models"][DEFAULT_MODEL]
        assert served["requests"]["200"] == 4 and served["ttft_ms"]["n"] == 4
        raw = b"".join(p.read_bytes() for p in tmp_path.glob("outbox.db*"))
        raw += b"".join(r.payload for r in box.pending(100_000))
        values = (MARKER, EMAIL, PHONE, IBAN, IBAN.replace(" ", ""), "555-2671",
                  "marta.kowalska", "Please confirm")
        for value in values:
            assert value.encode() not in raw, value
        assert sync.withheld == 0  # nothing had to be screened: nothing was read
    finally:
        box.close()
        live.stop()


def test_metrics_carry_the_prompt_caches_hits_restored_tokens_and_tiers(
        tmp_path: Path, outbox: Outbox) -> None:
    cache = PromptCache(64 * 2**20)
    metrics = Metrics(lambda: [], prompt_cache=cache)
    sync = make_sync(tmp_path, outbox, metrics=metrics.registry)
    metrics.observe_done("m:1", "openai", done(1000, 600, 5, 4), 0.1)
    st = cache.stats
    st.lookups, st.hits, st.restored_tokens, st.restore_s = 5, {"ram": 2, "disk": 1}, 600, 0.25
    st.evictions, st.ram_bytes, st.ram_entries = 1, 3 * 2**20, 2
    assert sync.tick_metrics(now=1000.0)
    body = sent(outbox, "metrics")[0].body["prompt_cache"]
    assert body == {"lookups": 5, "hits": {"ram": 2, "disk": 1}, "restored_tokens": 600,
                    "restore_s": 0.25, "evictions": 1, "disk_writes": 0,
                    "restored_share": 0.6,
                    "ram": {"bytes": 3 * 2**20, "entries": 2, "limit_bytes": 64 * 2**20},
                    "disk": {"bytes": 0, "entries": 0, "limit_bytes": 0}}
    st.lookups += 1
    assert sync.tick_metrics(now=1060.0)
    second = sent(outbox, "metrics")[1].body["prompt_cache"]
    assert second["lookups"] == 1 and second["hits"] == {} and second["restored_share"] is None
    text = metrics.render().decode()
    assert 'edge_agent_prompt_cache_hits_total{tier="disk"} 1.0' in text
    assert 'edge_agent_prompt_cache_bytes{tier="ram"} 3.145728e+06' in text


def test_metrics_carry_each_models_feedback_of_the_interval(tmp_path: Path,
                                                            outbox: Outbox) -> None:
    from edge_agent.fleet.protocol import feedback

    metrics = Metrics(lambda: [])
    sync = make_sync(tmp_path, outbox, metrics=metrics.registry)
    metrics.observe_done("m:1", "openai", done(10, 0, 5, 4), 0.1)
    for model, rating in (("m:1", "good"), ("m:1", "good"), ("m:1", "bad"), ("m:2", "bad")):
        metrics.observe_feedback(model, rating)
    assert sync.tick_metrics(now=1000.0)
    first = sent(outbox, "metrics")[0].body
    assert first["models"]["m:1"]["feedback"] == {"good": 2, "bad": 1}
    # A verdict on a model that served nothing in the interval still brings it in.
    assert first["models"]["m:2"]["feedback"] == {"good": 0, "bad": 1}
    assert feedback.counts(first) == {"m:1": {"good": 2, "bad": 1}, "m:2": {"good": 0, "bad": 1}}
    metrics.observe_feedback("m:1", "good")
    metrics.observe_done("m:2", "openai", done(10, 0, 5, 4), 0.1)
    assert sync.tick_metrics(now=1060.0)
    second = sent(outbox, "metrics")[1].body
    assert second["models"]["m:1"]["feedback"] == {"good": 1, "bad": 0}  # deltas, not totals
    assert second["models"]["m:2"]["feedback"] == {"good": 0, "bad": 0}
    assert feedback.counts(second) == {"m:1": {"good": 1, "bad": 0}}


def test_metrics_carry_each_models_task_kinds_of_the_interval(tmp_path: Path,
                                                              outbox: Outbox) -> None:
    from edge_agent.errors import QueueFull

    metrics = Metrics(lambda: [fake_loaded("m:3", 0, 0)])  # type: ignore[arg-type, list-item]
    sync = make_sync(tmp_path, outbox, metrics=metrics.registry)
    for kinds in (["openai", "schema"], ["openai", "tools", "long_context"], ["ollama"]):
        metrics.observe_done("m:1", kinds[0], done(10, 0, 5, 4), 0.1)
        metrics.observe_kinds("m:1", kinds)
    metrics.observe_error("m:2", "openai", QueueFull("full"))  # refused at its model
    metrics.observe_error("", "openai", RateLimited("slow down"))  # before any model
    assert sync.tick_metrics(now=1000.0)
    models = sent(outbox, "metrics")[0].body["models"]
    assert models["m:1"]["kinds"] == {"ollama": 1, "openai": 2, "schema": 1, "tools": 1,
                                      "long_context": 1}
    assert models["m:2"]["kinds"] == dict.fromkeys(models["m:1"]["kinds"], 0)
    assert "kinds" not in models["(none)"] and "kinds" not in models["m:3"]  # no request
    metrics.observe_kinds("m:1", ["ollama", "tools"])
    metrics.observe_done("m:1", "ollama", done(10, 0, 5, 4), 0.1)
    assert sync.tick_metrics(now=1060.0)
    second = sent(outbox, "metrics")[1].body["models"]
    assert second["m:1"]["kinds"] == {"ollama": 1, "openai": 0, "schema": 0, "tools": 1,
                                      "long_context": 0}  # deltas, not totals
    assert "m:2" not in second


def test_metrics_carry_structured_outcomes_and_degradations_of_the_interval(
        tmp_path: Path, outbox: Outbox) -> None:
    """Each model's structured outputs closed / cut / refused and the box's degradations
    by tier, cause and action: deltas of their counters, all three structured keys once
    any moved and none otherwise, degradations sorted and an empty list without any."""
    import dataclasses

    metrics = Metrics(lambda: [])
    sync = make_sync(tmp_path, outbox, metrics=metrics.registry)
    closed = dataclasses.replace(done(10, 0, 5, 4), closed=True)
    metrics.observe_done("m:1", "openai", closed, 0.1)
    metrics.observe_done("m:1", "openai", done(10, 0, 5, 4), 0.1, cut=True)
    metrics.observe_done("m:1", "openai", done(10, 0, 5, 4), 0.1, cut=True)
    metrics.observe_structured_refused("m:2")  # refused before it ran: no other figure
    metrics.observe_done("m:3", "openai", done(10, 0, 5, 4), 0.1)  # plain: no structured
    for tier, reason, action in (("normal", "queue_full", "fallback"), ("high", "memory",
                                 "refused"), ("normal", "queue_full", "fallback")):
        metrics.observe_degradation(tier, reason, action)
    assert sync.tick_metrics(now=1000.0)
    first = sent(outbox, "metrics")[0].body
    assert first["models"]["m:1"]["structured"] == {"closed": 1, "cut": 2, "refused": 0}
    assert first["models"]["m:2"]["structured"] == {"closed": 0, "cut": 0, "refused": 1}
    assert "structured" not in first["models"]["m:3"]
    assert first["degradations"] == [
        {"tier": "high", "reason": "memory", "action": "refused", "count": 1},
        {"tier": "normal", "reason": "queue_full", "action": "fallback", "count": 2}]

    metrics.observe_done("m:1", "openai", done(10, 0, 5, 4), 0.1, cut=True)
    metrics.observe_done("m:2", "openai", done(10, 0, 5, 4), 0.1)
    metrics.observe_degradation("low", "deadline", "queued")
    assert sync.tick_metrics(now=1060.0)
    second = sent(outbox, "metrics")[1].body
    assert second["models"]["m:1"]["structured"] == {"closed": 0, "cut": 1, "refused": 0}
    assert "structured" not in second["models"]["m:2"]  # deltas: nothing moved for it
    assert second["degradations"] == [  # deltas: the earlier ones are not repeated
        {"tier": "low", "reason": "deadline", "action": "queued", "count": 1}]
    assert sync.tick_metrics(now=1120.0)
    assert sent(outbox, "metrics")[2].body["degradations"] == []


# -- end to end: structured outcomes and a degradation, from a live box to the message -------

STORY = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
ASK_STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight. "
                                         "Answer as JSON."}]
# A keyword no grammar here enforces: refused by name, 400 (docs/api/tools-and-schemas.md).
UNFOLLOWABLE = {"type": "object", "properties": {"a": {"type": "string"}},
                "dependentSchemas": {"a": {"required": ["b"]}}}


def _structured_counts(live: Any, model: str) -> dict[str, float]:
    """`/metrics` as a client scrapes it: the three structured counters of `model`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{live.base_url}/metrics").text
    out = dict.fromkeys(("closed", "cut", "refused"), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            kind = s.name.removeprefix("edge_agent_structured_").removesuffix("_total")
            if kind in out and s.name.endswith("_total") and s.labels.get("model") == model:
                out[kind] = s.value
    return out


@pytest.mark.integration
def test_structured_outcomes_and_a_degradation_reach_metrics_and_the_message(
        model_cache: Path, tmp_path: Path) -> None:
    """A live box with one sequence and one waiting place, asked through the official
    clients: a schema answer closed within its budget, one cut (its required property
    cannot fit in 2 tokens, so closing cannot end it), a schema refused in each dialect,
    and a request refused on a full queue (normal tier, no fallback). `/metrics` and the
    next metrics message say exactly that, per model; the message's degradations too."""
    import threading

    import httpx
    import jsonschema
    import ollama
    import openai

    from edge_agent.config import load_settings
    from tests.conftest import DEFAULT_MODEL, NO_EOS, clone_state, free_port, start_server
    from tests.support.fleetkit import wait_until

    state = clone_state(model_cache, tmp_path / "state")
    live = start_server(load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 1024, "runtime.parallel": 1,
        "runtime.max_queue": 1, "runtime.structured_close_tokens": 48}))
    box = Outbox(tmp_path / "outbox.db", device=DEVICE, boot_id=uuid.uuid4().hex,
                 max_bytes=1 << 24)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        parts = live.app.state.parts
        sync = Sync(emit=box.append, ledger_path=state / "ledger.db",
                    state_path=state / "fleet-sync.json", metrics=parts.metrics.registry,
                    outbox_stats=box.stats, models=parts.ops)
        assert sync.tick_metrics()  # the baseline: what the start did is not this test's
        before = _structured_counts(live, DEFAULT_MODEL)
        oa = openai.OpenAI(base_url=live.openai_url, api_key="unused", max_retries=0)

        closed = oa.chat.completions.with_raw_response.create(
            model=DEFAULT_MODEL, messages=ASK_STORY, max_tokens=14,  # type: ignore[arg-type]
            temperature=0, response_format={"type": "json_schema", "json_schema": {
                "name": "story", "schema": STORY}})
        assert closed.headers["x-edge-closed"] == "max_tokens"
        jsonschema.validate(json.loads(closed.parse().choices[0].message.content or ""),
                            STORY)

        ol = ollama.Client(host=live.base_url, headers={"X-Request-Id": "structured-cut"})
        cut = ol.chat(model=DEFAULT_MODEL, messages=ASK_STORY, format=STORY,
                      options={"num_predict": 2, "temperature": 0})
        assert cut.done_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(cut.message.content or "")
        assert live.ledger_row("structured-cut")["structured_failure"] == 1

        with pytest.raises(openai.BadRequestError) as refused:
            oa.chat.completions.create(
                model=DEFAULT_MODEL, messages=ASK_STORY, max_tokens=8,  # type: ignore[arg-type]
                response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "schema": UNFOLLOWABLE}})
        assert refused.value.body["param"] == (  # type: ignore[index]
            "response_format.json_schema.schema.dependentSchemas")
        with pytest.raises(ollama.ResponseError) as refused_ollama:
            ol.chat(model=DEFAULT_MODEL, messages=ASK_STORY, format=UNFOLLOWABLE)
        assert refused_ollama.value.status_code == 400
        assert "dependentSchemas" in refused_ollama.value.error

        gained = {k: v - before[k] for k, v in _structured_counts(live, DEFAULT_MODEL).items()}
        assert gained == {"closed": 1, "cut": 1, "refused": 2}

        # Saturated: one stream decodes, one waits, so the queue is full; a normal-tier
        # request with no fallback model set is refused, and counted as a degradation.
        worker = next(m.worker for m in parts.registry.loaded()
                      if m.info.name == DEFAULT_MODEL)

        def stream(i: int) -> None:
            body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": 900,
                    "temperature": 1.0, "logit_bias": NO_EOS,
                    "messages": [{"role": "user", "content": f"Write a long story, part {i}."}]}
            with httpx.stream("POST", f"{live.openai_url}/chat/completions", json=body,
                              timeout=300) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads[0].start()
        assert wait_until(lambda: worker.running == 1, 60)
        threads[1].start()
        assert wait_until(lambda: worker.queued == 1, 60)
        with pytest.raises(openai.APIStatusError) as saturated:
            oa.chat.completions.create(model=DEFAULT_MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}])
        assert saturated.value.status_code == 503
        assert saturated.value.code == "risk_not_degraded"
        assert worker.running == 1 and worker.queued == 1  # still so: it saw a full queue

        assert sync.tick_metrics()
        body = sent(box, "metrics")[-1].body
        assert body["models"][DEFAULT_MODEL]["structured"] == {"closed": 1, "cut": 1,
                                                               "refused": 2}
        # The refusals count with every refusal before a model runs, as a 400.
        assert body["models"]["(none)"]["requests"]["400"] == 2
        assert body["degradations"] == [
            {"tier": "normal", "reason": "queue_full", "action": "refused", "count": 1}]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        box.close()
        live.stop()
