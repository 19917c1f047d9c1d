"""The fleet link as the server sees it: `start()`, `emit()` from any thread, `stop()`.
This module owns the threads and the state files; the owner thread's loop is
`fleet.device.link.owner`, one connection is `fleet.device.link.session`, what every link shares
(the simulator's devices too) is `fleet.device.link.core`.

Threads:
- `fleet-link` (the owner) runs `Owner.run`, a selector loop over its wake socket and the
  session's socket. It alone touches the outbox's file (flush, pending, mark_sent, ack,
  resend) and receives commands (`CommandGate.receive`: stored in fleet.db before the
  PUBACK). paho's callbacks fire inside `Session.pump()` and only queue events that the
  loop handles after — nothing commits inside a paho callback.
- `fleet-commands` runs accepted commands (`CommandGate.execute`) one at a time, so a slow
  handler (a ledger purge) never stalls the link; its results go through `emit`.
- Producers on any thread call `emit(kind, cls, body)`: the outbox buffers the row in
  memory (its seq is assigned then) and the owner is woken to commit it in a batch.

Each connect: `bdseq = state.next_bdseq()` (committed), the Will (death, retained, QoS 1)
set on a fresh client, CONNECT; on CONNACK the birth (retained, QoS 1), the subscription,
`outbox.resend_all()`, a `link.connected` event. Publishing keeps at most
`options.window` QoS 1 messages awaiting their PUBACK; a PUBACK deletes nothing — only the
controller's ack does. Reconnects back off exponentially from `fleet.reconnect_min_s` to
`fleet.reconnect_max_s` with full jitter. A clean stop publishes the death itself
(retained) and waits for its PUBACK (bounded), because the broker sends no Will after a
DISCONNECT.

Must never: raise into the server (`start`, `emit`, `stop` swallow and count), let one
message's failure end the owner thread, or make serving wait on the broker.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge_agent.config import FleetSettings
from edge_agent.fleet.device.link import birth
from edge_agent.fleet.device.link.command_gate import CommandGate, Handler
from edge_agent.fleet.device.link.core import LinkCore, LinkOptions
from edge_agent.fleet.device.link.outbox import Outbox, OutboxFull, OutboxStats
from edge_agent.fleet.device.link.owner import Owner
from edge_agent.fleet.device.link.state import FleetState
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.signing import load_public

__all__ = ["Link", "LinkOptions"]
log = logging.getLogger(__name__)


class Link(LinkCore):
    """Start with `start()`; `emit()` from any thread; `stop()` at shutdown."""

    def __init__(self, fleet: FleetSettings, state_dir: Path, *, facts: birth.Facts,
                 handlers: Mapping[str, Handler] | None = None,
                 options: LinkOptions | None = None, boot_id: str | None = None) -> None:
        super().__init__(fleet, facts=facts, handlers=handlers, options=options,
                         boot_id=boot_id)
        self.state_dir = state_dir
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_flag = False
        self._lock = threading.Lock()  # the wake flag, early emits, closed
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._work: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._outbox: Outbox | None = None
        self._state: FleetState | None = None
        self._gate: CommandGate | None = None
        self._early: list[tuple[str, str, dict[str, Any]]] = []
        self._closed = False
        self._opened = threading.Event()  # the outbox opened, or the link closed: no wait

    # -- the server's side: never raises --------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        try:
            self._thread = threading.Thread(target=self._run, name="fleet-link", daemon=True)
            self._thread.start()
        except Exception:
            log.exception("fleet: the link did not start; the box serves without it")

    def stop(self, timeout: float = 15.0) -> None:
        """Publishes the death, commits what is buffered, disconnects; bounded."""
        try:
            self._stopping.set()
            self._wake()
            if self._thread is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    log.warning("fleet: the link did not stop within %.0f s", timeout)
                    return
            self._wake_r.close()
            self._wake_w.close()
        except Exception:
            log.exception("fleet: stopping the link failed")

    def emit(self, kind: str, cls: str, body: Mapping[str, Any], *, commit: bool = False
             ) -> bool:
        """Queues one message for the controller (committed within milliseconds by the
        owner thread; with `commit`, on disk before this returns); False if it was refused
        (logged once per kind, counted). A `commit` emit made before the owner has opened
        the outbox (the first seconds of a start) waits for it, bounded by
        `options.open_wait_s`: a durable message cannot be held in memory, and refusing it
        made every first start log a failed events tick."""
        try:
            if commit and not self._opened.is_set():
                self._opened.wait(self.options.open_wait_s)
            with self._lock:
                outbox = self._outbox
                refused = self._closed or (outbox is None and (
                    commit or len(self._early) >= self.options.max_early))
                if outbox is None and not refused:  # the owner has not opened it yet
                    self._early.append((kind, cls, dict(body)))
                    return True
            if refused or outbox is None:
                self.count("emit_refused")
                return False
            outbox.append(kind, cls, body, commit=commit)
        except (ValueError, TypeError) as exc:  # OutboxFull is a ValueError too
            self.count("emit_refused")
            if not isinstance(exc, OutboxFull):
                self.log_once(f"emit:{kind}", "fleet: a %s message was refused: %s", kind, exc)
            return False
        except Exception:
            self.log_once(f"emit-error:{kind}", "fleet: emitting a %s message failed", kind,
                           exc_info=True)
            return False
        self._wake()
        return True

    def outbox_stats(self) -> OutboxStats | None:
        outbox = self._outbox
        try:
            return outbox.stats() if outbox is not None and not self._closed else None
        except Exception:
            return None

    # -- the owner thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            owner = self._open()
            if owner is not None:
                self._owner = owner
                owner.run(self._wake_r, self._drain_wake, self._stopping)
        except Exception:
            log.exception("fleet: the link stopped on an error; the box serves without it")
        finally:
            self._close()

    def _open(self) -> Owner | None:
        """fleet.db, the outbox, the command gate; retried while the files cannot open
        (a full disk), None if stopped meanwhile."""
        delay = 1.0
        while not self._stopping.is_set():
            try:
                self._state = FleetState(self.state_dir / "fleet.db")
                outbox = Outbox(self.state_dir / "outbox.db", device=self.device,
                                boot_id=self.boot_id, max_bytes=self.fleet.outbox_max_bytes)
                break
            except Exception as exc:
                self.log_once("open", "fleet: cannot open the link's state in %s (%s); "
                               "retrying", self.state_dir, exc)
                if self._state is not None:
                    self._state.close()
                    self._state = None
                self._stopping.wait(delay)
                delay = min(delay * 2, 60.0)
        else:
            return None
        key = None
        if self.fleet.command_public_key_file is None:
            log.warning("fleet: no fleet.command_public_key_file: every command will be "
                        "refused and the controller's acks are taken unverified (the "
                        "broker's ACL alone guards the outbox)")
        else:
            try:
                key = load_public(self.fleet.command_public_key_file)
            except Exception as exc:
                log.error("fleet: command key %s unreadable (%s): every command will be "
                          "refused (bad_signature)", self.fleet.command_public_key_file, exc)
        self._gate = CommandGate(self._state, fleet=self.fleet_id, device=self.device,
                                 public_key=key, handlers=self._handlers)
        with self._lock:
            early, self._early = self._early, []
            self._outbox = outbox
        self._opened.set()
        for kind, cls, body in early:
            self.emit(kind, cls, body)
        for command in self._gate.resume():  # stored, never finished: they run now
            self._work.put(command)
        self._worker = threading.Thread(target=self._work_loop, name="fleet-commands",
                                        daemon=True)
        self._worker.start()
        return Owner(self, outbox, self._gate, self._state)

    # -- commands (the `fleet-commands` thread) ---------------------------------------------

    def _work_loop(self) -> None:
        while True:
            command = self._work.get()
            if command is None:
                return
            try:
                assert self._gate is not None
                result = self._gate.execute(command)
            except Exception:
                self.count("errors")
                log.exception("fleet: command %s (%s) could not run", command.id, command.type)
                continue
            self._finished(result)

    def dispatch(self, command: Command) -> None:
        self._work.put(command)

    def finish_commands(self) -> None:
        """At stop: commands still queued stay stored without an outcome (they run at the
        next start); the one running may finish, bounded."""
        while True:
            try:
                self._work.get_nowait()
            except queue.Empty:
                break
        self._work.put(None)
        if self._worker is not None:
            self._worker.join(self.options.command_wait_s)

    # -- stopping ---------------------------------------------------------------------------

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        self._opened.set()  # a durable emit waiting for the outbox is refused now
        worker_done = self._worker is None or not self._worker.is_alive()
        for closer in (self._outbox, self._state if worker_done else None):
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    log.exception("fleet: closing %s failed", type(closer).__name__)

    # -- small things -----------------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            if self._wake_flag:
                return
            self._wake_flag = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def _drain_wake(self) -> None:
        with self._lock:
            self._wake_flag = False  # before reading the buffer: no wake is ever lost
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
