"""The controller's Prometheus registry: ingest counters kept by the ingest thread, and the
fleet's state (devices online, per-device up and last seen) read from the store at scrape.

Its own `CollectorRegistry`, never prometheus-client's global one (tests make many).
Metric names are `edge_fleet_*`; counters get prometheus-client's `_total` suffix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge_agent.fleet.controller.leadership import Leadership
from edge_agent.fleet.controller.store import ControllerStore

log = logging.getLogger(__name__)

BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
AGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0, 300.0, 3600.0, 86400.0)


class ControllerMetrics:
    def __init__(self, store: ControllerStore | None = None, *,
                 leadership: Leadership | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if leadership is not None:
            leader = Gauge("edge_fleet_leader", "1 while this controller leads (runs the "
                           "rollout engine and retention)", ["controller"], registry=r)
            leader.labels(leadership.controller_id).set_function(
                lambda: 1.0 if leadership.is_leader() else 0.0)
        self.ingested = Counter("edge_fleet_messages_ingested", "Messages stored (first copy)",
                                ["kind"], registry=r)
        self.duplicates = Counter("edge_fleet_messages_duplicate",
                                  "Messages already stored (acknowledged again)", registry=r)
        self.rejected = Counter("edge_fleet_messages_rejected",
                                "Messages dropped unread: bad topic or id, bad JSON, bad "
                                "envelope or status", ["reason"], registry=r)
        self.ignored = Counter("edge_fleet_messages_ignored",
                               "Messages on controller-to-device topics (ack, cmd)", registry=r)
        self.status = Counter("edge_fleet_status_messages", "Births and deaths", ["type"],
                              registry=r)
        self.acks = Counter("edge_fleet_acks_sent", "Ingest acknowledgements published",
                            registry=r)
        self.batches = Counter("edge_fleet_batches", "Store transactions committed", registry=r)
        self.store_errors = Counter("edge_fleet_store_errors",
                                    "Batches the store failed (retried, nothing acked)",
                                    registry=r)
        self.store_conflicts = Counter(
            "edge_fleet_store_conflicts",
            "Batches rolled back because another writer's transaction crossed theirs (two "
            "controllers on one PostgreSQL), tried again at once", registry=r)
        self.batch_seconds = Histogram("edge_fleet_batch_seconds", "Time to commit one batch",
                                       buckets=BATCH_BUCKETS, registry=r)
        self.lag = Gauge("edge_fleet_ingest_lag_seconds",
                         "Last batch: longest a message waited in the controller before it "
                         "was committed", registry=r)
        self.age = Histogram("edge_fleet_message_age_seconds",
                             "Commit time minus the device's timestamp (includes outbox time "
                             "while offline and clock skew)", buckets=AGE_BUCKETS, registry=r)
        self.queue = Gauge("edge_fleet_ingest_queue", "Messages received, not yet committed",
                           registry=r)
        self.rollout_commands = Counter("edge_fleet_rollout_commands",
                                        "rollout.start/cancel/rollback commands the broker "
                                        "took from the rollout engine", ["type"], registry=r)
        self.connected = Gauge("edge_fleet_broker_connected", "1 while connected to the broker",
                               registry=r)
        if store is not None:
            r.register(_FleetCollector(store.devices, store.registrations))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    """Read at scrape: the store is the truth about devices, not a copy kept in memory."""

    def __init__(self, devices: Callable[[], list[dict[str, object]]],
                 registrations: Callable[[], Mapping[str, object]]) -> None:
        self._devices = devices
        self._registrations = registrations

    def collect(self) -> Iterable[Metric]:
        store_up = GaugeMetricFamily("edge_fleet_store_up", "1 if the store answered this scrape")
        try:
            devices = self._devices()
            registered = set(self._registrations())
        except Exception:  # a scrape must answer even while the database is away
            log.exception("fleet: the store did not answer a scrape")
            store_up.add_metric([], 0)
            yield store_up
            return
        store_up.add_metric([], 1)
        yield store_up
        total = GaugeMetricFamily("edge_fleet_devices", "Devices known")
        total.add_metric([], len(devices))
        online = GaugeMetricFamily("edge_fleet_devices_online", "Devices online (birth seen, "
                                   "no death of the same session)")
        online.add_metric([], sum(1 for d in devices if d["online"]))
        up = GaugeMetricFamily("edge_fleet_device_up", "1 if the device is online",
                               labels=["device", "fleet"])
        seen = GaugeMetricFamily("edge_fleet_device_last_seen_seconds",
                                 "Unix time of the device's last message",
                                 labels=["device", "fleet"])
        for d in devices:
            labels = [str(d["device"]), str(d["fleet"])]
            up.add_metric(labels, 1 if d["online"] else 0)
            seen.add_metric(labels, float(d["last_seen"]))  # type: ignore[arg-type]
        awaited = GaugeMetricFamily("edge_fleet_devices_never_seen",
                                    "Devices registered (fleet devices register) that never "
                                    "reported")
        awaited.add_metric([], len(registered - {str(d["device"]) for d in devices}))
        yield from (total, online, up, seen, awaited)
