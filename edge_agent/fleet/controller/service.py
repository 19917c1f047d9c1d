"""`fleet serve` put together: the store, its leadership (`leadership`: the rollout engine
and retention act only while this controller leads; a second controller on a SQLite store
stops here), the ingest session, the rollout engine, the retention and the HTTP API in
one process, started in that order and stopped in the reverse one.

The HTTP server runs in the calling thread (uvicorn handles SIGINT/SIGTERM); the ingest,
the rollout engine (`rollouts`, which signs with `command_signing_key_file`) and the retention
(`retention`: old messages out, hourly) have their own threads. Stopping commits and
acknowledges what the ingest holds before the broker connection closes, then closes the
store.

HTTPS with `[http] tls_cert_file`/`tls_key_file` (`edge_agent.tls`, reloaded on SIGHUP as
the box's is); an address other than loopback needs it, and an operator (`exposure_checked`).

`serve_releases` is the other process of the central host (`fleet serve-releases`): the
release repository, read-only, on a listener of its own for the boxes.

Under systemd (`Type=notify`) it reports as the agent does (`edge_agent.sdnotify`): STATUS=
while it connects to the broker, READY=1 once the HTTP port is bound and the ingest is
subscribed, WATCHDOG=1 from the event loop, STOPPING=1 when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge_agent.config import ConfigError
from edge_agent.config.controller import ControllerSettings
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.commands import CommandSender
from edge_agent.fleet.controller.ingest import Ingest
from edge_agent.fleet.controller.leadership import Leadership, Presence, leadership_for
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases.artifacts import release_app
from edge_agent.fleet.controller.releases.repository import releases_dir
from edge_agent.fleet.controller.retention import Retention
from edge_agent.fleet.controller.rings import Rings
from edge_agent.fleet.controller.rollouts.driver import RolloutEngine
from edge_agent.fleet.controller.store import ControllerStore, open_store
from edge_agent.fleet.protocol.signing import load_private
from edge_agent.netaddr import is_loopback
from edge_agent.sdnotify import Notifier, announce_ready, keep_alive
from edge_agent.tls import ServerTLS, TLSFileError, reload_logged

log = logging.getLogger(__name__)


@dataclass
class Controller:
    settings: ControllerSettings
    store: ControllerStore
    metrics: ControllerMetrics
    ingest: Ingest
    rollouts: RolloutEngine | None = None
    retention: Retention | None = None

    commands: CommandSender | None = None
    leadership: Leadership | None = None  # None: the ingest alone (tests of the ingest)
    presence: Presence | None = None

    @classmethod
    def open(cls, settings: ControllerSettings) -> Controller:
        key = command_key(settings)  # a bad key file stops the start, not a rollout later
        store = open_store(settings.db, settings.state_dir)
        leadership = leadership_for(settings.db, settings.state_dir, settings.broker.client_id)
        metrics = ControllerMetrics(store, leadership=leadership)
        return cls(settings, store, metrics, Ingest(settings, store, metrics, key=key),
                   RolloutEngine(settings, store, key, metrics=metrics,
                                 leading=leadership.is_leader),
                   Retention(settings.retention, store.retention, leading=leadership.is_leader),
                   None if key is None else CommandSender(settings, key), leadership,
                   Presence(store, leadership))

    def start(self) -> None:
        if self.leadership is not None:
            self.leadership.start()  # a second controller on a SQLite store stops here
        if self.presence is not None:
            self.presence.start()
        self.ingest.start()
        if self.rollouts is not None:
            self.rollouts.start()
        if self.retention is not None:
            self.retention.start()

    def http_server(self, *, log_level: str = "warning") -> uvicorn.Server:
        http = self.settings.http
        tls = exposure_checked(self.settings, self.store)
        app = create_app(self.store, self.metrics,
                         broker_connected=lambda: self.ingest.connected,
                         leadership=None if self.leadership is None else
                         self.leadership.state,
                         state_dir=self.settings.state_dir,
                         loopback=is_loopback(self.settings.http.host),
                         metrics_open=self.settings.http.metrics_open,
                         commands=self.commands,
                         rings=Rings.of(self.settings.stages),
                         slo=self.settings.slo)
        config = uvicorn.Config(
            app, host=http.host, port=http.port, log_level=log_level, lifespan="off",
            access_log=False,
            ssl_context_factory=(lambda _c, _d: tls.context) if tls is not None else None)
        broker = self.settings.broker.url
        return _SupervisedServer(
            config, Notifier.from_environ(), tls=tls,
            problems=lambda: [] if self.ingest.connected else [f"connecting to {broker}"],
            serving=f"ingesting from {broker}; {http.scheme.upper()} on "
                    f"{config.host}:{config.port}")

    def close(self) -> None:
        if self.presence is not None:
            self.presence.stop()
        if self.retention is not None:
            self.retention.stop()
        if self.rollouts is not None:
            self.rollouts.stop()
        self.ingest.stop()
        if self.leadership is not None:
            self.leadership.stop()
        self.store.close()


def command_key(settings: ControllerSettings) -> Ed25519PrivateKey | None:
    """The key that signs the rollout engine's commands and the ingest's acks (None:
    rollouts wait, and say so; acks go unsigned, which only a box without the key takes)."""
    path = settings.command_signing_key_file
    if path is None:
        return None
    try:
        return load_private(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read command_signing_key_file {path}: {exc}") from exc


def exposure_checked(settings: ControllerSettings, store: ControllerStore) -> ServerTLS | None:
    """The HTTPS context `[http]` asks for (None: plain HTTP); ConfigError for a certificate
    that cannot be served, and for an address other than loopback without TLS or without
    an operator: the fleet's inventory, rollouts and commands are not served in clear, nor
    to anyone who asks."""
    http = settings.http
    try:
        tls = ServerTLS(http.tls) if http.tls is not None else None
    except TLSFileError as exc:
        raise ConfigError(f"http.tls_cert_file / tls_key_file: {exc}") from exc
    if not is_loopback(http.host):
        if tls is None:
            raise ConfigError(f"http.host {http.host} is not loopback: the API would carry "
                              "operators' tokens and the fleet's data in clear; set "
                              "http.tls_cert_file and http.tls_key_file")
        if not store.operators.any_operator():
            raise ConfigError(f"http.host {http.host} is not loopback and no operator "
                              "exists: create one first (edge-agent fleet operators create "
                              "NAME --role admin)")
    return tls


def serve(settings: ControllerSettings, *, log_level: str = "warning") -> bool:
    """Run until SIGINT/SIGTERM; False if the HTTP server could not start."""
    controller = Controller.open(settings)
    try:
        server = controller.http_server(log_level=log_level)  # refused before ingesting
        controller.start()
        try:
            server.run()
        except SystemExit:  # uvicorn exits when it cannot bind; the caller words it
            pass
        return bool(server.started)
    finally:
        controller.close()


def serve_releases(settings: ControllerSettings, *, log_level: str = "warning") -> bool:
    """`fleet serve-releases`: `<state_dir>/releases/` read-only on `[releases]`' listener,
    until SIGINT/SIGTERM (HTTPS reloaded on SIGHUP); False if it could not bind. It opens no
    store and no broker connection: it reads files the controller writes."""
    listener = settings.releases
    try:
        tls = ServerTLS(listener.tls) if listener.tls is not None else None
    except TLSFileError as exc:
        raise ConfigError(f"releases.tls_cert_file / tls_key_file: {exc}") from exc
    root = releases_dir(settings.state_dir)
    if not (root / "metadata").is_dir():
        raise ConfigError(f"no release repository in {root} (edge-agent fleet release init)")
    if tls is None and not is_loopback(listener.host):
        log.warning("serving releases on %s without TLS: the signatures keep the files "
                    "whole, but anyone on the way sees which releases a box fetches",
                    listener.host)
    config = uvicorn.Config(
        release_app(root), host=listener.host, port=listener.port, log_level=log_level,
        lifespan="off", access_log=False,
        ssl_context_factory=(lambda _c, _d: tls.context) if tls is not None else None)
    server = _SupervisedServer(
        config, Notifier.from_environ(), tls=tls, problems=lambda: [],
        serving=f"{root} read-only, {listener.scheme.upper()} on {config.host}:{config.port}")
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind; the caller words it
        pass
    return bool(server.started)


class _SupervisedServer(uvicorn.Server):
    """uvicorn's Server telling systemd how the controller stands (see the docstring)."""

    def __init__(self, config: uvicorn.Config, notifier: Notifier, *,
                 problems: Callable[[], list[str]], serving: str,
                 tls: ServerTLS | None = None) -> None:
        super().__init__(config)
        self.notifier = notifier
        self.tls = tls
        self._problems = problems
        self._serving = serving
        self._tasks: list[asyncio.Task[None]] = []
        self._hangup = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and threading.current_thread() is threading.main_thread():
            # SIGHUP (systemctl reload): the certificate read again, open streams kept.
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_logged,
                                                          self.tls)
            self._hangup = True
        if self.started:
            self._tasks = [
                asyncio.create_task(announce_ready(self.notifier, self._problems,
                                                   serving=self._serving)),
                asyncio.create_task(keep_alive(self.notifier))]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._hangup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._hangup = False
        if self._tasks:  # the announcer: never READY=1 after STOPPING=1
            self._tasks[0].cancel()
        self.notifier.stopping("stopping: committing and acknowledging what the ingest holds")
        try:
            await super().shutdown(sockets)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

