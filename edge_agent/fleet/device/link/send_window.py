"""The owner's publishing window: outbox rows handed to paho while the broker's window
has room, the controller's acks that delete them, and the resends of what went unheard
or stayed unacknowledged.

`Owner` holds one `SendWindow` (`owner.send`) and calls it only on its own thread, inside
its turn, with its session: at the CONNACK (`limit`), at a PUBACK (`puback`), when acks
arrive (`apply_acks`), when rows wait (`publish`), on its clock (`check_overdue`) and when
the connection drops (`forget_in_flight`). Its state is what is in flight (`inflight`,
`ready`), the window (`window`) and what the acks said (`last_ack`, `unheard`, `checked`,
`forced`). It never connects, drops or touches the selector (the owner's), never exceeds
the window (a protocol error some brokers disconnect for), and never commits inside a
paho callback.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from edge_agent.fleet.device.link.outbox import Outbox, Row
from edge_agent.fleet.device.link.session import Event, Session
from edge_agent.fleet.protocol import topics
from edge_agent.fleet.protocol.envelope import AckRefused, decode_ack

if TYPE_CHECKING:
    from edge_agent.fleet.device.link.command_gate import CommandGate
    from edge_agent.fleet.device.link.core import LinkCore

log = logging.getLogger("edge_agent.fleet.device.link.owner")  # the owner's lines keep their logger


class SendWindow:
    def __init__(self, link: LinkCore, outbox: Outbox, gate: CommandGate, *,
                 signed_acks: bool, step: Callable[[Callable[[], None]], None]) -> None:
        self.link = link
        self.options = link.options
        self.outbox = outbox
        self.gate = gate  # its command key verifies the acks too
        self.signed_acks = signed_acks  # a command key is configured: every ack is signed
        self.step = step  # the owner's: one failing step is logged, not raised
        self.inflight: dict[int, int] = {}  # mid -> outbox row id
        self.ready: deque[Row] = deque()  # marked sent, not yet handed to paho
        # At most this many QoS 1 messages without their PUBACK: our window, or less if the
        # broker's CONNACK says so (MQTT 5 Receive Maximum; Mosquitto's is its
        # max_inflight_messages, 20 unless configured). Exceeding it is a protocol error
        # some brokers disconnect for.
        self.window = link.options.window
        self.last_ack = time.monotonic()
        self.last_ack_stamp: float | None = None  # the last ack on the outbox's clock
        # A PUBACK said nobody subscribed (the controller never connected, or its session
        # expired): what was sent went nowhere, so it all goes again at the next ack.
        self.unheard = False
        self.checked = self.forced = time.monotonic()

    def limit(self, receive_max: int) -> None:
        """The CONNACK's Receive Maximum caps the window for this connection."""
        self.window = max(1, min(self.options.window, receive_max))

    def puback(self, mid: int, *, nobody_heard: bool) -> None:
        self.inflight.pop(mid, None)
        if nobody_heard:
            self.unheard = True

    def forget_in_flight(self) -> None:
        """The connection dropped: nothing is in flight on the next one (the outbox's
        `resend_all` at the next connect offers it all again)."""
        self.inflight.clear()
        self.ready.clear()

    def apply_acks(self, session: Session, events: list[Event]) -> None:
        merged: dict[str, list[list[int]]] = {}
        for event in events:
            try:
                acks = decode_ack(event.payload, device=self.link.device,
                                  public_key=self.gate.public_key, signed=self.signed_acks)
            except AckRefused as exc:  # nothing it names is deleted, not even metrics
                self.link.count("refused_acks")
                self.link.log_once("refused-ack", "fleet: an ack the controller did not sign "
                                    "was refused; nothing deleted: %s", exc)
                continue
            except ValueError as exc:
                self.link.count("bad_acks")
                self.link.log_once("bad-ack", "fleet: a malformed ack was ignored: %s", exc)
                continue
            for boot_id, runs in acks.items():
                merged.setdefault(boot_id, []).extend([a, b] for a, b in runs)
        if merged:
            self.link.count("acked_rows", self.outbox.ack(merged))  # one transaction
            self.last_ack = time.monotonic()
            self.last_ack_stamp = self.outbox.now()
            if self.unheard:  # the controller is back: what went to nobody goes again
                self.unheard = False
                self.ready.clear()  # offered again by `pending`, in order
                self.link.count("resent", self.outbox.resend_all())
        for event in events:  # after the rows are gone: a lost ack comes again
            session.ack(event.mid, event.qos)

    def publish(self, session: Session) -> None:
        """Publishes outbox rows while the window has room. Rows are taken `batch` at a
        time and marked sent in one commit before they go out (a window of 20 must not
        mean a commit per 20 messages); those still waiting here when the connection
        drops are offered again by the `resend_all` of the next connect."""
        sent = 0
        while len(self.inflight) < self.window:
            if not self.ready:
                rows = self.outbox.pending(limit=self.options.batch)
                if not rows:
                    break
                self.outbox.mark_sent([row.id for row in rows])
                self.ready.extend(rows)
            row = self.ready[0]
            mid = session.publish(
                topics.topic(self.link.fleet_id, self.link.device, row.kind), row.payload)
            if mid is None:
                break
            self.ready.popleft()
            self.inflight[mid] = row.id
            sent += 1
        if sent:
            self.link.count("published", sent)

    def check_overdue(self, now: float) -> None:
        """Rows sent more than `ack_timeout_s` ago and not acknowledged go again when the
        controller acknowledged something after they were sent: it was up, so they were
        lost on the way (one of two controllers killed holding them). That holds for a box
        with nothing more to send as well, whose last ack is older than the timeout. With
        no ack since they were sent the controller is away and its broker session holds
        them: then only every tenth timeout, not a second backlog each time."""
        timeout = self.options.ack_timeout_s
        if now - self.checked < min(5.0, timeout / 4):
            return
        self.checked = now
        if now - self.last_ack >= timeout and now - self.forced >= 10 * timeout:
            self.forced = now
            self.step(self._resend_overdue)
        elif self.last_ack_stamp is not None:
            self.step(lambda: self._resend_overdue(sent_before=self.last_ack_stamp))

    def _resend_overdue(self, sent_before: float | None = None) -> None:
        n = self.outbox.resend_all(older_than_s=self.options.ack_timeout_s,
                                   sent_before=sent_before)
        if n:
            self.link.count("resent", n)
            log.info("fleet: %d messages unacknowledged for %.0f s; sending them again", n,
                     self.options.ack_timeout_s)
