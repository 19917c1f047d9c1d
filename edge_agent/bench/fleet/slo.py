"""`edge-agent bench fleet-slo`: what the service levels cost the controller at a fleet's
size. A controller store (SQLite in a temp dir, or a PostgreSQL URL) is filled through the
real ingest (`SQLStore.ingest`, so every message also becomes its `slo` rows) with one
metrics message a minute from each of N boxes serving M models over the window, shaped as
a box sends them, and one rollout over every box; then, each `repeats` times:

- the console's service-level page over the whole window (the HTML, charts drawn), through
  the controller's own app in-process;
- the Prometheus scrape of `/fleet-metrics`, and the number of series it holds;
- the rollout's before/after table (`GET /slo/rollouts/{id}`).

Medians and ranges are printed; nothing here is judged against a number (tests only check
that it runs). Must never: use the operator's own store (a fresh one, removed after).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.rollout_records import NewRollout
from edge_agent.fleet.controller.store import ControllerStore, open_store
from edge_agent.fleet.controller.waves import Policy, parse_waves

Echo = Callable[[str], None]
FLEET = "bench"
BATCH = 2000  # messages per ingest transaction, as the ingest's batch_max allows


def _body(end: float, models: int, slow: bool) -> dict[str, Any]:
    ttft = 180.0 if slow else 140.0
    return {"interval": {"start": end - 60.0, "end": end},
            "models": {f"model-{m}:1b": {
                "requests": {"200": 12, "500": 1 if slow else 0},
                "tokens": {"in": 2400, "out": 1200, "cached": 600, "cached_share": 0.25},
                "ttft_ms": {"p50": ttft / 2, "p95": ttft, "n": 12},
                "tpot_ms": {"p50": 20.0, "p95": 26.0, "n": 12},
                "queue": {"waiting": 0, "running": 1},
                "feedback": {"good": 1, "bad": 0}} for m in range(models)},
            "rejections": {}, "upstream": {"requests": 0, "share": 0.0, "by": {}},
            "hardware": {"cpu_utilization_ratio": 0.4}}


def fill(store: ControllerStore, devices: int, models: int, minutes: int, now: float
         ) -> tuple[str, float]:
    """The store as a fleet leaves it after `minutes`: every box's messages, and one
    rollout over every box, its start halfway (boxes after it 30% slower). Returns the
    rollout's id and the seconds the ingest took."""
    names = [f"box-{i:05d}" for i in range(devices)]
    boot = "b" * 32
    start = now - 60.0 * minutes
    half = start + 30.0 * minutes
    ingest_s = 0.0
    batch: list[Inbound] = []
    for minute in range(1, minutes + 1):
        end = start + 60.0 * minute
        for device in names:
            batch.append(Inbound(FLEET, device, "metrics", boot, minute, "metrics", end,
                                 _body(end, models, end > half), end))
            if len(batch) >= BATCH:
                began = time.perf_counter()
                store.ingest(batch)
                ingest_s += time.perf_counter() - began
                batch = []
    if batch:
        began = time.perf_counter()
        store.ingest(batch)
        ingest_s += time.perf_counter() - began
    rid = "ro-bench"
    store.rollouts.create_rollout(NewRollout(
        id=rid, name="model-0:1b", version="2", selector="all",
        policy=Policy(steps=parse_waves("100%"), abort_above=0.1, min_executed=1,
                      soak_s=0.0, device_timeout_s=3600.0, rollback_on_abort=False),
        devices={d: (FLEET, 1) for d in names}), half)
    # Every box updated at the halfway mark, as the engine records it when the broker takes
    # the command and the box reports ACTIVE (here without a broker: written directly).
    with store._tx() as db:  # type: ignore[attr-defined]
        db.run("UPDATE rollout_devices SET started_at = ?, finished_at = ?, state = 'ACTIVE' "
               "WHERE rollout_id = ?", [half, half + 1.0, rid])
    return rid, ingest_s


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, out = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - began)
    return times, out


def _line(label: str, times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return (f"  {label:<34} {statistics.median(ms):9.1f} ms  "
            f"({min(ms):.1f}-{max(ms):.1f}, {len(ms)} runs)")


def run_fleet_slo(*, devices: int, models: int, minutes: int, repeats: int,
                  db: str | None, echo: Echo) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from edge_agent.fleet.controller.api import create_app
    from edge_agent.fleet.controller.metrics import ControllerMetrics

    with tempfile.TemporaryDirectory(prefix="edge-bench-slo-") as scratch:
        store = open_store(db, Path(scratch))
        try:
            now = time.time()
            echo(f"filling the store: {devices} boxes x {models} model(s) x {minutes} min "
                 f"({devices * minutes:,} messages, {devices * minutes * models:,} intervals)")
            rid, ingest_s = fill(store, devices, models, minutes, now)
            rate = devices * minutes / ingest_s if ingest_s else 0.0
            echo(f"  ingest: {ingest_s:.1f} s, {rate:,.0f} messages/s")
            http = TestClient(create_app(store, ControllerMetrics(store)))
            window = f"{minutes}m"

            def page() -> int:
                got = http.get("/console/slo", params={"window": window})
                got.raise_for_status()
                return len(got.content)

            def scrape() -> int:
                got = http.get("/fleet-metrics")
                got.raise_for_status()
                return sum(1 for line in got.text.splitlines()
                           if line and not line.startswith("#"))

            def impact() -> dict[str, Any]:
                got = http.get(f"/slo/rollouts/{rid}", params={"window": "30m"})
                got.raise_for_status()
                return dict(got.json())

            page_s, page_bytes = _timed(page, repeats)
            scrape_s, series = _timed(scrape, repeats)
            impact_s, table = _timed(impact, repeats)
            change = table["waves"][0]["change"]["ttft_p95"] if table["waves"] else None
            echo(_line(f"console page ({window}, {page_bytes:,} bytes)", page_s))
            echo(_line(f"/fleet-metrics scrape ({series:,} series)", scrape_s))
            echo(_line(f"before/after table (TTFT x{change})", impact_s))
            return {"devices": devices, "models": models, "minutes": minutes,
                    "ingest_messages_per_s": round(rate),
                    "page_ms": round(statistics.median(page_s) * 1000, 1),
                    "scrape_ms": round(statistics.median(scrape_s) * 1000, 1),
                    "series": series,
                    "impact_ms": round(statistics.median(impact_s) * 1000, 1),
                    "ttft_change": change}
        finally:
            store.close()
