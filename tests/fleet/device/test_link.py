"""The fleet link against a real Mosquitto and the real controller (its ingest and a SQLite
store), in this process: birth and death with bdseq, the outbox through a broker outage
and a controller restart, signed commands end to end, a broker that is not there."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.config import Settings, TenantPolicy
from edge_agent.doctor import _fleet
from edge_agent.fleet.device.link.birth import config_fingerprint, facts_source
from edge_agent.fleet.device.link.handlers import box_handlers
from edge_agent.fleet.device.link.link import Link
from edge_agent.fleet.device.link.overlay import OVERLAY_FILE, copy_keys
from edge_agent.fleet.device.link.session import probe
from edge_agent.fleet.device.link.state import FleetState
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.signing import sign
from tests.support.brokers import FLEET, Mosquitto, MQTTClient, free_port
from tests.support.fleetkit import (
    Controller,
    Signer,
    fast_options,
    fleet_settings,
    send,
    statuses,
    wait_until,
)

pytestmark = pytest.mark.broker
DEV = "store-x"


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV, "store-y")).start()


@pytest.fixture
def controller(broker: Mosquitto, tmp_path: Path) -> Iterator[Controller]:
    ctl = Controller(broker, tmp_path / "controller").start()
    yield ctl
    ctl.close()


@pytest.fixture
def watcher(broker: Mosquitto) -> Iterator[MQTTClient]:
    """A subscriber on every status topic (as the controller user)."""
    client = MQTTClient(broker, "controller")
    assert not client.connect().is_failure
    client.subscribe(f"edge/v1/{FLEET}/+/status")
    yield client
    client.close()


@pytest.fixture
def links() -> Iterator[Callable[..., Link]]:
    made: list[Link] = []

    def make(broker: Mosquitto, state: Path, **kwargs: Any) -> Link:
        fleet = kwargs.pop("fleet", None) or fleet_settings(broker, DEV)
        kwargs.setdefault("facts", lambda: {"agent_version": "test"})
        kwargs.setdefault("options", fast_options())
        link = Link(fleet, state, **kwargs)
        made.append(link)
        link.start()
        return link

    yield make
    for link in made:
        link.stop()


def produce(link: Link, count: int, rate: float) -> threading.Thread:
    """Emits `count` metrics messages at `rate` per second on a thread of its own."""

    def run() -> None:
        start = time.monotonic()
        for i in range(count):
            assert link.emit("metrics", "metrics", {"i": i, "pad": "x" * 100})
            delay = start + (i + 1) / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def drained(link: Link) -> bool:
    stats = link.outbox_stats()
    return stats is not None and stats.depth == 0 and stats.buffered == 0


def assert_all_stored_once(ctl: Controller, link: Link, at_least: int) -> None:
    """Every seq of the link's boot is in the store once, none missing, none dropped."""
    stored = ctl.stored(DEV)[link.boot_id]
    assert len(stored) == 1 and stored[0][0] == 1 and stored[0][1] >= at_least, stored
    assert ctl.gaps(DEV) == {}
    assert ctl.count(DEV) == sum(b - a + 1 for ranges in ctl.stored(DEV).values()
                                 for a, b in ranges)


