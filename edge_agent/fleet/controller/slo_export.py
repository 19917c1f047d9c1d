"""The fleet's service levels for the tools the central team already has: Prometheus text
at `GET /fleet-metrics` (its own scrape job, apart from the controller's own `/metrics`),
read at scrape from `slo_totals` (one row per box and model, see `slo`), and the SLO
targets and release starts the shipped alerting rules and Grafana dashboard
(`observability/`) join against.

Series, per box and model that ever served (labels `device`, `fleet`, `model`):

    edge_fleet_slo_requests_total{outcome="ok"|"client_error"|"server_error"}   counter
    edge_fleet_slo_tokens_out_total                                            counter
    edge_fleet_slo_upstream_requests_total                                     counter
    edge_fleet_slo_feedback_total{rating="good"|"bad"}                         counter
    edge_fleet_slo_ttft_seconds{quantile="0.5"|"0.95"}     the latest interval's, gauge
    edge_fleet_slo_tpot_seconds{quantile="0.5"|"0.95"}     the latest interval's, gauge
    edge_fleet_slo_interval_end_timestamp_seconds          when that interval ended

12 series per box and model: 240,000 for 10,000 boxes serving two models each. The
label values are the boxes' ids, fleet names and installed model names (the box counts
any other name a client sent as `(other)`), so the set is bounded by what the fleet runs.
A latency gauge whose interval ended more than STALE_S ago is left out (the box is
offline or idle): an alert must not fire on an old figure. Beside them, once each:

    edge_fleet_slo_target_seconds{slo="ttft_p95"|"tpot_p95"}, edge_fleet_slo_target_ratio
    {slo="error_rate"} (`[slo]`), and edge_fleet_release_started_timestamp_seconds{rollout,
    name, version, kind} for the newest 200 rollouts (the dashboard's annotations).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge_agent.config.controller import SLOSettings
from edge_agent.fleet.controller.slo import SLOQueries

log = logging.getLogger(__name__)

# A latency figure older than this (box's time) is not exported.
STALE_S = 900.0
LABELS = ["device", "fleet", "model"]
OUTCOMES = (("ok", "ok"), ("client_error", "client_errors"), ("server_error", "server_errors"))


class SLOExport:
    """Its own registry, rendered for `GET /fleet-metrics`."""

    def __init__(self, slo: SLOQueries, settings: SLOSettings, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SLOCollector(slo, settings, clock))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SLOCollector(Collector):
    def __init__(self, slo: SLOQueries, settings: SLOSettings,
                 clock: Callable[[], float]) -> None:
        self._slo, self._settings, self._clock = slo, settings, clock

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("edge_fleet_slo_store_up", "1 if the store answered this scrape")
        try:
            totals = self._slo.totals()
            releases = self._slo.releases()
        except Exception:  # a scrape must answer even while the database is away
            log.exception("fleet: the store did not answer the SLO scrape")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        s = self._settings
        target = GaugeMetricFamily("edge_fleet_slo_target_seconds",
                                   "The fleet's latency SLOs ([slo])", labels=["slo"])
        target.add_metric(["ttft_p95"], s.ttft_p95_ms / 1000)
        target.add_metric(["tpot_p95"], s.tpot_p95_ms / 1000)
        ratio = GaugeMetricFamily("edge_fleet_slo_target_ratio",
                                  "The fleet's error-rate SLO ([slo])", labels=["slo"])
        ratio.add_metric(["error_rate"], s.error_rate)
        yield from (target, ratio)
        requests = CounterMetricFamily("edge_fleet_slo_requests",
                                       "Requests a box answered, by outcome",
                                       labels=[*LABELS, "outcome"])
        tokens = CounterMetricFamily("edge_fleet_slo_tokens_out", "Tokens generated",
                                     labels=LABELS)
        upstream = CounterMetricFamily("edge_fleet_slo_upstream_requests",
                                       "Requests a box sent to an upstream", labels=LABELS)
        feedback = CounterMetricFamily("edge_fleet_slo_feedback",
                                       "Verdicts apps sent back on answers",
                                       labels=[*LABELS, "rating"])
        ttft = GaugeMetricFamily("edge_fleet_slo_ttft_seconds", "Time to first token, the "
                                 "box's latest interval", labels=[*LABELS, "quantile"])
        tpot = GaugeMetricFamily("edge_fleet_slo_tpot_seconds", "Time per output token, the "
                                 "box's latest interval", labels=[*LABELS, "quantile"])
        ended = GaugeMetricFamily("edge_fleet_slo_interval_end_timestamp_seconds",
                                  "When the box's latest interval ended (its clock)",
                                  labels=LABELS)
        fresh_after = self._clock() - STALE_S
        for t in totals:
            labels = [str(t["device"]), str(t["fleet"]), str(t["model"])]
            for outcome, column in OUTCOMES:
                requests.add_metric([*labels, outcome], float(t[column]))
            tokens.add_metric(labels, float(t["tokens_out"]))
            upstream.add_metric(labels, float(t["upstream"]))
            feedback.add_metric([*labels, "good"], float(t["feedback_good"]))
            feedback.add_metric([*labels, "bad"], float(t["feedback_bad"]))
            ended.add_metric(labels, float(t["last_end"]))
            if float(t["last_end"]) < fresh_after:
                continue
            for family, key in ((ttft, "ttft"), (tpot, "tpot")):
                for q, column in (("0.5", "p50"), ("0.95", "p95")):
                    value = t[f"{key}_{column}"]
                    if value is not None:
                        family.add_metric([*labels, q], float(value) / 1000)
        yield from (requests, tokens, upstream, feedback, ttft, tpot, ended)
        started = GaugeMetricFamily("edge_fleet_release_started_timestamp_seconds",
                                    "When a rollout of a release started (the newest 200)",
                                    labels=["rollout", "name", "version", "kind"])
        for r in releases:
            started.add_metric([r["rollout"], r["name"], r["version"], r["kind"]], r["at"])
        yield started
