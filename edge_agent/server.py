"""The HTTP server: uvicorn's h11 protocol with the deadlines uvicorn lacks, and its Config.

uvicorn bounds only the idle time between two requests on a keep-alive connection
(`timeout_keep_alive`). It has no deadline for a request's head (a slowloris client that
sends a header byte every few seconds, or connects and sends nothing, holds its connection
forever), none for a request's body (a body trickled at 1 byte/s holds it too: each byte
cancels the keep-alive timer), and none for a client that stops reading a response: a stream's
bytes pile up in the socket buffers (4 MB on loopback before a write would even block)
while its generation runs on. Its `limit_concurrency` answers a plain-text 503 and counts
running tasks as well as connections. `GuardedH11Protocol` adds what is missing:

- head: `server.header_timeout_s` from the connection opening (or from the first byte of
  the next request on a keep-alive connection) until the head is complete; else a 408
  (nothing, if no byte came) and the connection is closed;
- body: `server.body_timeout_s` from the head until the body is complete; the app's
  `receive` then raises `BodyTimeout` (408 in the dialect's shape, `Connection: close`),
  and a body still trickling after the response is cut;
- stall: while bytes are owed to the client, its TCP stack must take some of them
  (acknowledged bytes grow, or nothing is left unsent) at least every
  `server.stall_timeout_s`; else the connection is reset, which ends the request as a
  disconnect does (the stream's generation is cancelled and its slot freed);
- cap: a connection opened while `server.max_connections` are open gets a 503 in the
  dialect's shape (Retry-After, `Connection: close`) to its request.

Everything runs on the event loop: a timer per connection, no thread, no polling of idle
connections.

Under systemd (`Type=notify`), `SupervisedServer` reports to it through `edge_agent.sdnotify`:
STATUS= lines while the default model loads, READY=1 once the port is bound and `/ready`'s
check passes, WATCHDOG=1 from the event loop for the server's whole life, STOPPING=1 when
the drain begins. Without $NOTIFY_SOCKET it is plain uvicorn.

HTTPS: with `[server] tls_cert_file` and `tls_key_file` the same port speaks TLS through
`edge_agent.tls.ServerTLS`, whose context is handed to uvicorn as it is (not rebuilt from
paths), so that SIGHUP (`systemctl reload edge-agent`) loads the files again into that very
context: new connections get the new certificate, open ones and their streams go on. SIGHUP
is taken in the main thread only (a server run in a thread, as the tests' is, leaves the
process's signals alone); without TLS it reloads nothing and says so, rather than ending
the process as SIGHUP's default would.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import signal
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from edge_agent.api.errors import error_response
from edge_agent.api.ops import readiness_problems
from edge_agent.config import ServerSettings, Settings
from edge_agent.errors import BodyTimeout, ServiceUnavailable
from edge_agent.sdnotify import Notifier, announce_ready, keep_alive
from edge_agent.tls import ServerTLS, reload_logged

log = logging.getLogger(__name__)

# A request head (request line and headers) larger than this is refused with a 400.
MAX_HEAD_BYTES = 16 * 1024
# Running requests get `server.stop_grace_s` (this by default) to finish after SIGTERM; then
# every stream still open is ended with a ShuttingDown error in its dialect (a final error
# object or event and a properly ended body, never a connection that just closes), and the
# lifespan closes the models and flushes the ledger. uvicorn's own cancel of what is left
# comes CUT_WAIT_S later, for a response that ignored its end. systemd/edge-agent.service's
# TimeoutStopSec covers the grace, the cut, the fleet link's stop and the ledger's flush
# (tests/test_systemd_units.py holds them together).
GRACEFUL_SHUTDOWN_S = 10
CUT_WAIT_S = 3
_CLOSE = (b"connection", b"close")
_TCP_BYTES_ACKED = 120  # offsetof(struct tcp_info, tcpi_bytes_acked), Linux >= 4.2
_HEAD_TIMEOUT_BODY = b"the request head did not arrive in time"
_HEAD_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY))


def server_tls(settings: Settings) -> ServerTLS | None:
    """The HTTPS context `[server]` asks for, or None (plain HTTP); TLSFileError (one line)
    when its files cannot be served with."""
    files = settings.server.tls
    return ServerTLS(files) if files is not None else None


def uvicorn_config(app: Any, settings: Settings, *, log_level: str | None = None,
                   tls: ServerTLS | None = None) -> Config:
    """The one uvicorn Config of the server, built from `[server]`: `serve` and the tests'
    live server both use it, so tests exercise the real limits. `tls`: the context to serve
    with (built from `[server]` when not given), kept by the caller that reloads it."""
    server = settings.server
    if tls is None:
        tls = server_tls(settings)
    context = tls.context if tls is not None else None
    return Config(
        app, host=server.host, port=server.port, http=guarded_protocol(server), ws="none",
        lifespan="on", log_level=log_level or settings.log_level, log_config=None,
        access_log=False, timeout_keep_alive=max(1, math.ceil(server.keep_alive_timeout_s)),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=math.ceil(server.stop_grace_s) + CUT_WAIT_S,
        ssl_context_factory=(lambda _config, _default: context) if context else None)


def serve(app: Any, settings: Settings, *, tls: ServerTLS | None = None) -> bool:
    """Runs until SIGINT/SIGTERM; False when the server could not start (port taken …)."""
    server = build_server(app, settings, tls=tls)
    server.run()
    return server.started


def build_server(app: Any, settings: Settings, *, environ: Mapping[str, str] | None = None,
                 log_level: str | None = None, tls: ServerTLS | None = None
                 ) -> SupervisedServer:
    """The server `serve` runs: `app` (from `create_app`) under `uvicorn_config`, reporting
    to systemd when `environ` (default: this process's) names a NOTIFY_SOCKET."""
    parts = app.state.parts
    server = settings.server
    if tls is None:
        tls = server_tls(settings)
    built = SupervisedServer(
        uvicorn_config(app, settings, log_level=log_level, tls=tls),
        Notifier.from_environ(environ),
        grace_s=server.stop_grace_s, cut=parts.service.cut_all,
        problems=lambda: readiness_problems(parts), tls=tls,
        serving=f"serving on {server.scheme}://{server.host}:{server.port}, default model "
                f"{settings.default_model} loaded")
    parts.stop = built.request_stop
    return built


class SupervisedServer(uvicorn.Server):
    """uvicorn's Server, telling systemd how it stands (see the module's docstring)."""

    def __init__(self, config: Config, notifier: Notifier, *,
                 problems: Callable[[], list[str]], serving: str,
                 grace_s: float = GRACEFUL_SHUTDOWN_S,
                 cut: Callable[[], int] | None = None,
                 tls: ServerTLS | None = None) -> None:
        super().__init__(config)
        self.notifier = notifier
        self.tls = tls
        self._hangup = False
        self._grace_s = grace_s
        self._cut = cut
        self._problems = problems
        self._serving = serving
        self._announcer: asyncio.Task[None] | None = None
        self._pinger: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.notifier.status(f"starting: opening the ledger, binding {self.config.host}:"
                             f"{self.config.port}")
        await super().startup(sockets)
        if self.started and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
            self._hangup = True
        if self.started:  # bound: from here on readiness is the app's to report
            self._announcer = asyncio.create_task(
                announce_ready(self.notifier, self._problems, serving=self._serving))
            self._pinger = asyncio.create_task(keep_alive(self.notifier))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._hangup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._hangup = False
        if self._announcer is not None:  # a stop during start-up must not end in READY=1
            self._announcer.cancel()
        self.notifier.stopping(f"stopping: draining {len(self.server_state.connections)} "
                               f"connections (up to {self._grace_s:g} s), then "
                               "flushing the ledger")
        cutter = asyncio.create_task(self._cut_after_grace())
        try:
            await super().shutdown(sockets)  # the pings go on: a long drain is no hang
        finally:
            cutter.cancel()
            tasks = [t for t in (self._announcer, self._pinger, cutter) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def request_stop(self) -> None:
        """The drain of a SIGTERM, asked from inside (any thread): uvicorn re-raises a
        signal it caught once it has stopped, and a process that dies of SIGTERM is a
        clean stop to systemd, which restarts only a failure (`fleet.device.agent.boot`:
        exit 75)."""
        self.should_exit = True

    def reload(self) -> bool:
        """SIGHUP: the certificate files read again (see the module's docstring); False,
        and the certificate served so far kept, when they cannot be."""
        return reload_logged(self.tls)

    async def _cut_after_grace(self) -> None:
        """The drain's end: what still streams is told it was cut (see the constants)."""
        await asyncio.sleep(self._grace_s)
        if self._cut is None:
            return
        cut = self._cut()
        if cut:
            log.warning("stopping: %d generation(s) still running after %g s: ended with a "
                        "'shutting down' error", cut, self._grace_s)
            self.notifier.status(f"stopping: {cut} generation(s) cut after {self._grace_s:g} "
                                 "s; flushing the ledger")


def guarded_protocol(server: ServerSettings) -> type[GuardedH11Protocol]:
    """uvicorn builds protocols from a class: one subclass per server carries its limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": server})


class GuardedH11Protocol(H11Protocol):
    """One connection: uvicorn's h11 protocol plus head, body and stall deadlines and the
    connection cap (see the module's docstring)."""

    limits: ClassVar[ServerSettings]

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._inner_app = self.app
        self.app = self._guarded  # type: ignore[assignment]
        self._refused = False
        self._lost = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._progress = _Progress()
        self._seen_cycle: Any = None

    # --- connection events -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused = len(self.connections) > self.limits.max_connections
        self._progress.sock = transport.get_extra_info("socket")
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                self._on_head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        for timer in (self._head_timer, self._body_timer, self._watchdog):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._watchdog = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def _follow_request(self) -> None:
        """Arms or cancels the head and body deadlines from where the client's side of the
        exchange now stands (h11's state)."""
        if self._lost:
            return
        if self.cycle is not None and self.cycle is not self._seen_cycle:  # a new head
            self._seen_cycle = self.cycle
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self._watch()
            if self.conn.their_state is h11.SEND_BODY:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s,
                                                        self._on_body_timeout)
        state = self.conn.their_state
        if state is h11.IDLE and self._head_timer is None and self.conn.trailing_data[0]:
            # Bytes of the next head are here: its deadline starts with the first of them
            # (before any byte, the keep-alive timer is the one that runs).
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                    self._on_head_timeout)
        if state is not h11.SEND_BODY and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    # --- deadlines ---------------------------------------------------------------------

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self._lost or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # a partial head: say why before closing
            self.transport.write(_HEAD_TIMEOUT_RESPONSE)
        self.transport.close()

    def _on_body_timeout(self) -> None:
        """The app's `receive` raises at the same deadline when it is reading; this covers
        a body nobody reads, still trickling in after its response."""
        self._body_timer = None
        if self._lost or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # close once the response is out
        elif not self.transport.is_closing():
            self.transport.close()

    def _watch(self) -> None:
        """The stall watchdog: ticks while a request is in flight or bytes are owed to the
        client; resets the connection when the client has taken none for the stall
        timeout."""
        if self._watchdog is not None or self._lost:
            return
        stall = self.limits.stall_timeout_s
        self._progress.restart(self.loop.time())
        self._watchdog = self.loop.call_later(min(1.0, stall / 4), self._tick)

    def _tick(self) -> None:
        self._watchdog = None
        if self._lost:
            return
        now = self.loop.time()
        buffered = self.transport.get_write_buffer_size()
        owed = self._progress.sample(now, buffered)
        busy = self.cycle is not None and not self.cycle.response_complete
        if not owed and not busy:
            return  # idle: the keep-alive timer takes over
        if owed and now - self._progress.at >= self.limits.stall_timeout_s:
            log.warning("client %s took no bytes for %.0f s: disconnected",
                        _peer(self.client), self.limits.stall_timeout_s)
            self._reset()
            return
        self._watchdog = self.loop.call_later(min(1.0, self.limits.stall_timeout_s / 4),
                                              self._tick)

    def _reset(self) -> None:
        """Drops the connection at once: a close would wait for the unread bytes to drain
        (forever), and an RST frees the kernel's buffers too."""
        sock = self._progress.sock
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()

    # --- the app, per request ----------------------------------------------------------

    async def _guarded(self, scope: Any, receive: Any, send: Any) -> None:
        if self._refused:
            await self._refuse(scope, receive, send)
            return
        cycle = self.cycle
        loop = self.loop
        limit = self.limits.body_timeout_s
        deadline = loop.time() + limit
        body_done = False
        timed_out = False

        async def receive_in_time() -> Any:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                cycle.keep_alive = False
                raise BodyTimeout(
                    f"the request body did not arrive within {limit:g} s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        async def send_closing(message: Any) -> None:
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), _CLOSE]}
            await send(message)

        await self._inner_app(scope, receive_in_time, send_closing)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        _warn_refused(self.limits.max_connections)
        response = error_response(
            ServiceUnavailable(f"the server has {self.limits.max_connections} connections "
                               "open, its limit; try again", retry_after=1.0),
            scope.get("path", ""))
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class _Progress:
    """How much of what was written the client's TCP stack has taken (Linux: the kernel's
    acknowledged-bytes count and unsent queue; elsewhere: only the loop's own buffer)."""

    def __init__(self) -> None:
        self.sock: Any = None
        self.at = 0.0  # loop time of the last sign of progress
        self._mark: tuple[int, int] | None = None

    def restart(self, now: float) -> None:
        self.at = now
        self._mark = None

    def sample(self, now: float, buffered: int) -> bool:
        """Records progress at `now`; returns whether bytes are still owed to the client."""
        queued, acked = _kernel_queue(self.sock)
        owed = buffered > 0 or queued > 0
        mark = (acked, -buffered - queued) if acked >= 0 else (0, -buffered)
        if not owed or self._mark is None or mark > self._mark:
            self.at = now
        self._mark = mark
        return owed


def _kernel_queue(sock: Any) -> tuple[int, int]:
    """(bytes not yet acknowledged by the peer, bytes it has acknowledged); (0, -1) where
    the kernel does not say."""
    if sock is None:
        return 0, -1
    try:
        fd = sock.fileno()
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except (OSError, AttributeError, ValueError):
        return 0, -1
    if len(info) < _TCP_BYTES_ACKED + 8:
        return queued, -1
    return queued, struct.unpack_from("=Q", info, _TCP_BYTES_ACKED)[0]


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


_last_refusal_warning = 0.0


def _warn_refused(limit: int) -> None:
    """One line per minute at most: a flood of refused connections must not flood the log."""
    global _last_refusal_warning
    now = time.monotonic()
    if now - _last_refusal_warning >= 60:
        _last_refusal_warning = now
        log.warning("connection limit (%d) reached: new connections get 503", limit)
