"""The simulated fleet of `edge-agent bench fleet`: N devices of `fleet.sim.fleet` (the
agent's own link code, all in this process on one selector loop) against a private
Mosquitto and a private controller (`fleet serve`, a subprocess), one metrics message per
device per interval.

The run: provision the broker for N users (`fleet broker-config`), start it and the
controller, connect every device (at most `connect_rate` a second), one interval for every
device to send once, then a steady window (controller, broker and simulator CPU, RSS, the
controller's ingest rate against the offered rate); with `broker_restart`, the broker is
killed with SIGKILL and started again `down_s` later, and the devices keep producing
meanwhile; then production stops, the outboxes drain, and the controller's store is read:
every (device, boot, seq) from 1 to the last seq each device gave must be there — lost is
what is not —, the duplicates the controller removed are its own counter.

Must never: judge a figure by wall time in a test (the bench reports, tests only check
presence), or leave the broker or the controller running.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import psutil

from edge_agent.bench.targets import report
from edge_agent.fleet.sim.fleet import SimOptions, Simulator
from edge_agent.fleet.sim.testbed import Broker, ControllerProcess

Echo = Callable[[str], None]
FLEET = "bench"
CONNECT_RATE = 500.0  # connects a second, at most (the simulator paces a reconnect storm)


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def received(metrics: dict[str, float]) -> float:
    return (metrics.get("edge_fleet_messages_ingested_total", 0.0)
            + metrics.get("edge_fleet_messages_duplicate_total", 0.0))


def _until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


STORED = "SELECT device, boot_id, COUNT(*), MAX(seq) FROM messages GROUP BY device, boot_id"


def check_store(db: Path, expected: dict[str, tuple[str, int]]) -> dict[str, int]:
    """The controller's SQLite store against what each device gave (`tally`)."""
    conn = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True)
    try:
        rows = {(device, boot): (int(count), int(high))
                for device, boot, count, high in conn.execute(STORED)}
    finally:
        conn.close()
    return tally(rows, expected)


def tally(rows: dict[tuple[str, str], tuple[int, int]],
          expected: dict[str, tuple[str, int]]) -> dict[str, int]:
    """A store's (device, boot) -> (rows, highest seq) against what each device gave:
    `stored` rows, `lost` seqs (given, absent), `gap_devices`, `unknown` rows (a seq or
    boot no device gave). The store's key holds each seq once, so a duplicate cannot be
    a row: what the controllers removed is their counter."""
    out = {"stored": sum(c for c, _ in rows.values()), "lost": 0, "gap_devices": 0,
           "unknown": 0}
    known = set()
    for device, (boot, last) in expected.items():
        known.add((device, boot))
        count, high = rows.get((device, boot), (0, 0))
        if high > last:
            out["unknown"] += high - last
        if count < last:  # the primary key holds each seq once: fewer rows, missing seqs
            out["lost"] += last - count
            out["gap_devices"] += 1
    out["unknown"] += sum(c for key, (c, _) in rows.items() if key not in known)
    return out


