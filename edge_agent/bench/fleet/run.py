"""`edge-agent bench fleet`: what the fleet link costs one box, and what a simulated fleet
costs the controller — on a private Mosquitto and a private controller (`fleet serve`, a
subprocess, so its CPU is its own), every ratio against a peer measured in the same run.

- outbox throughput: a real `Link` (its owner thread, its SQLite outbox) emits N messages
  as fast as it can; the figure is N over the time until the controller has acknowledged
  all of them (the outbox is empty). The peer is a plain paho publisher (no outbox, no
  acks) sending the same envelopes with the same window, timed to its last PUBACK; the
  two take turns, median of the runs;
- idle link: the same link connected with nothing to send, its threads' CPU;
- serving: TTFT of `edge-agent serve` with the link on (syncing every second) vs off, both
  servers up at once and asked in turns;
- the simulated fleet: `bench.fleet_sim`.

Targets: `targets.py` (`fleet.*`). Must never: use the box's own state dir for anything
but reading the model (the servers get state dirs of their own), or a system broker.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import psutil

from edge_agent.bench.fleet.sim import FLEET, bench_simulated_fleet
from edge_agent.bench.serving.peers import EdgeAgentPeer
from edge_agent.bench.targets import report
from edge_agent.config import FleetSettings
from edge_agent.fleet.controller.paho_thread import disconnect_and_stop
from edge_agent.fleet.device.link.link import Link, LinkOptions
from edge_agent.fleet.protocol.envelope import METRICS, build, encode
from edge_agent.fleet.sim.testbed import Broker, ControllerProcess, raise_nofile, wait_until

Echo = Callable[[str], None]
LINK, PLAIN, SERVE = "bench-link", "bench-plain", "bench-serve"
SYNC_S = 1.0  # the link-on server's metrics and ledger intervals (default 60 s)
BODY = {"models": {"smollm2:135m": {"requests": {"ok": 12}, "tokens_in": 1200,
                                    "tokens_out": 2400, "ttft_ms": {"p50": 81.5, "p95": 152.0},
                                    "tpot_ms": {"p50": 21.0, "p95": 26.5}, "queue": 0}},
        "hardware": {"cpu_percent": 12.5, "ram_used_bytes": 3 << 30}, "pad": "x" * 64}


def link_settings(broker: Broker, device: str, **change: Any) -> FleetSettings:
    return FleetSettings.model_validate({
        "enabled": True, "broker": broker.url, "fleet_id": broker.fleet, "device_id": device,
        "username": device, "password_file": broker.password_file(device),
        "reconnect_min_s": 0.2, "reconnect_max_s": 2.0, **change})



class PlainPublisher:
    """paho, MQTT 5, QoS 1, its own network thread: the reference without outbox or acks.
    At most `window` messages in flight — the link's window, or the broker's Receive
    Maximum if lower, as the link does (paho itself ignores the Receive Maximum)."""

    @classmethod
    def open(cls, broker: Broker, device: str, window: int) -> PlainPublisher:
        plain = cls(broker, device, window)
        if plain.receive_max < window:  # paho's window is fixed once connected: again
            plain.close()
            plain = cls(broker, device, plain.receive_max)
        return plain

    def __init__(self, broker: Broker, device: str, window: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.topic = f"edge/v1/{broker.fleet}/{device}/metrics"
        self.acked = self._want = 0
        self.receive_max = 65535
        self._cond = threading.Condition()
        self._connected = False
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{device}-plain",
                             protocol=mqtt.MQTTv5)
        client.username_pw_set(device, broker.password(device))
        client.max_queued_messages_set(0)
        client.max_inflight_messages_set(window)
        self.window = window
        client.on_connect = self._on_connect
        client.on_publish = self._on_publish
        client.connect("127.0.0.1", broker.port, keepalive=30)
        client.loop_start()
        self.client = client
        with self._cond:
            if not self._cond.wait_for(lambda: self._connected, 15):
                raise RuntimeError("the plain publisher did not connect")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                    properties: Any) -> None:
        with self._cond:
            self.receive_max = int(getattr(properties, "ReceiveMaximum", 65535))
            self._connected = not reason.is_failure
            self._cond.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any,
                    properties: Any) -> None:
        with self._cond:
            self.acked += 1
            if self.acked >= self._want:
                self._cond.notify_all()

    def run(self, payloads: list[bytes]) -> float:
        """Publishes every payload; messages a second, to the last PUBACK."""
        with self._cond:
            self.acked, self._want = 0, len(payloads)
        start = time.perf_counter()
        for payload in payloads:
            self.client.publish(self.topic, payload, qos=1)
        with self._cond:
            if not self._cond.wait_for(lambda: self.acked >= self._want, 300):
                raise RuntimeError(f"plain publisher: {self.acked} of {self._want} PUBACKs")
        return len(payloads) / (time.perf_counter() - start)

    def close(self) -> None:
        disconnect_and_stop(self.client)


def _ingested(controller: ControllerProcess) -> float:
    m = controller.metrics()
    return (m.get("edge_fleet_messages_ingested_total", 0.0)
            + m.get("edge_fleet_messages_duplicate_total", 0.0))


def bench_outbox(broker: Broker, controller: ControllerProcess, root: Path, *,
                 messages: int, runs: int, idle_s: float, echo: Echo) -> dict[str, Any]:
    echo(f"fleet link: outbox throughput ({messages:,} messages, controller acks) and idle")
    link = Link(link_settings(broker, LINK), root / "link-state",
                facts=lambda: {"agent_version": "bench"}, options=LinkOptions())
    plain = PlainPublisher.open(broker, PLAIN, LinkOptions().window)
    try:
        link.start()
        if not link.wait_connected(30):
            raise RuntimeError("the bench link did not connect")
        window = plain.window
        rates: dict[str, list[float]] = {"plain": [], "link": [], "controller": []}
        for r in range(runs):
            boot = uuid.uuid4().hex
            payloads = [encode(build(PLAIN, boot, i + 1, "metrics", METRICS, BODY, time.time()))
                        for i in range(messages)]
            target = _ingested(controller) + messages
            start = time.perf_counter()
            rates["plain"].append(plain.run(payloads))
            # The controller takes in the plain run's backlog before the link's run starts;
            # how fast it does is the ceiling of any end-to-end figure on this machine.
            if wait_until(lambda: _ingested(controller) >= target, 300, 0.02):  # noqa: B023
                rates["controller"].append(messages / (time.perf_counter() - start))
            start = time.perf_counter()
            for _ in range(messages):
                link.emit("metrics", METRICS, BODY)

            def empty() -> bool:
                stats = link.outbox_stats()
                return stats is not None and stats.depth == 0 and stats.buffered == 0
            if not wait_until(empty, 300, 0.01):
                raise RuntimeError("the link's outbox did not drain in 300 s")
            rates["link"].append(messages / (time.perf_counter() - start))
            ceiling = rates["controller"][-1] if rates["controller"] else float("nan")
            echo(f"  run {r + 1}: plain paho {rates['plain'][-1]:,.0f} msg/s (the controller "
                 f"stored them at {ceiling:,.0f}/s); link {rates['link'][-1]:,.0f} msg/s "
                 f"(window {window})")
        link_rate = statistics.median(rates["link"])
        plain_rate = statistics.median(rates["plain"])
        report(echo, "fleet.outbox_msgs_per_s", link_rate, messages=messages, runs=runs)
        echo(f"  {'  vs a plain paho publisher (no outbox, no acks), same run':<62} "
             f"{link_rate / plain_rate:>7.2f}x")
        stored = statistics.median(rates["controller"]) if rates["controller"] else float("nan")
        echo(f"  {'  vs what the controller alone stores (the plain runs)':<62} "
             f"{link_rate / stored:>7.2f}x")
        idle = _idle_share(idle_s)
        report(echo, "fleet.idle_core_percent", idle, seconds=idle_s)
        return {"outbox_msgs_per_s": link_rate, "plain_msgs_per_s": plain_rate,
                "outbox_vs_plain": link_rate / plain_rate, "controller_msgs_per_s": stored,
                "outbox_vs_controller": link_rate / stored, "runs": rates, "window": window,
                "idle_core_percent": idle}
    finally:
        plain.close()
        link.stop()


def _idle_share(seconds: float) -> float:
    """The link's threads' CPU over `seconds` while it has nothing to send, % of a core
    (each thread's own CPU clock: nanoseconds, where /proc's ticks are 10 ms)."""
    names = {"fleet-link", "fleet-commands"}
    clocks = [time.pthread_getcpuclockid(t.ident) for t in threading.enumerate()
              if t.name in names and t.ident is not None]

    def cpu() -> float:
        return sum(time.clock_gettime(c) for c in clocks)
    time.sleep(1.0)  # the last acks of the throughput runs settle
    before, start = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - before) / (time.monotonic() - start) * 100


def _server_state(state_dir: Path, dest: Path) -> Path:
    """A state dir of the server's own: the model's manifests copied, its blobs linked."""
    shutil.copytree(state_dir / "manifests", dest / "manifests")
    (dest / "blobs").mkdir(parents=True)
    for blob in (state_dir / "blobs").glob("sha256-*"):
        (dest / "blobs" / blob.name).symlink_to(blob.resolve())
    return dest


def bench_serving(state_dir: Path, model: str, broker: Broker, controller: ControllerProcess,
                  root: Path, *, threads: int, context: int, requests: int,
                  echo: Echo) -> dict[str, Any]:
    echo(f"fleet link on the serving path (TTFT, {requests} requests each, in turns)")
    on = {"EDGE_AGENT_FLEET__ENABLED": "true", "EDGE_AGENT_FLEET__BROKER": broker.url,
          "EDGE_AGENT_FLEET__FLEET_ID": broker.fleet, "EDGE_AGENT_FLEET__DEVICE_ID": SERVE,
          "EDGE_AGENT_FLEET__USERNAME": SERVE,
          "EDGE_AGENT_FLEET__PASSWORD_FILE": str(broker.password_file(SERVE)),
          "EDGE_AGENT_FLEET__METRICS_INTERVAL_S": str(SYNC_S),
          "EDGE_AGENT_FLEET__LEDGER_INTERVAL_S": str(SYNC_S)}
    peers: dict[str, EdgeAgentPeer] = {}
    firsts: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for label, env in (("on", on), ("off", {})):
            peers[label] = EdgeAgentPeer(_server_state(state_dir, root / f"serve-{label}"),
                                         model, threads=threads, context=context,
                                         parallel=4, env=env)
        for peer in peers.values():
            peer.chat([{"role": "user", "content": "warm up"}], 4)
        if not wait_until(lambda: controller.device(SERVE).get("online") is True, 30, 0.2):
            raise RuntimeError("the link-on server's link did not reach the controller")
        for i in range(requests):
            # Which server goes first alternates: neither gains from the other's wake-up.
            turns = list(peers.items())
            for label, peer in turns if i % 2 == 0 else turns[::-1]:
                sample = peer.chat([{"role": "user", "content": f"Question {i} about stock?"}],
                                   8)
                firsts[label].append(sample.ttft_s)
        synced = controller.device(SERVE)
    finally:
        for peer in peers.values():
            peer.close()
    ttft = {label: statistics.median(v) for label, v in firsts.items()}
    ratio = ttft["on"] / ttft["off"]
    echo(f"  TTFT p50 with the link on {ttft['on'] * 1000:.1f} ms, off "
         f"{ttft['off'] * 1000:.1f} ms")
    report(echo, "fleet.ttft_ratio", ratio, sync_s=SYNC_S)
    return {"ttft_ratio": ratio, "ttft_on_ms": ttft["on"] * 1000,
            "ttft_off_ms": ttft["off"] * 1000, "sync_s": SYNC_S,
            "link_last_seen": synced.get("last_seen")}


def run_fleet_bench(state_dir: Path, model: str | None, *, devices: list[int],
                    interval_s: float, duration_s: float, broker_restart: bool,
                    device_store: Literal["memory", "files"], runs: int,
                    messages: int, requests: int, idle_s: float, threads: int, context: int,
                    echo: Echo) -> dict[str, Any]:
    """Every figure of `bench fleet`; `model` None skips the serving figure."""
    limit = raise_nofile()
    # Thousands of simulated devices would log each reconnect: the figures say it all.
    quiet = logging.getLogger("edge_agent.fleet")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _run(state_dir, model, devices=devices, interval_s=interval_s,
                    duration_s=duration_s, broker_restart=broker_restart,
                    device_store=device_store, runs=runs,
                    messages=messages, requests=requests, idle_s=idle_s, threads=threads,
                    context=context, limit=limit, echo=echo)
    finally:
        quiet.setLevel(level)


def _run(state_dir: Path, model: str | None, *, devices: list[int], interval_s: float,
         duration_s: float, broker_restart: bool, device_store: Literal["memory", "files"],
         runs: int, messages: int, requests: int,
         idle_s: float, threads: int, context: int, limit: int, echo: Echo
         ) -> dict[str, Any]:
    cpus = psutil.cpu_count()
    echo(f"edge-agent bench fleet: {cpus} CPUs, "
         f"{psutil.virtual_memory().total / 2**30:.0f} GiB, descriptors {limit:,}")
    result: dict[str, Any] = {"cpus": cpus, "nofile": limit}
    with tempfile.TemporaryDirectory(prefix="edge-bench-fleet-") as tmp:
        root = Path(tmp)
        broker = Broker(root / "box", fleet=FLEET, devices=(LINK, PLAIN, SERVE),
                        log_types=("error", "warning")).start()
        controller = ControllerProcess(broker, root / "box").start()
        try:
            result["outbox"] = bench_outbox(broker, controller, root, messages=messages,
                                            runs=runs, idle_s=idle_s, echo=echo)
            if model is not None:
                result["serving"] = bench_serving(state_dir, model, broker, controller, root,
                                                  threads=threads, context=context,
                                                  requests=requests, echo=echo)
        finally:
            controller.stop()
            broker.stop()
        result["fleet"] = [bench_simulated_fleet(root / f"fleet-{n}", n, interval_s=interval_s,
                                                 duration_s=duration_s,
                                                 broker_restart=broker_restart,
                                                 store=device_store, echo=echo)
                           for n in devices]
    return result
