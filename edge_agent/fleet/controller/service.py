"""`fleet serve` put together: the store, the ingest session and the HTTP API in one
process, started in that order and stopped in the reverse one.

The HTTP server runs in the calling thread (uvicorn handles SIGINT/SIGTERM); the ingest
has its own threads. Stopping commits and acknowledges what the ingest holds before the
broker connection closes, then closes the store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import uvicorn

from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.ingest import Ingest
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases import releases_dir
from edge_agent.fleet.controller.settings import ControllerSettings
from edge_agent.fleet.controller.store import FleetStore, open_store

log = logging.getLogger(__name__)


@dataclass
class Controller:
    settings: ControllerSettings
    store: FleetStore
    metrics: ControllerMetrics
    ingest: Ingest

    @classmethod
    def open(cls, settings: ControllerSettings) -> Controller:
        store = open_store(settings.db, settings.state_dir)
        metrics = ControllerMetrics(store)
        return cls(settings, store, metrics, Ingest(settings, store, metrics))

    def http_server(self, *, log_level: str = "warning") -> uvicorn.Server:
        app = create_app(self.store, self.metrics,
                         broker_connected=lambda: self.ingest.connected,
                         releases=releases_dir(self.settings.state_dir))
        return uvicorn.Server(uvicorn.Config(
            app, host=self.settings.http.host, port=self.settings.http.port,
            log_level=log_level, lifespan="off", access_log=False))

    def close(self) -> None:
        self.ingest.stop()
        self.store.close()


def serve(settings: ControllerSettings, *, log_level: str = "warning") -> bool:
    """Run until SIGINT/SIGTERM; False if the HTTP server could not start."""
    controller = Controller.open(settings)
    try:
        controller.ingest.start()
        server = controller.http_server(log_level=log_level)
        try:
            server.run()
        except SystemExit:  # uvicorn exits when it cannot bind; the caller words it
            pass
        return bool(server.started)
    finally:
        controller.close()