def bench_simulated_fleet(root: Path, devices: int, *, interval_s: float, duration_s: float,
                          broker_restart: bool, echo: Echo, down_s: float = 5.0,
                          store: Literal["memory", "files"] = "memory") -> dict[str, Any]:
    restart = f"SIGKILL, back after {down_s:g} s" if broker_restart else "none"
    echo(f"simulated fleet: {devices:,} devices, 1 metrics message each per {interval_s:g} s, "
         f"{duration_s:g} s, broker restart: {restart}")
    ids = [f"sim-{i:05d}" for i in range(devices)]
    started = time.monotonic()
    broker = Broker(root, fleet=FLEET, devices=tuple(ids), log_types=("error", "warning"))
    broker.start()
    provision_s = time.monotonic() - started
    controller = ControllerProcess(broker, root).start()
    sim: Simulator | None = None
    out: dict[str, Any] = {"devices": devices, "interval_s": interval_s,
                           "offered_per_s": devices / interval_s, "store": store,
                           "broker_restart": broker_restart, "provision_s": provision_s}
    me = psutil.Process()
    try:
        started = time.monotonic()
        sim = Simulator(broker.url, fleet=FLEET, devices=ids, password_file=broker.password_file,
                        root=root / "sim",
                        options=SimOptions(store=store, connect_rate=CONNECT_RATE))
        out["build_s"] = time.monotonic() - started
        started = time.monotonic()
        sim.start()
        if not sim.wait_connected(60 + 2 * devices / CONNECT_RATE):
            raise RuntimeError(f"only {sim.connected()} of {devices} simulated devices "
                               f"connected (descriptors? see {root})")
        out["connect_s"] = time.monotonic() - started
        sim.produce(interval_s)
        time.sleep(interval_s)  # every device has sent once: the steady state
        window = duration_s / 2 if broker_restart else duration_s
        procs = {"controller": psutil.Process(controller.pid), "broker": psutil.Process(broker.pid),
                 "simulator": me}
        m0, c0, t0 = controller.metrics(), {k: cpu_s(p) for k, p in procs.items()}, time.monotonic()
        time.sleep(window)
        m1, c1, t1 = controller.metrics(), {k: cpu_s(p) for k, p in procs.items()}, time.monotonic()
        out["window_s"] = t1 - t0
        out["ingest_per_s"] = (received(m1) - received(m0)) / (t1 - t0)
        out["cpu_percent"] = {k: (c1[k] - c0[k]) / (t1 - t0) * 100 for k in procs}
        out["rss_mb"] = {k: p.memory_info().rss / 2**20 for k, p in procs.items()}
        out["simulator_fds"] = me.num_fds()
        if broker_restart:
            broker.kill()
            time.sleep(down_s)
            broker.start()
            back = time.monotonic()
            r0, k0 = received(controller.metrics()), cpu_s(procs["controller"])
            reconnected = sim.wait_connected(120 + 2 * devices / CONNECT_RATE)
            out["reconnect_s"] = time.monotonic() - back if reconnected else None
            _until(controller.connected, 120)
            # Production goes on two intervals at least once the controller is subscribed
            # again: what a device sent before may have found no subscriber (the broker's
            # last autosave can predate the subscription); it goes again at its next ack.
            time.sleep(max(2 * interval_s,
                           duration_s - window - down_s - (time.monotonic() - back)))
        sim.pause()
        started = time.monotonic()
        drained = sim.wait_drained(120 + devices / 50)
        out["drain_s"] = time.monotonic() - started if drained else None
        if broker_restart:
            # From the broker's return to the last ack: the reconnect storm and the resends.
            spent = time.monotonic() - back
            out["recovery"] = {
                "seconds": spent,
                "received_per_s": (received(controller.metrics()) - r0) / spent,
                "controller_cpu_percent": (cpu_s(procs["controller"]) - k0) / spent * 100}
        out["undelivered"] = sim.depth()
        expected = sim.expected()
        out["duplicates"] = int(controller.metric("edge_fleet_messages_duplicate_total"))
        out["link_counts"] = sim.counts()
    finally:
        if sim is not None:
            sim.stop()
        controller.stop()
        broker.stop()
    out.update(check_store(controller.db, expected))
    _print(echo, out)
    return out


def _print(echo: Echo, out: dict[str, Any]) -> None:
    cpu, rss = out["cpu_percent"], out["rss_mb"]
    echo(f"  broker provisioned in {out['provision_s']:.1f} s; {out['devices']:,} devices built "
         f"in {out['build_s']:.1f} s, connected in {out['connect_s']:.1f} s "
         f"({out['simulator_fds']:,} descriptors)")
    echo(f"  steady {out['window_s']:.0f} s: controller ingest {out['ingest_per_s']:,.0f} msg/s "
         f"(offered {out['offered_per_s']:,.0f}/s); CPU, % of a core: controller "
         f"{cpu['controller']:.1f}, broker {cpu['broker']:.1f}, simulator {cpu['simulator']:.1f}")
    echo(f"  RSS: controller {rss['controller']:.0f} MB, broker {rss['broker']:.0f} MB, "
         f"simulator {rss['simulator']:.0f} MB")
    if out["broker_restart"]:
        again = out.get("reconnect_s")
        echo("  after the restart: " + (f"every device back in {again:.1f} s" if again is not None
                                        else "NOT every device reconnected"))
        rec = out.get("recovery")
        if rec is not None:
            echo(f"  from the restart to the last ack ({rec['seconds']:.0f} s): controller "
                 f"received {rec['received_per_s']:,.0f} msg/s at "
                 f"{rec['controller_cpu_percent']:.1f}% of a core")
    echo(drain_line(out))
    report(echo, "fleet.lost", out["lost"], devices=out["devices"],
           restart="yes" if out["broker_restart"] else "no")


def drain_line(out: dict[str, Any]) -> str:
    """How the outboxes drained and what the store holds, as the report prints it."""
    drain = out.get("drain_s")
    drained = f"in {drain:.1f} s" if drain is not None else "NOT within the timeout"
    return (f"  drained {drained}; stored {out['stored']:,} messages, duplicates removed "
            f"{out['duplicates']:,}, devices with a gap {out['gap_devices']}, still in "
            f"outboxes {out['undelivered']}")
