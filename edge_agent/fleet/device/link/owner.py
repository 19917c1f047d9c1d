"""The loop of the link's owner thread: connect and reconnect, publish the outbox, take the
controller's acks and the commands, birth and death. What is in flight (the window, the
acks, the resends) is the `SendWindow` it holds (`send`).

It runs on one thread only (the box's `fleet-link` thread), and is the only code that
touches the outbox's file and receives commands. `run()` is the box's loop: one selector
over the link's wake socket (a producer emitted, a command finished, stop) and the
session's socket, then `turn()`. The simulator (`fleet.sim.fleet`) drives many owners from
one selector instead: it registers nothing for them, calls `connect()` when `due()` says
and `turn()` when their socket is ready or their time has come; an owner registers only its
own session's descriptor (with itself as the key's data) and removes only that one.
paho's callbacks fire inside `Session.pump()` and only queue `session.Event`s; `turn()` acts
on them after, so nothing is committed inside a paho callback. Any one step that fails is
logged once and counted, and the loop goes on: one bad message never ends the link.
"""

from __future__ import annotations

import logging
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge_agent.fleet.device.link import birth
from edge_agent.fleet.device.link.command_gate import CommandGate
from edge_agent.fleet.device.link.outbox import Outbox
from edge_agent.fleet.device.link.send_window import SendWindow
from edge_agent.fleet.device.link.session import Event, LinkError, Session, connack_error
from edge_agent.fleet.device.link.state import FleetState
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.envelope import AUDIT

if TYPE_CHECKING:
    from edge_agent.fleet.device.link.core import LinkCore

log = logging.getLogger(__name__)
NO_SUBSCRIBERS = 0x10  # PUBACK reason: the broker had nobody to give the message to


def backoff_delay(attempt: int, min_s: float, max_s: float) -> float:
    """Full jitter: uniform in [0, min(max_s, min_s * 2^attempt)]."""
    return random.uniform(0, min(max_s, min_s * 2 ** min(attempt, 30)))


