"""The controller's MQTT session: every device's messages into the store, then acks.

paho v2 (MQTT 5) with `clean_start=False` and a session expiry, so the broker keeps the
controller's queue while it restarts; `manual_ack=True`, so a message is acknowledged to
the broker (PUBACK) only after the batch holding it has committed — a controller that dies
mid-batch gets the message again from its session, not never. paho's callbacks only parse
and enqueue: the store is written by one writer thread, in batches (`ingest.batch_max`
messages or `ingest.batch_wait_s`), never inside a callback (they run under paho's lock).
After each commit the writer publishes each device's ack (`{"v":1,"device":…,"acks":{…},
"sig":…}` on its `ack` topic, signed with the command key when the controller has one): the
only thing that lets the device delete its outbox rows.

Dropped and counted, never stored: topics that do not parse (bad ids included), payloads
that are not strict JSON, envelopes or status messages missing what the protocol says.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge_agent.config.controller import ControllerSettings
from edge_agent.fleet.controller.inbound import Acks, Inbound
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.paho_thread import disconnect_and_stop
from edge_agent.fleet.controller.store import ControllerStore, StoreConflict
from edge_agent.fleet.protocol import envelope, topics
from edge_agent.fleet.protocol.envelope import MAX_SEQ
from edge_agent.fleet.protocol.ids import BOOT_ID

log = logging.getLogger(__name__)
MAX_TS = 1e11  # seconds since 1970: about the year 5138; a float SQLite stores as REAL

CLASSES = frozenset({"audit", "metrics"})
_RETRY_MAX_S = 5.0


class Rejected(ValueError):
    """A message the controller drops; `reason` is its metrics label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _strict_json_object(payload: bytes) -> dict[str, Any]:
    """UTF-8 JSON, one object, no NaN/Infinity, no duplicate keys, within the envelope's
    size limit (the same strict reader the box writes with)."""
    try:
        value = envelope.loads(payload, envelope.MAX_BYTES)
    except ValueError as exc:
        raise Rejected("json", f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Rejected("json", "not a JSON object")
    return value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def inbound(topic: topics.Topic, payload: bytes, received: float) -> Inbound:
    """An outbox envelope checked against its topic; Rejected for anything off-protocol."""
    env = _strict_json_object(payload)
    problems = []
    if env.get("v") != 1:
        problems.append("v must be 1")
    if env.get("device") != topic.device:
        problems.append("device differs from the topic's")
    if env.get("kind") != topic.kind:
        problems.append("kind differs from the topic's")
    if not isinstance(env.get("boot_id"), str) or not BOOT_ID.fullmatch(env["boot_id"]):
        problems.append("bad boot_id")
    if not _int(env.get("seq")) or not 1 <= env["seq"] <= MAX_SEQ:
        problems.append("seq must be an integer from 1 to 2**63-1")
    if env.get("class") not in CLASSES:
        problems.append("class must be audit or metrics")
    ts = env.get("ts")
    # A comparison, not math.isfinite: that raises OverflowError on an int like 10**400
    # (inside paho's callback), and NaN fails a comparison as it should.
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not abs(ts) < MAX_TS:
        problems.append("bad ts")
    if not isinstance(env.get("body"), dict):
        problems.append("body must be an object")
    if problems:
        raise Rejected("envelope", "; ".join(problems))
    return Inbound(topic.fleet, topic.device, topic.kind, env["boot_id"], env["seq"],
                   env["class"], float(ts), env["body"], received)  # type: ignore[arg-type]


def status(topic: topics.Topic, payload: bytes) -> dict[str, Any]:
    """A birth or death checked against its topic; Rejected otherwise."""
    if not payload:
        raise Rejected("status", "empty status (a retained message cleared)")
    msg = _strict_json_object(payload)
    if (msg.get("v") != 1 or msg.get("type") not in ("birth", "death")
            or msg.get("device") != topic.device or msg.get("fleet") != topic.fleet
            or not _int(msg.get("bdseq")) or not 0 <= msg["bdseq"] <= MAX_SEQ
            or not isinstance(msg.get("boot_id", ""), str)):
        raise Rejected("status", "a status needs v 1, type birth|death, the topic's device "
                       "and fleet, and an integer bdseq")
    return msg


@dataclass(frozen=True)
class _Item:
    mid: int
    qos: int
    generation: int  # the connection it came on: a PUBACK is valid only on that one
    received: float
    envelope: Inbound | None = None
    topic: topics.Topic | None = None
    status: dict[str, Any] | None = None


class Ingest:
    """Start with `start()`; `stop()` commits what it holds and disconnects."""

    def __init__(self, settings: ControllerSettings, store: ControllerStore,
                 metrics: ControllerMetrics, *, key: Ed25519PrivateKey | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._key = key  # signs the acks: a box holding its public half trusts no other
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._connected = threading.Event()
        self._generation = 0
        self._writer: threading.Thread | None = None
        self._stopping = threading.Event()
        self.client = self._client()

    # -- the MQTT session (paho's thread) ---------------------------------------------------

    def _client(self) -> mqtt.Client:
        b = self._settings.broker
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=b.client_id,
                             protocol=mqtt.MQTTv5, manual_ack=True)
        if b.username is not None:
            client.username_pw_set(b.username, self._settings.broker_password())
        if b.address.tls:
            client.tls_set(ca_certs=str(b.ca_file) if b.ca_file else None,
                           certfile=str(b.client_cert) if b.client_cert else None,
                           keyfile=str(b.client_key) if b.client_key else None)
        client.reconnect_delay_set(1, 30)
        client.max_inflight_messages_set(1000)  # acks out: no need to trickle them
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_connect_fail = self._on_connect_fail
        return client

    def start(self) -> None:
        b = self._settings.broker
        props = Properties(PacketTypes.CONNECT)
        # Beside other controllers, the session ends with the connection: the broker would
        # go on giving a dead member its share of the reports, held for nobody. What it held
        # when it died its boxes send again (unacknowledged after their ack timeout), to
        # the living.
        props.SessionExpiryInterval = 0 if b.shared_group is not None else b.session_expiry_s
        props.ReceiveMaximum = b.receive_maximum
        self._writer = threading.Thread(target=self._write_loop, name="fleet-ingest",
                                        daemon=True)
        self._writer.start()
        # connect_async: the loop keeps trying, so `fleet serve` starts with the broker down.
        self.client.connect_async(b.address.host, b.address.port, keepalive=b.keepalive_s,
                                  clean_start=False, properties=props)
        self.client.loop_start()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        if reason.is_failure:
            log.warning("fleet: the broker refused the controller: %s", reason)
            return
        self._generation += 1
        log.info("fleet: connected to the broker (session %s)",
                 "resumed" if flags.session_present else "new")
        # noLocal: our own acks and commands do not come back to us. Retained statuses only
        # for a new subscription: a resumed session already queued every change for us.
        group = self._settings.broker.shared_group
        if group is None:
            client.subscribe(topics.CONTROLLER_FILTER, options=SubscribeOptions(
                qos=1, noLocal=True, retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB))
            return
        # Beside other controllers: each report to one of the group (MQTT 5 shared
        # subscription), a filter per kind a box reports: noLocal is not allowed there, so
        # one filter for everything would bring every controller's acks and commands back
        # through the broker, as many messages again as the reports. Every birth and death
        # to each (a shared subscription gets no retained message; a status stored twice is
        # stored the same).
        client.subscribe([
            *((f"$share/{group}/{topics.PREFIX}/+/+/{kind}", SubscribeOptions(qos=1))
              for kind in sorted(topics.OUTBOX_KINDS)),
            (topics.STATUS_FILTER, SubscribeOptions(
                qos=1, noLocal=True, retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB))])

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any,
                      properties: Any) -> None:
        # Connected means subscribed: a message published before the SUBACK of a first
        # session would not reach us (a resumed session queued it anyway).
        if any(reason.is_failure for reason in reasons):
            log.error("fleet: the broker refused the subscription to %s: %s (is this user "
                      "the controller in the ACL?)", topics.CONTROLLER_FILTER, reasons)
            return
        self._connected.set()
        self._metrics.connected.set(1)

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        b = self._settings.broker.address
        log.warning("fleet: cannot reach the broker at %s:%s; retrying", b.host, b.port)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any,
                       properties: Any) -> None:
        self._connected.clear()
        self._metrics.connected.set(0)
        if not self._stopping.is_set():
            log.warning("fleet: lost the broker (%s); reconnecting", reason)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        received = self._clock()
        payload = bytes(message.payload)
        item = _Item(message.mid, message.qos, self._generation, received)
        try:
            topic = topics.parse(message.topic)
            if topic.kind in (topics.ACK, topics.CMD):
                self._metrics.ignored.inc()
            elif topic.kind == topics.STATUS:
                item = _Item(item.mid, item.qos, item.generation, received, topic=topic,
                             status=status(topic, payload))
            else:
                item = _Item(item.mid, item.qos, item.generation, received, topic=topic,
                             envelope=inbound(topic, payload, received))
        except Rejected as exc:
            self._metrics.rejected.labels(exc.reason).inc()
            log.debug("fleet: dropped a message on %s: %s", message.topic, exc)
        except ValueError as exc:  # topics.parse: not a link topic, or a bad id in it
            self._metrics.rejected.labels("topic").inc()
            log.debug("fleet: dropped a message on %r: %s", message.topic, exc)
        # Everything goes through the writer, in order, so PUBACKs keep the arrival order.
        self._metrics.queue.inc()
        self._queue.put(item)

    # -- the writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        cfg = self._settings.ingest
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + cfg.batch_wait_s
            done = False
            while len(batch) < cfg.batch_max:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    done = True
                    break
                batch.append(item)
            self._commit(batch)
            if done:
                return

    def _commit(self, batch: list[_Item]) -> None:
        envelopes = [i.envelope for i in batch if i.envelope is not None]
        delay, failures = 0.1, 0
        while True:
            started = time.monotonic()
            try:
                if failures >= 2 and self._store_answers():
                    # The database answers yet refuses this batch: one message at a time,
                    # so one message it cannot take does not stall every other device.
                    acks = self._one_by_one(batch)
                else:
                    acks = self._store.ingest(envelopes)
                    for item in batch:
                        if item.status is not None and item.topic is not None:
                            self._apply_status(item.topic, item.status, item.received)
                break
            except StoreConflict as exc:  # crossed another controller's batch: again, now
                self._metrics.store_conflicts.inc()
                log.warning("fleet: a batch of %d crossed another writer's; trying it again "
                            "(%s)", len(batch), exc.__cause__ or exc)
                time.sleep(random.uniform(0.0, 0.05))  # not in step with the other writer
            except Exception:  # the database is away: keep the batch, ack nothing, retry
                failures += 1
                self._metrics.store_errors.inc()
                log.exception("fleet: the store failed a batch of %d; retrying", len(batch))
                if self._stopping.is_set() and not self._connected.is_set():
                    return  # unacked: the broker gives it to us again next time
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
        self._done(batch, envelopes, acks, started)

    def _store_answers(self) -> bool:
        try:
            self._store.counts()
        except Exception:
            return False
        return True

    def _one_by_one(self, batch: list[_Item]) -> Acks:
        """Each message in its own transaction; one the store refuses while it answers is
        dropped and counted (`rejected{reason="store"}`), not acknowledged to its device."""
        total = Acks()
        for item in batch:
            try:
                if item.envelope is not None:
                    total.add(self._store.ingest([item.envelope]))
                elif item.status is not None and item.topic is not None:
                    self._apply_status(item.topic, item.status, item.received)
            except Exception:
                if not self._store_answers():
                    raise  # the database went away after all: the whole batch again
                self._metrics.rejected.labels("store").inc()
                log.exception("fleet: the store refused a message from %s; dropped",
                              item.topic.device if item.topic else "?")
        return total

    def _done(self, batch: list[_Item], envelopes: list[Inbound], acks: Acks,
              started: float) -> None:
        """After a commit: metrics, then each device's ack, then the broker's PUBACKs."""
        now = self._clock()
        m = self._metrics
        m.batches.inc()
        m.batch_seconds.observe(time.monotonic() - started)
        m.lag.set(max(0.0, now - min(i.received for i in batch)))
        m.duplicates.inc(acks.duplicates)
        for kind, count in acks.stored_by_kind.items():
            m.ingested.labels(kind).inc(count)
        for env in envelopes:
            m.age.observe(max(0.0, now - env.ts))
        fleets = {env.device: env.fleet for env in envelopes}
        for device in acks.ranges:
            self.client.publish(topics.topic(fleets[device], device, topics.ACK),
                                acks.payload(device, self._key), qos=1)
            m.acks.inc()
        for item in batch:
            # A PUBACK for a message of an earlier connection could acknowledge another
            # message that reuses its packet id now; the broker resends those anyway.
            if item.qos > 0 and item.generation == self._generation:
                self.client.ack(item.mid, item.qos)
        m.queue.dec(len(batch))

    def _apply_status(self, topic: topics.Topic, msg: dict[str, Any], received: float) -> None:
        if msg["type"] == "birth":
            self._store.birth(topic.fleet, topic.device, msg, received)
        else:
            self._store.death(topic.fleet, topic.device, msg, received)
        self._metrics.status.labels(msg["type"]).inc()

    def stop(self, timeout: float = 10.0) -> None:
        """Commit and acknowledge what was received, then disconnect."""
        self._stopping.set()
        self._queue.put(None)
        if self._writer is not None:
            self._writer.join(timeout)
        disconnect_and_stop(self.client)
        self._connected.clear()
        self._metrics.connected.set(0)
