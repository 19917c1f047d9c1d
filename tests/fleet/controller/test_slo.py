"""The service levels over time on both stores: each `metrics` message a box sends becomes
rows per model at ingest (once, however often it is delivered), read back as buckets over a
window with the releases in it as markers, exported as Prometheus text, and purged with the
metrics."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.config.controller import RetentionSettings, SLOSettings
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.retention import Retention
from edge_agent.fleet.controller.slo import interval_rows, step_for
from edge_agent.fleet.controller.slo_export import SLOExport
from edge_agent.fleet.controller.store import ControllerStore

BOOT = "c" * 32
T0 = 1_800_000_000.0  # a round minute
MODEL = "smollm2:135m"


def metrics_body(end: float, *, ttft_p95: float = 150.0, ok: int = 10, failed: int = 0,
                 model: str = MODEL, length: float = 60.0, good: int = 0,
                 bad: int = 0) -> dict[str, Any]:
    """Shaped as `fleet.device.reporting.sync` sends it."""
    requests = {"200": ok, **({"500": failed} if failed else {}), "429": 1}
    return {"interval": {"start": end - length, "end": end},
            "models": {model: {"requests": requests,
                               "tokens": {"in": 900, "out": 600, "cached": 0,
                                          "cached_share": 0.0},
                               "ttft_ms": {"p50": ttft_p95 / 2, "p95": ttft_p95, "n": ok},
                               "tpot_ms": {"p50": 20.0, "p95": 25.0, "n": ok},
                               "queue": {"waiting": 0, "running": 0},
                               "feedback": {"good": good, "bad": bad}},
                       "idle:1b": {"requests": {}, "tokens": {"in": 0, "out": 0},
                                   "ttft_ms": None, "tpot_ms": None,
                                   "queue": {"waiting": 0, "running": 0}}},
            "rejections": {}, "upstream": {"requests": 2, "share": 0.1, "by": {}},
            "hardware": {}}


def msg(device: str, seq: int, body: dict[str, Any], kind: str = "metrics") -> Inbound:
    return Inbound("f1", device, kind, BOOT, seq, "metrics" if kind == "metrics" else "audit",
                   float(body["interval"]["end"]), body, T0 + 10_000)


def test_a_metrics_body_gives_a_row_per_model_that_served() -> None:
    start, end, rows = interval_rows(metrics_body(T0 + 60, failed=2, good=3, bad=1))
    assert (start, end) == (T0, T0 + 60)
    assert [r.model for r in rows] == [MODEL]  # the idle model has nothing to show
    r = rows[0]
    assert (r.ok, r.client_errors, r.server_errors, r.requests) == (10, 1, 2, 13)
    assert (r.tokens_out, r.upstream, r.feedback_good, r.feedback_bad) == (600, 2, 3, 1)
    assert r.ttft == (75.0, 150.0, 10)
    # Junk is counted as nothing, never an exception that would fail the ingest.
    assert interval_rows({"interval": "x"}) == (None, None, [])
    _, _, junk = interval_rows({"interval": {"end": T0}, "models": {
        "m": {"requests": {"200": "many", "500": -3, "503": True}, "ttft_ms": {"p95": "x"}}}})
    assert junk == []
    assert step_for(3600) == 60 and step_for(86400) == 600 and step_for(30 * 86400) == 21600


def test_series_buckets_markers_and_errors(store: ControllerStore) -> None:
    boxes = ("d1", "d2")
    seq = 0
    for minute in range(10):
        for i, device in enumerate(boxes):
            seq += 1
            # d2 is twice as slow and serves twice as many requests.
            body = metrics_body(T0 + 60 * (minute + 1), ttft_p95=100.0 * (i + 1),
                                ok=10 * (i + 1), failed=1 if minute == 4 else 0)
            store.ingest([msg(device, seq, body)])
    store.ingest([msg("d1", 1, metrics_body(T0 + 60))])  # a duplicate adds nothing
    store.ingest([msg("d1", 999, {"interval": {"start": T0 + 240, "end": T0 + 300},
                                  "event": "errors", "errors": [
                                      {"model": MODEL, "status": 500, "type": "server_error",
                                       "count": 2}]}, kind="events")])
    series = store.slo.series(since=T0, until=T0 + 600, step=60)
    assert len(series.buckets) == 10
    first = series.buckets[0]
    assert (first.requests, first.ok, first.client_errors, first.reports) == (32, 30, 2, 2)
    # Weighted by requests: (100 * 10 + 200 * 20) / 30.
    assert first.ttft_p95 == round(5000 / 30, 2) and first.ttft_worst == 200.0
    assert series.buckets[4].server_errors == 2
    assert series.errors == [{"model": MODEL, "status": 500, "type": "server_error",
                              "count": 2}]
    one = store.slo.series(since=T0, until=T0 + 600, step=300, device="d1")
    assert [b.requests for b in one.buckets] == [56, 55]  # a server error in minute 4
    assert one.buckets[0].ttft_p95 == 100.0
    other = store.slo.series(since=T0, until=T0 + 600, model="other:1b")
    assert other.buckets[0].requests == 0
    totals = {t["device"]: t for t in store.slo.totals()}
    assert totals["d2"]["ok"] == 200 and totals["d2"]["ttft_p95"] == 200.0
    assert totals["d2"]["last_end"] == T0 + 600
    # A late interval (an outbox that was offline) adds to the sums, leaves the latest.
    store.ingest([msg("d2", 500, metrics_body(T0 + 120, ttft_p95=999.0))])
    late = {t["device"]: t for t in store.slo.totals()}["d2"]
    assert late["ok"] == 210 and late["ttft_p95"] == 200.0


def test_the_export_and_its_routes(store: ControllerStore) -> None:
    now = T0 + 600
    store.ingest([msg("d1", 1, metrics_body(now, ttft_p95=2500.0, good=4, bad=1)),
                  msg("d2", 1, metrics_body(now - 3600))])  # d2: an hour old
    text = SLOExport(store.slo, SLOSettings(ttft_p95_ms=2000), clock=lambda: now).render()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    d1 = (("device", "d1"), ("fleet", "f1"), ("model", MODEL))
    assert samples[("edge_fleet_slo_requests_total", (*d1, ("outcome", "ok")))] == 10
    assert samples[("edge_fleet_slo_feedback_total", (*d1, ("rating", "bad")))] == 1
    assert samples[("edge_fleet_slo_ttft_seconds", (*d1, ("quantile", "0.95")))] == 2.5
    assert samples[("edge_fleet_slo_target_seconds", (("slo", "ttft_p95"),))] == 2.0
    d2 = (("device", "d2"), ("fleet", "f1"), ("model", MODEL))
    assert ("edge_fleet_slo_ttft_seconds", (*d2, ("quantile", "0.95"))) not in samples
    assert samples[("edge_fleet_slo_requests_total", (*d2, ("outcome", "ok")))] == 10
    http = TestClient(create_app(store, ControllerMetrics(store)))
    scraped = http.get("/fleet-metrics")
    assert scraped.status_code == 200 and b"edge_fleet_slo_requests_total" in scraped.content
    assert http.get("/slo", params={"window": "1h"}).json()["step"] == 60
    refused = http.get("/slo", params={"window": "soon"})
    assert refused.status_code == 400 and "window" in refused.json()["error"]
    assert http.get("/slo/rollouts/ro-none").status_code == 404


def test_the_series_go_with_the_metrics(store: ControllerStore) -> None:
    store.ingest([msg("d1", s, metrics_body(T0 + 60 * s)) for s in range(1, 4)])
    cutoff_now = T0 + 120 + 30 * 86400  # 30 days after the second interval ended
    Retention(RetentionSettings(metrics_days=30), store.retention,
              clock=lambda: cutoff_now).run_once()
    left = store.slo.series(since=T0, until=T0 + 240, step=60).buckets
    assert [b.requests for b in left] == [0, 11, 11, 0]  # the first ended before the cutoff


def test_the_bench_fills_a_store_and_reads_it_back() -> None:
    """`bench fleet-slo` at a small size: the figures are there, the rollout's slower half
    is found, and every box and model has its 12 series (a presence check, never a time)."""
    from click.testing import CliRunner

    from edge_agent.cli import main

    ran = CliRunner().invoke(main, ["bench", "fleet-slo", "--devices", "20", "--minutes", "4",
                                    "--repeats", "1", "--json"])
    assert ran.exit_code == 0, ran.output
    figures = json.loads(ran.stdout)
    assert figures["series"] == 20 * 2 * 12 + 5  # + store up, 3 targets, 1 release
    assert figures["ttft_change"] == round(180 / 140, 3)
    assert figures["page_ms"] > 0 and figures["impact_ms"] > 0


def test_the_minutes_have_a_column_for_each_task_kind_a_box_counts() -> None:
    from edge_agent.fleet.controller.slo import KINDS
    from edge_agent.telemetry.task_kinds import TASK_KINDS

    assert KINDS == TASK_KINDS
    body = metrics_body(T0 + 60)
    body["models"][MODEL]["kinds"] = {"openai": 7, "tools": 2, "schema": "x"}
    _, _, rows = interval_rows(body)
    assert rows[0].kinds == (0, 7, 0, 2, 0)


def test_structured_outcomes_per_model_and_degradations_per_tier(store: ControllerStore
                                                                 ) -> None:
    """A model's structured answers closed, cut and refused; the boxes' degradations by
    risk tier, whatever the model (and never for one box: they are the fleet's)."""
    bodies = []
    for i in range(3):
        body = metrics_body(T0 + 60 * (i + 1))
        body["models"][MODEL]["structured"] = {"closed": 1, "cut": i, "refused": 2}
        body["degradations"] = [{"tier": "low", "reason": "queue_full", "action": "refused",
                                 "count": 2},
                                {"tier": "high", "reason": "memory", "action": "fallback",
                                 "count": 1},
                                {"tier": "", "reason": "x", "action": "y", "count": 5}]
        bodies.append(body)
    store.ingest([msg("d1", i + 1, b) for i, b in enumerate(bodies)])
    store.ingest([msg("d2", 1, {"interval": {"start": T0, "end": T0 + 60}, "models": {},
                                "degradations": [{"tier": "low", "reason": "deadline",
                                                  "action": "queued", "count": 4}]})])
    series = store.slo.series(since=T0, until=T0 + 180, step=60)
    assert [(b.structured_closed, b.structured_cut, b.structured_refused)
            for b in series.buckets] == [(1, 0, 2), (1, 1, 2), (1, 2, 2)]
    assert [b.degraded for b in series.buckets] == [
        {"low": 6, "high": 1}, {"low": 2, "high": 1}, {"low": 2, "high": 1}]
    one = store.slo.series(since=T0, until=T0 + 180, step=60, device="d1")
    assert one.buckets[2].structured_cut == 2 and one.buckets[0].degraded == {}