def test_the_birth_is_retained_and_a_clean_stop_publishes_the_death_of_its_bdseq(
        broker: Mosquitto, controller: Controller, watcher: MQTTClient,
        links: Callable[..., Link], tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state", tenants={"shop": TenantPolicy()})
    facts = facts_source(lambda: settings)
    first = links(broker, tmp_path / "state", facts=facts)
    assert first.wait_connected(10)
    assert wait_until(lambda: statuses(watcher, DEV), 5)
    birth = statuses(watcher, DEV)[0]
    n = birth["bdseq"]
    assert birth["type"] == "birth" and birth["device"] == DEV and birth["fleet"] == FLEET
    assert birth["boot_id"] == first.boot_id and n == first.bdseq >= 1
    assert birth["llama_cpp_version"] and birth["agent_version"]
    assert birth["hardware"]["cpu_count"] >= 1 and birth["hardware"]["ram_bytes"] > 0
    assert birth["tenants"] == ["shop"] and birth["models"] == []
    assert birth["config_fingerprint"] == config_fingerprint(settings)
    assert wait_until(lambda: (controller.store.device(DEV) or {}).get("online"), 5)

    first.stop()
    assert wait_until(lambda: len(statuses(watcher, DEV)) == 2, 5)
    death = statuses(watcher, DEV)[1]
    assert death["type"] == "death" and death["bdseq"] == n
    assert wait_until(lambda: not controller.store.device(DEV)["online"], 5)
    late = MQTTClient(broker, "controller")  # what a subscriber arriving now is given
    late.connect()
    late.subscribe(f"edge/v1/{FLEET}/{DEV}/status")
    assert late.wait(lambda: bool(late.messages), 5)
    assert late.messages[0][2] and json.loads(late.messages[0][1])["type"] == "death"
    late.close()

    second = links(broker, tmp_path / "state", facts=facts)
    assert second.wait_connected(10)
    assert wait_until(lambda: len(statuses(watcher, DEV)) == 3, 5)
    again = statuses(watcher, DEV)[2]
    assert again["type"] == "birth" and again["bdseq"] == n + 1
    assert again["boot_id"] == second.boot_id != first.boot_id


def test_the_outbox_delivers_everything_once_through_a_broker_outage(
        broker: Mosquitto, controller: Controller, links: Callable[..., Link],
        tmp_path: Path) -> None:
    """1,200 messages at 100/s; the broker is killed (SIGKILL) after 2 s and comes back on
    the same port and data 10 s later, so about 1,000 of them are produced while it is away
    and wait in the outbox on disk."""
    link = links(broker, tmp_path / "state")
    assert link.wait_connected(10)
    producer = produce(link, 1200, 100)
    time.sleep(2)
    broker.kill()
    assert wait_until(lambda: not link.connected, 5)
    time.sleep(10)
    broker.start()
    producer.join(30)
    assert wait_until(lambda: drained(link), 60), (link.outbox_stats(), link.counts)
    assert_all_stored_once(controller, link, 1200)
    assert controller.count(DEV, "metrics") == 1200
    events = [m["body"]["event"] for m in controller.store.messages(DEV, kind="events")]
    assert "link.disconnected" in events and events.count("link.connected") >= 2


def test_a_controller_restart_loses_nothing(
        broker: Mosquitto, controller: Controller, links: Callable[..., Link],
        tmp_path: Path) -> None:
    link = links(broker, tmp_path / "state")
    assert link.wait_connected(10)
    producer = produce(link, 500, 100)
    time.sleep(1.5)
    controller.stop()  # its session stays at the broker, queueing what the box sends
    time.sleep(2)
    controller.start()
    producer.join(30)
    assert wait_until(lambda: drained(link), 30), (link.outbox_stats(), link.counts)
    assert_all_stored_once(controller, link, 500)
    assert controller.count(DEV, "metrics") == 500


def test_many_producers_at_once_lose_nothing(
        broker: Mosquitto, controller: Controller, links: Callable[..., Link],
        tmp_path: Path) -> None:
    link = links(broker, tmp_path / "state")
    threads = [produce(link, 500, 10_000) for _ in range(4)]
    for thread in threads:
        thread.join(30)
    assert wait_until(lambda: drained(link), 30), (link.outbox_stats(), link.counts)
    assert_all_stored_once(controller, link, 2000)
    assert controller.count(DEV, "metrics") == 2000


def test_what_went_to_nobody_goes_again_once_the_controller_is_there(
        broker: Mosquitto, links: Callable[..., Link], tmp_path: Path) -> None:
    """A controller that never connected has no session at the broker: the broker takes
    the messages (PUBACK "no matching subscribers") and drops them. The first ack from the
    controller, once it is there, makes the link send them all again, long before they
    would be overdue."""
    link = links(broker, tmp_path / "state", options=fast_options(ack_timeout_s=300))
    assert link.wait_connected(10)
    for i in range(100):
        link.emit("metrics", "metrics", {"i": i})
    assert wait_until(lambda: link.counts.get("published", 0) >= 101, 5)
    ctl = Controller(broker, tmp_path / "controller").start()
    try:
        link.emit("metrics", "metrics", {"i": 100})
        assert wait_until(lambda: drained(link), 10), (link.outbox_stats(), link.counts)
        assert_all_stored_once(ctl, link, 102)
    finally:
        ctl.close()


def test_a_message_lost_with_its_controller_goes_again_though_the_box_has_nothing_more(
        broker: Mosquitto, links: Callable[..., Link], tmp_path: Path) -> None:
    """A controller that received a message and died before storing it (one of two
    controllers, killed) acknowledged the box's later one: the controller was up after the
    first was sent, so the first was lost on the way, and it goes again once overdue —
    even when the box sends nothing more, so that its last ack is older than the timeout
    by then (which once read as "the controller is away": a resend ten timeouts later)."""
    spy = MQTTClient(broker, "controller")  # subscribed, so the broker delivers; never stores
    assert not spy.connect().is_failure
    # Every topic the box publishes on: a PUBACK "no matching subscribers" would make
    # the next ack resend everything at once.
    spy.subscribe(*(f"edge/v1/{FLEET}/{DEV}/{kind}" for kind in ("metrics", "events",
                                                                 "status")))
    metrics = f"edge/v1/{FLEET}/{DEV}/metrics"
    link = links(broker, tmp_path / "state", options=fast_options(ack_timeout_s=2.0))
    try:
        assert link.wait_connected(10)
        link.emit("metrics", "metrics", {"i": 1})
        link.emit("metrics", "metrics", {"i": 2})
        assert spy.wait(lambda: len(spy.received(metrics)) == 2)
        first, second = (json.loads(payload)["seq"] for _, payload, _ in spy.received(metrics))
        depth = link.outbox_stats().depth  # type: ignore[union-attr]
        # The other controller stores and acknowledges the second only.
        spy.publish(f"edge/v1/{FLEET}/{DEV}/ack", json.dumps(
            {"v": 1, "device": DEV, "acks": {link.boot_id: [[second, second]]}}))
        assert wait_until(lambda: link.outbox_stats().depth == depth - 1,  # type: ignore[union-attr]
                          5)
        acked = time.monotonic()
        # Overdue 2 s after it was sent; checked every 0.5 s: well before ten timeouts.
        assert spy.wait(lambda: len(spy.received(metrics)) == 3, timeout=8), link.counts
        assert time.monotonic() - acked < 5
        again = json.loads(spy.received(metrics)[-1][1])
        assert (again["seq"], again["body"]["i"]) == (first, 1)
        assert link.counts.get("resent", 0) >= 1
    finally:
        spy.close()


def test_a_command_stored_but_never_run_runs_at_the_next_start(
        broker: Mosquitto, controller: Controller, links: Callable[..., Link],
        tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    state = tmp_path / "state"
    command = signer.command(DEV, "ping")
    stored = FleetState(state / "fleet.db")  # what a kill -9 after the PUBACK leaves
    assert stored.accept(command["id"], DEV, command["seq"], "ping",
                         json.dumps(command).encode())
    stored.close()
    links(broker, state,
          fleet=fleet_settings(broker, DEV, command_public_key_file=signer.public_path))
    assert wait_until(lambda: controller.store.command_results(command["id"]), 10)
    assert controller.store.command_results(command["id"])[0]["status"] == "ok"


def test_signed_commands_run_once_and_their_results_reach_the_controller(
        broker: Mosquitto, controller: Controller, watcher: MQTTClient,
        links: Callable[..., Link], tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    runs: list[str] = []

    def count(command: Command) -> dict[str, Any]:
        runs.append(command.id)
        return {"runs": len(runs)}

    state = tmp_path / "state"
    settings = Settings(state_dir=state, tenants={"shop": TenantPolicy()})
    applied: list[str] = []

    def apply_live(new: Settings, changes: dict[str, Any]) -> list[str]:
        applied.extend(changes)
        return copy_keys(settings, new, changes)

    handlers = {**box_handlers(settings, state, purge=lambda before: 7,
                               revoke=lambda prefix: prefix == "abcd1234",
                               apply_live=apply_live), "count": count}
    link = links(broker, state, handlers=handlers, facts=facts_source(lambda: settings),
                 fleet=fleet_settings(broker, DEV, command_public_key_file=signer.public_path))
    assert link.wait_connected(10)
    boss = MQTTClient(broker, "controller")
    boss.connect()

    def result(command: dict[str, Any]) -> dict[str, Any] | None:
        found = controller.store.command_results(command["id"])
        return found[0] if found else None

    ping = signer.command(DEV, "ping")
    send(boss, ping)
    assert wait_until(lambda: result(ping), 10), link.counts
    assert result(ping)["status"] == "ok" and result(ping)["result"]["pong"] is True

    once = signer.command(DEV, "count")
    payload = send(boss, once)
    boss.publish(f"edge/v1/{FLEET}/{DEV}/cmd", payload)  # delivered twice
    assert wait_until(lambda: result(once), 10)
    assert wait_until(lambda: link.counts.get("commands", 0) >= 3, 5)
    time.sleep(0.3)
    assert runs == [once["id"]] and result(once)["result"] == {"runs": 1}

    forged = {**signer.command(DEV, "count"), "args": {"x": 1}}  # changed after signing
    send(boss, forged)
    assert wait_until(lambda: result(forged), 10)
    assert result(forged)["status"] == "refused"
    assert result(forged)["reason"] == "bad_signature"
    assert runs == [once["id"]]

    births = len(statuses(watcher, DEV))
    patch = signer.command(DEV, "config.patch", {"set": {
        "telemetry.interval_s": 11, "tenants.shop.requests_per_minute": 5}})
    send(boss, patch)
    assert wait_until(lambda: result(patch), 10)
    assert result(patch)["status"] == "ok", result(patch)
    assert result(patch)["result"]["live"] == ["telemetry.interval_s",
                                               "tenants.shop.requests_per_minute"]
    assert settings.telemetry.interval_s == 11 and settings.tenants["shop"].requests_per_minute == 5
    saved = json.loads((state / OVERLAY_FILE).read_text())
    assert saved["set"] == {"telemetry.interval_s": 11, "tenants.shop.requests_per_minute": 5}
    # The birth goes again with the new fingerprint (same session, same bdseq).
    assert wait_until(lambda: len(statuses(watcher, DEV)) > births, 5)
    reborn = statuses(watcher, DEV)[-1]
    assert reborn["config_fingerprint"] == config_fingerprint(settings)
    assert reborn["bdseq"] == link.bdseq

    bad_patch = signer.command(DEV, "config.patch", {"set": {"fleet.broker": "mqtt://x"}})
    send(boss, bad_patch)
    assert wait_until(lambda: result(bad_patch), 10)
    assert result(bad_patch)["status"] == "refused" and result(bad_patch)["reason"] == "malformed"

    purge = signer.command(DEV, "ledger.purge", {"before": time.time() - 86400})
    revoke = signer.command(DEV, "keys.revoke", {"prefix": "abcd1234"})
    rebirth = signer.command(DEV, "rebirth")
    for command in (purge, revoke, rebirth):
        send(boss, command)
    assert wait_until(lambda: all(result(c) for c in (purge, revoke, rebirth)), 10)
    assert result(purge)["result"]["removed"] == 7
    assert result(revoke)["result"] == {"prefix": "abcd1234", "revoked": True}
    assert result(rebirth)["status"] == "ok"
    assert wait_until(lambda: len(statuses(watcher, DEV)) > births + 1, 5)
    boss.close()


def test_with_the_broker_away_the_link_keeps_everything_and_stops_at_once(
        tmp_path: Path, mosquitto_factory: Callable[..., Mosquitto],
        links: Callable[..., Link]) -> None:
    broker = mosquitto_factory(devices=(DEV,))  # configured, never started
    link = links(broker, tmp_path / "state")
    for i in range(50):
        assert link.emit("metrics", "metrics", {"i": i})
    assert wait_until(lambda: link.counts.get("connect_failures", 0) >= 2, 5)
    assert wait_until(lambda: (link.outbox_stats() or (0, 0, 0, 1)).buffered == 0, 5)
    assert link.outbox_stats().depth == 50 and not link.connected
    started = time.monotonic()
    link.stop()
    assert time.monotonic() - started < 3
    found = probe(fleet_settings(broker, DEV), timeout_s=2)
    assert not found.ok and found.kind == "refused"


def test_doctor_reports_the_link_disabled_as_information_and_a_refused_login_as_a_failure(
        broker: Mosquitto, tmp_path: Path) -> None:
    assert [c.status for c in _fleet(Settings(state_dir=tmp_path))] == ["info"]
    good = Settings(state_dir=tmp_path, fleet=fleet_settings(broker, DEV))
    checks = {c.name: c for c in _fleet(good)}
    assert checks["fleet broker"].status == "ok" and "connected" in checks["fleet broker"].detail
    assert checks["fleet commands"].status == "warn"  # no command key: all refused
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("nope\n")
    bad = Settings(state_dir=tmp_path, fleet=fleet_settings(broker, DEV, password_file=wrong))
    check = {c.name: c for c in _fleet(bad)}["fleet broker"]
    assert check.status == "fail" and "refused the login" in check.detail
    assert "password_file" in check.fix
    gone = Settings(state_dir=tmp_path, fleet=fleet_settings(
        broker, DEV, password_file=tmp_path / "missing.txt"))
    files = {c.name: c for c in _fleet(gone)}["fleet files"]
    assert files.status == "fail" and "missing.txt" in files.detail


def test_credentials_and_tls_are_reported_by_kind(
        tmp_path: Path, mosquitto_factory: Callable[..., Mosquitto],
        links: Callable[..., Link]) -> None:
    broker = mosquitto_factory(devices=(DEV,), tls=True).start()
    fleet = fleet_settings(broker, DEV, tls=True)
    assert probe(fleet).ok
    link = links(broker, tmp_path / "state", fleet=fleet)
    assert link.wait_connected(10)  # over TLS, the CA made in the test
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not-the-password\n")
    assert probe(fleet_settings(broker, DEV, password_file=wrong)).kind == "not_authorized"
    untrusted = probe(fleet_settings(broker, DEV, tls=True, ca_file=None))
    assert untrusted.kind == "tls" and "certificate" in untrusted.detail
    nobody = probe(fleet_settings(broker, DEV).model_copy(
        update={"broker": f"mqtt://127.0.0.1:{free_port()}"}))
    assert nobody.kind == "refused"
    refused = links(broker, tmp_path / "other", fleet=fleet_settings(
        broker, DEV, password_file=wrong))
    assert wait_until(lambda: refused.counts.get("connect_failures", 0) >= 2, 5)
    assert not refused.connected and refused.counts.get("connects", 0) == 0


def test_a_forged_ack_deletes_nothing_even_where_the_acl_lets_it_through(
        mosquitto_factory: Callable[..., Mosquitto], links: Callable[..., Link],
        tmp_path: Path) -> None:
    """A second client logged in with the box's own credentials, on a broker whose ACL was
    opened on purpose (the device's whole tree read-write, as before), publishes acks
    covering every seq: unsigned, signed by another key, and signed by the controller's
    key for another device. The box deletes none of its undelivered rows (audit ones
    included); the real controller's signed acks then drain them, every row stored once."""
    broker = mosquitto_factory(devices=(DEV, "store-y"))
    opened = broker.files.acl.read_text().replace(
        f"user {DEV}\n", f"user {DEV}\ntopic readwrite edge/v1/{FLEET}/{DEV}/#\n", 1)
    broker.files.acl.write_text(opened)
    broker.start()
    signer, other = Signer(tmp_path / "keys"), Signer(tmp_path / "other")
    link = links(broker, tmp_path / "state", options=fast_options(ack_timeout_s=300),
                 fleet=fleet_settings(broker, DEV, command_public_key_file=signer.public_path))
    assert link.wait_connected(10)
    for i in range(20):
        link.emit("events", "audit", {"event": "test", "i": i})
        link.emit("metrics", "metrics", {"i": i})
    assert wait_until(lambda: link.counts.get("published", 0) >= 41, 10), link.counts
    depth = link.outbox_stats().depth  # type: ignore[union-attr]
    assert depth >= 41

    forger = MQTTClient(broker, DEV, client_id="forger")
    assert not forger.connect().is_failure
    everything = {link.boot_id: [[1, 10**6]]}
    forged = [json.dumps({"v": 1, "acks": everything}).encode(),
              json.dumps({"v": 1, "device": DEV, "acks": everything}).encode(),
              json.dumps(sign({"v": 1, "device": DEV, "acks": everything}, other.key)).encode(),
              json.dumps(sign({"v": 1, "device": "store-y", "acks": everything},
                              signer.key)).encode()]
    for payload in forged:
        assert forger.publish(f"edge/v1/{FLEET}/{DEV}/ack", payload) in (0, 16)
    assert wait_until(lambda: link.counts.get("refused_acks", 0) >= len(forged), 10), link.counts
    assert link.outbox_stats().depth == depth  # type: ignore[union-attr]
    forger.close()

    ctl = Controller(broker, tmp_path / "controller", key=signer.key).start()
    try:
        link.emit("metrics", "metrics", {"i": 20})
        assert wait_until(lambda: drained(link), 15), (link.outbox_stats(), link.counts)
        assert_all_stored_once(ctl, link, depth + 1)
        mine = [m["body"]["i"] for m in ctl.store.messages(DEV, kind="events", limit=1000)
                if m["body"].get("event") == "test"]
        assert sorted(mine) == list(range(20))  # every audit row, once
    finally:
        ctl.close()


def test_a_durable_emit_at_start_waits_for_the_outbox_instead_of_failing(
        broker: Mosquitto, controller: Controller, links: Callable[..., Link],
        tmp_path: Path) -> None:
    """The first start's events tick emits with commit=True before the link's thread has
    opened the outbox: it waits for it (bounded) and is stored, not refused (which logged
    an ERROR 'the events tick failed' on every first start)."""
    link = links(broker, tmp_path / "state")
    assert link.emit("events", "audit", {"event": "box.ready"}, commit=True)
    assert "emit_refused" not in link.counts
    assert wait_until(lambda: controller.count(DEV, "events") >= 1, 10)
