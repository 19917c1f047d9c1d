"""One MQTT connection of the fleet link: a paho-mqtt v2 client (MQTT 5, `manual_ack`)
made fresh for each connection attempt and driven by its owner's own loop
(`loop_read` / `loop_write` / `loop_misc` on a selector), never by paho's threads.

A new client per attempt on purpose: paho keeps unacknowledged messages only in its
memory and resends them on reconnect; the link's outbox is the only queue, resent by the
link after each connect, so nothing of an old connection may linger in paho.

Owns: building the client (credentials from `fleet.password_file`, first line, read at
each connect; TLS for `mqtts://` with `ca_file` and the client certificate), the Will,
the connect itself, and turning paho's callbacks into `Event`s on `events`. Callbacks run
inside `pump()` on the owner's thread, under paho's lock: they only append to the deque —
they never touch SQLite, never publish, never block (measured: committing inside
`on_publish` halves throughput). Also `probe()`, the doctor's one-shot CONNECT.
"""

from __future__ import annotations

import os
import selectors
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge_agent.config import FleetSettings


class LinkError(Exception):
    """A connection attempt that failed; `kind` is one of refused, timeout, dns, tls,
    not_authorized, rejected, config, error (what the doctor and the logs report)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Event:
    """What a paho callback saw, for the owner thread to act on.

    kind: `connack` (ok, reason, code, session_present, receive_max), `disconnected` (reason),
    `puback` (mid, ok, reason, code), `suback` (ok, reason), `message` (topic, payload,
    mid, qos)."""

    kind: str
    ok: bool = True
    reason: str = ""
    code: int = 0
    session_present: bool = False
    receive_max: int = 65535
    mid: int = 0
    qos: int = 0
    topic: str = ""
    payload: bytes = b""


def read_password(path: Path | None) -> str | None:
    """The first line of the password file; LinkError(config) if it cannot be read."""
    if path is None:
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LinkError("config", f"cannot read fleet.password_file {path}: "
                                  f"{getattr(exc, 'strerror', None) or exc}") from None
    if not lines or not lines[0].strip():
        raise LinkError("config", f"fleet.password_file {path} is empty")
    return lines[0].strip()


def describe(exc: BaseException) -> LinkError:
    """A connect error in the words an operator needs (the kind says what to fix)."""
    if isinstance(exc, LinkError):
        return exc
    if isinstance(exc, ConnectionRefusedError):
        return LinkError("refused", "connection refused (nothing listens there)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return LinkError("timeout", "timed out")
    if isinstance(exc, socket.gaierror):
        return LinkError("dns", f"host not found ({exc.strerror})")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return LinkError("tls", f"TLS: the broker's certificate is not trusted "
                                f"({exc.verify_message or exc.reason})")
    if isinstance(exc, ssl.SSLError):
        return LinkError("tls", f"TLS error ({exc.reason or exc})")
    if isinstance(exc, OSError):
        return LinkError("error", exc.strerror or str(exc) or type(exc).__name__)
    return LinkError("error", f"{type(exc).__name__}: {exc}")


def connack_error(reason: str, code: int) -> LinkError:
    # 0x86 bad user name or password, 0x87 not authorized, 0x85 client id not valid,
    # 0x8A banned: all say "your credentials", which is what the operator must fix.
    if code in (0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C, 0x04, 0x05):
        return LinkError("not_authorized", f"the broker refused the login: {reason}")
    return LinkError("rejected", f"the broker refused the connection: {reason}")


class Session:
    """One connection attempt and, if it succeeds, its life; thrown away after."""

    def __init__(self, fleet: FleetSettings, *, client_id: str,
                 will: tuple[str, bytes] | None, keepalive_s: int, window: int,
                 connect_timeout_s: float, session_expiry_s: int,
                 clean_start: bool = False) -> None:
        self.fleet = fleet
        self.address = fleet.broker_address
        self.keepalive_s = keepalive_s
        self.session_expiry_s = session_expiry_s
        self.clean_start = clean_start
        self.events: deque[Event] = deque()
        self.established = False  # CONNACK success seen
        self.greeted = False  # birth, subscription and resend done for this connection
        self._fd: int | None = None
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=mqtt.MQTTv5, manual_ack=True)
        client.connect_timeout = connect_timeout_s
        # Our own window bounds what is in flight; paho's limit matches it so paho never
        # queues a second backlog in its memory.
        client.max_inflight_messages_set(max(1, window))
        client.max_queued_messages_set(0)
        if fleet.username is not None:
            client.username_pw_set(fleet.username, read_password(fleet.password_file))
        if self.address.tls:
            try:
                client.tls_set(
                    ca_certs=str(fleet.ca_file) if fleet.ca_file else None,
                    certfile=str(fleet.client_cert) if fleet.client_cert else None,
                    keyfile=str(fleet.client_key) if fleet.client_key else None)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise LinkError("config", f"TLS files: {describe(exc).message}") from None
        if will is not None:
            client.will_set(will[0], will[1], qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        self.client = client

    # -- paho's callbacks: append, nothing else ------------------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        self.events.append(Event("connack", ok=not reason.is_failure, reason=str(reason),
                                 code=int(reason.value),
                                 session_present=bool(flags.session_present),
                                 receive_max=int(getattr(properties, "ReceiveMaximum", 65535))))

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                       properties: Any) -> None:
        self.events.append(Event("disconnected", ok=False, reason=str(reason)))

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any,
                    properties: Any) -> None:
        # 0x10 "no matching subscribers" is a success; 0x87 not authorized is not.
        self.events.append(Event("puback", ok=not reason.is_failure, reason=str(reason),
                                 code=int(reason.value), mid=mid))

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any,
                      properties: Any) -> None:
        failed = [str(r) for r in reasons if r.is_failure]
        self.events.append(Event("suback", ok=not failed, reason=", ".join(failed), mid=mid))

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.events.append(Event("message", topic=message.topic,
                                 payload=bytes(message.payload), mid=message.mid,
                                 qos=message.qos))

    # -- driving ------------------------------------------------------------------------

    def open(self) -> None:
        """TCP (and TLS) connect and send CONNECT; blocks at most `connect_timeout_s`.
        LinkError on failure. The CONNACK comes later, as an event."""
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry_s
        try:
            rc = self.client.connect(self.address.host, self.address.port,
                                     keepalive=self.keepalive_s,
                                     clean_start=self.clean_start, properties=props)
        except Exception as exc:  # OSError, ssl.SSLError, socket.timeout, ValueError
            self.close()
            raise describe(exc) from None
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            self.close()
            raise LinkError("error", f"connect failed: {mqtt.error_string(rc)}")
        sock = self.client.socket()
        self._fd = sock.fileno() if sock is not None else None

    @property
    def fd(self) -> int | None:
        """The socket's descriptor while it is open."""
        return self._fd if self.client.socket() is not None else None

    def want_write(self) -> bool:
        return self.client.want_write()

    def pump(self, readable: bool, writable: bool) -> bool:
        """Reads, writes and keeps alive; True while the socket is open. Callbacks fire in
        here (and append to `events`)."""
        client = self.client
        if readable or _tls_pending(client):
            client.loop_read()
            # TLS may hold decrypted bytes the socket no longer signals: drain them now.
            while client.socket() is not None and _tls_pending(client):
                client.loop_read()
        if client.socket() is not None and (writable or client.want_write()):
            client.loop_write()
        if client.socket() is not None:
            client.loop_misc()  # PINGREQ on time; closes a connection whose PINGRESP is late
        return client.socket() is not None

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> int | None:
        """QoS 1; the message id, or None if the connection is gone."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return None
        return int(info.mid)

    def subscribe(self, filters: list[str]) -> None:
        # Retained messages on a command topic are never commands for us: a retained
        # command would come back at every connect and be refused every time.
        opts = SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND)
        self.client.subscribe([(f, opts) for f in filters])

    def ack(self, mid: int, qos: int) -> None:
        if qos > 0 and self.client.socket() is not None:
            self.client.ack(mid, qos)

    def disconnect(self) -> None:
        """A clean DISCONNECT (no Will): sent at once, then the socket closes."""
        if self.client.socket() is None:
            return
        self.client.disconnect()
        deadline = time.monotonic() + 1.0
        while (self.client.socket() is not None and self.client.want_write()
               and time.monotonic() < deadline):
            self.client.loop_write()
        self.close()

    def close(self) -> None:
        """Drops the socket without a DISCONNECT (the broker then sends the Will)."""
        try:
            # paho has no public way to drop a socket without a DISCONNECT packet.
            self.client._sock_close()
        except Exception:  # closing is best effort: the socket may be half-gone
            pass
        self._fd = None


def _tls_pending(client: mqtt.Client) -> bool:
    sock = client.socket()
    pending = getattr(sock, "pending", None)
    return bool(pending and pending() > 0)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    kind: str  # "ok" or a LinkError kind
    detail: str
    elapsed_s: float


def probe(fleet: FleetSettings, timeout_s: float = 5.0) -> ProbeResult:
    """One MQTT CONNECT with the configured credentials and TLS, then a clean disconnect:
    what the doctor reports. Its own client id (never the device's: connecting as the
    device would throw the running agent off the broker) and no Will."""
    start = time.monotonic()
    client_id = f"{fleet.device_id or 'edge'}-doctor-{os.urandom(3).hex()}"

    def result(ok: bool, kind: str, detail: str) -> ProbeResult:
        return ProbeResult(ok, kind, detail, time.monotonic() - start)

    try:
        session = Session(fleet, client_id=client_id, will=None,
                          keepalive_s=max(5, int(timeout_s) + 5), window=1,
                          connect_timeout_s=timeout_s, session_expiry_s=0, clean_start=True)
        session.open()
    except LinkError as exc:
        return result(False, exc.kind, exc.message)
    with selectors.DefaultSelector() as sel:
        fd = session.fd
        if fd is None:
            return result(False, "error", "the connection closed at once")
        sel.register(fd, selectors.EVENT_READ)
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            events = sel.select(max(0.0, min(0.2, deadline - time.monotonic())))
            alive = session.pump(bool(events), False)
            while session.events:
                event = session.events.popleft()
                if event.kind == "connack":
                    if event.ok:
                        session.disconnect()
                        return result(True, "ok", "connected (MQTT 5)")
                    session.close()
                    err = connack_error(event.reason, event.code)
                    return result(False, err.kind, err.message)
            if not alive:
                return result(False, "rejected", "the broker closed the connection "
                                                 "before answering")
        session.close()
    return result(False, "timeout", f"no answer to CONNECT within {timeout_s:g} s")