class Owner:
    def __init__(self, link: LinkCore, outbox: Outbox, gate: CommandGate,
                 state: FleetState, sel: selectors.BaseSelector | None = None) -> None:
        self.link = link
        self.fleet = link.fleet
        self.options = link.options
        self.outbox = outbox
        self.gate = gate
        self.signed_acks = (link.fleet.command_public_key_file is not None
                            or gate.public_key is not None)
        self.state = state
        # Its own selector, or one shared by many owners (the simulator's).
        self.sel = sel if sel is not None else selectors.DefaultSelector()
        self.session: Session | None = None
        self._fd: int | None = None  # the descriptor this owner registered in `sel`
        # What is in flight: the window, the acks, the resends.
        self.send = SendWindow(link, outbox, gate, signed_acks=self.signed_acks,
                               step=self.step)
        self.bdseq = 0
        self._status = topics.topic(link.fleet_id, link.device, topics.STATUS)
        self._ack = topics.topic(link.fleet_id, link.device, topics.ACK)
        # The loop's own state: reconnect backoff, the CONNACK deadline, connection age.
        self.attempt = 0
        self.next_connect = time.monotonic()
        self.connack_by = self.connected_at = 0.0

    def run(self, wake: socket.socket, drain: Callable[[], None],
            stopping: threading.Event) -> None:
        """The box's loop, until `stopping`: `wake` is readable when a producer emitted
        (`drain` empties it); then a clean stop (`_shutdown`)."""
        sel = self.sel
        sel.register(wake, selectors.EVENT_READ)
        while not stopping.is_set():
            if self.session is None and time.monotonic() >= self.next_connect:
                if not self.connect():
                    continue
            readable = writable = False
            for key, mask in sel.select(self.timeout()):
                if key.fileobj is wake:
                    drain()
                else:
                    readable |= bool(mask & selectors.EVENT_READ)
                    writable |= bool(mask & selectors.EVENT_WRITE)
            self.turn(readable, writable)
        self._shutdown()
        sel.close()

    def due(self) -> float:
        """When this owner next needs a turn without any event (monotonic time): the next
        connect attempt, or within a second while there is a session (keep-alive, the
        CONNACK deadline, overdue acks)."""
        if self.session is None:
            return self.next_connect
        return time.monotonic() + 1.0

    def timeout(self) -> float:
        return min(1.0, max(0.0, self.due() - time.monotonic()))

    def connect(self) -> bool:
        """One connect attempt (Will with a new bdseq, CONNECT); False if it failed, and
        the next attempt is then set back."""
        started = time.monotonic()
        session = self._connect()
        self.connack_by = started + self.options.connack_timeout_s
        if session is None:
            self.next_connect, self.attempt = self._backoff(self.attempt)
            return False
        return True

    def turn(self, readable: bool, writable: bool) -> None:
        """Everything after a wait: the socket's reads and writes, paho's events, the
        outbox's commit and publishing; a lost connection is dropped and its reconnect
        set back."""
        link = self.link
        now = time.monotonic()
        session = self.session
        if session is not None:
            try:
                alive = session.pump(readable, writable)
            except Exception as exc:  # a paho bug or a half-closed TLS socket
                link.log_once("pump", "fleet: connection error: %s", exc, exc_info=True)
                alive = False
            lost = self._handle(session)
            now = time.monotonic()
            if alive and lost is None and not session.established and now > self.connack_by:
                lost = "no CONNACK in time"
            if lost is not None or not alive:
                stable = (session.established
                          and now - self.connected_at >= self.options.stable_s)
                self._drop(session, lost or "connection lost")
                self.next_connect, self.attempt = self._backoff(0 if stable else self.attempt)
                return
            if session.established and not session.greeted:
                session.greeted = True
                self.connected_at = now  # the backoff resets once this is stable_s old
                self._on_connected(session)
        self.step(self.outbox.flush)
        if session is not None and session.established:
            self.step(self._publish_pending)
            if link.take_rebirth():
                self.step(self._publish_birth)
            self.send.check_overdue(now)
            self._watch_writes(session)
        if session is not None and self.session is session and session.fd is None:
            # paho closed the socket during this turn (a publish whose write failed): its
            # number leaves the selector now, before another socket takes it (on a shared
            # selector, another owner's connect in this same pass).
            self._drop(session, "connection lost")
            self.next_connect, self.attempt = self._backoff(self.attempt)

    def cut(self, reason: str) -> None:
        """Drops the connection now without a DISCONNECT, as a lost network would (the
        broker sends the Will); the next attempt comes with the usual backoff."""
        if self.session is not None:
            self._drop(self.session, reason)
            self.next_connect, self.attempt = self._backoff(self.attempt)

    def step(self, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            self.link.count("errors")
            self.link.log_once(f"step:{getattr(fn, '__name__', fn)}:{type(exc).__name__}",
                                "fleet: %s failed (%s); the link goes on",
                                getattr(fn, "__name__", fn), exc, exc_info=True)

    def _publish_pending(self) -> None:
        if self.session is not None:
            self.send.publish(self.session)

    def _backoff(self, attempt: int) -> tuple[float, int]:
        delay = backoff_delay(attempt, self.fleet.reconnect_min_s, self.fleet.reconnect_max_s)
        return time.monotonic() + delay, attempt + 1

    def _watch_writes(self, session: Session) -> None:
        fd = session.fd
        if fd is None:
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if session.want_write() else 0)
        if self.sel.get_key(fd).events != want:
            self.sel.modify(fd, want)

    # -- connecting ---------------------------------------------------------------------

    def _connect(self) -> Session | None:
        link = self.link
        address = self.fleet.broker_address
        try:
            bdseq = self.state.next_bdseq()  # committed before the Will carries it
            will = birth.death(fleet=link.fleet_id, device=link.device, boot_id=link.boot_id,
                               bdseq=bdseq)
            session = Session(self.fleet, client_id=f"edge-{link.fleet_id}-{link.device}",
                              will=(self._status, will), keepalive_s=self.fleet.keepalive_s,
                              window=self.options.window,
                              connect_timeout_s=self.options.connect_timeout_s,
                              session_expiry_s=self.options.session_expiry_s)
            session.open()
        except Exception as exc:
            err = exc if isinstance(exc, LinkError) else LinkError("error", str(exc))
            link.count("connect_failures")
            link.log_once(f"connect:{err.message}", "fleet: cannot reach the broker %s:%s "
                           "(%s); retrying with backoff, the box serves meanwhile",
                           address.host, address.port, err.message)
            return None
        self.bdseq = bdseq
        self.session = session
        if session.fd is not None:
            self.sel.register(session.fd, selectors.EVENT_READ, self)
            self._fd = session.fd
        return session

    def _on_connected(self, session: Session) -> None:
        link = self.link
        address = self.fleet.broker_address
        link.count("connects")
        link.forget_logged(("connect:", "connack:"))
        log.info("fleet: connected to %s:%s as %s (bdseq %d)", address.host, address.port,
                 link.device, self.bdseq)
        link.take_rebirth()  # this birth answers any rebirth asked while offline
        self.step(self._publish_birth)
        # `connected` is set at the SUBACK: from then on a command sent to the box arrives.
        session.subscribe(topics.device_filter(link.fleet_id, link.device))
        self.step(self.outbox.resend_all)  # nothing is in flight on a new connection
        link.emit("events", AUDIT, {"event": "link.connected", "bdseq": self.bdseq,
                                    "broker": f"{address.host}:{address.port}"})

    def _drop(self, session: Session, reason: str) -> None:
        link = self.link
        was = session.established
        session.close()
        self._forget_fd()
        self.session = None
        self.send.forget_in_flight()
        link.mark_connected(False)
        if was:
            link.count("disconnects")
            log.warning("fleet: lost the broker (%s); reconnecting, the box serves "
                        "meanwhile", reason)
            link.emit("events", AUDIT, {"event": "link.disconnected", "reason": reason,
                                        "bdseq": self.bdseq})

    # -- what the callbacks saw ---------------------------------------------------------

    def _handle(self, session: Session) -> str | None:
        """Acts on the session's events; a reason if the connection is to be dropped."""
        link = self.link
        lost: str | None = None
        acks: list[Event] = []
        while session.events:
            event = session.events.popleft()
            try:
                if event.kind == "connack":
                    if event.ok:
                        session.established = True
                        self.send.limit(event.receive_max)
                    else:
                        link.count("connect_failures")
                        lost = connack_error(event.reason, event.code).message
                        link.log_once(f"connack:{event.reason}", "fleet: %s", lost)
                elif event.kind == "suback":
                    link.mark_connected(True)
                    if not event.ok:
                        link.log_once(f"suback:{event.reason}", "fleet: the broker refused "
                                       "a subscription (%s): commands may not arrive",
                                       event.reason)
                elif event.kind == "disconnected":
                    lost = lost or event.reason or "connection lost"
                elif event.kind == "puback":
                    self.send.puback(event.mid, nobody_heard=event.code == NO_SUBSCRIBERS)
                    if event.code != NO_SUBSCRIBERS and not event.ok:
                        link.count("publish_refused")
                        link.log_once(f"puback:{event.reason}", "fleet: the broker refused "
                                       "a message: %s", event.reason)
                elif event.kind == "message":
                    if event.topic == self._ack:
                        acks.append(event)
                    else:
                        self._command(session, event)
            except Exception as exc:  # one message never ends the link
                link.count("errors")
                link.log_once(f"event:{event.kind}:{type(exc).__name__}",
                               "fleet: handling a %s failed: %s", event.kind, exc,
                               exc_info=True)
        if acks:
            self.step(lambda: self.send.apply_acks(session, acks))
        return lost

    def _command(self, session: Session, event: Event) -> None:
        # Stored in fleet.db before the PUBACK; if that raises, no PUBACK: the broker
        # delivers the command again.
        delivery = self.gate.receive(event.payload, event.topic)
        session.ack(event.mid, event.qos)
        self.link.count("commands")
        if delivery.result is not None:
            self.link.emit_result(delivery.result)
        if delivery.execute and delivery.command is not None:
            self.link.dispatch(delivery.command)

    # -- sending ------------------------------------------------------------------------

    def _publish_birth(self) -> None:
        if self.session is None:
            return
        link = self.link
        payload = birth.birth(link.facts(), fleet=link.fleet_id, device=link.device,
                              boot_id=link.boot_id, bdseq=self.bdseq)
        self.session.publish(self._status, payload, retain=True)

    # -- stopping -----------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Commit what is buffered; if connected, publish what is pending and the death
        (the broker sends no Will after a DISCONNECT), wait for its PUBACK, disconnect."""
        begun = self.begin_stop()
        if begun is None:
            return
        session, mid = begun
        deadline = time.monotonic() + self.options.death_wait_s
        acked = False
        while mid is not None and not acked and time.monotonic() < deadline:
            self.sel.select(0.05)
            if not session.pump(True, session.want_write()):
                break
            acked = self.death_acked(session, mid)
        self.end_stop(session, acked)

    def begin_stop(self) -> tuple[Session, int | None] | None:
        """A clean stop's first half: commit what is buffered and, if connected, publish
        what is pending and the death. The session and the death's message id (None: it
        could not be sent) to wait for, or None when there is no connection to close."""
        self.link.finish_commands()
        self.step(self.outbox.flush)
        session = self.session
        if session is None:
            return None
        if not session.established:
            session.close()
            self._forget_fd()
            return None
        self.step(self._publish_pending)
        death = birth.death(fleet=self.link.fleet_id, device=self.link.device,
                            boot_id=self.link.boot_id, bdseq=self.bdseq)
        return session, session.publish(self._status, death, retain=True)

    @staticmethod
    def death_acked(session: Session, mid: int) -> bool:
        """Whether the events pumped since hold the death's PUBACK (the rest is dropped:
        the connection is closing)."""
        acked = False
        while session.events:
            event = session.events.popleft()
            acked = acked or (event.kind == "puback" and event.mid == mid)
        return acked

    def end_stop(self, session: Session, acked: bool) -> None:
        """A clean stop's second half: DISCONNECT (no Will)."""
        if not acked:
            log.warning("fleet: the death message was not acknowledged in %.1f s",
                        self.options.death_wait_s)
        session.disconnect()
        self._forget_fd()
        self.session = None
        self.link.mark_connected(False)

    def _forget_fd(self) -> None:
        # By number: paho may have closed the socket already, and the number must leave
        # the selector before another socket takes it.
        if self._fd is not None:
            try:
                self.sel.unregister(self._fd)
            except KeyError:
                pass
            self._fd = None
