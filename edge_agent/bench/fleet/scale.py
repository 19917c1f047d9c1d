"""The scale case of `edge-agent bench fleet-scale`: a fleet past one machine, on this one.
N simulated devices (`fleet.sim.fleet`, the agent's own link code) split over R regional
Mosquittos, each bridged to a central one (`fleet broker-config --region` / `--uplink`);
two controllers (`fleet serve`) on one private PostgreSQL, sharing the ingest through an
MQTT 5 shared subscription; the leader killed with SIGKILL halfway.

The run: PostgreSQL, the central broker, the regional ones, then the controllers (the first
leads before the second starts); every device connects to its region's broker and sends
one metrics message per interval. First window: both controllers ingest, each one's rate
and CPU is read off its own /metrics and process. Then the leader is killed: the failover
time is from the SIGKILL to the other's /healthz saying it leads; second window: the
survivor alone (its rate). Production stops, every outbox drains (what the killed
controller held unacknowledged, its devices send again once their ack timeout, 60 s as on
a box, has passed: the drain time is mostly that), and the store is read: every
(device, boot, seq) from 1 to the last seq each device gave must be there once — lost is
what is not; duplicates are what the controllers' dedupe removed (their counters).

Must never: judge a figure by wall time in a test (the bench reports, tests only check
presence), leave a broker, a controller or PostgreSQL running, or use a system one.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from edge_agent.bench.fleet.sim import (
    CONNECT_RATE,
    FLEET,
    STORED,
    cpu_s,
    drain_line,
    received,
    tally,
)
from edge_agent.bench.targets import report
from edge_agent.fleet.controller.broker import Uplink
from edge_agent.fleet.device.link.core import LinkOptions
from edge_agent.fleet.sim.fleet import SimOptions, Simulator
from edge_agent.fleet.sim.testbed import (
    Broker,
    ControllerProcess,
    Postgres,
    find_postgres_bin,
    raise_nofile,
    wait_until,
)

Echo = Callable[[str], None]
GROUP = "controllers"  # the shared subscription's group
DUPLICATES = "edge_fleet_messages_duplicate_total"


def run_fleet_scale(*, devices: int, regions: int, interval_s: float, duration_s: float,
                    runs: int, echo: Echo, ack_timeout_s: float = 60.0) -> dict[str, Any]:
    """`runs` runs of the scale case, each on fresh servers; with more than one, the
    medians of the figures that vary."""
    limit = raise_nofile()
    echo(f"edge-agent bench fleet-scale: {psutil.cpu_count()} CPUs, "
         f"{psutil.virtual_memory().total / 2**30:.0f} GiB, descriptors {limit:,}")
    # Thousands of simulated devices would log each reconnect: the figures say it all.
    quiet = logging.getLogger("edge_agent.fleet")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="edge-bench-scale-") as tmp:
            done = [bench_fleet_scale(Path(tmp) / f"run-{i + 1}", devices, regions=regions,
                                      interval_s=interval_s, duration_s=duration_s,
                                      ack_timeout_s=ack_timeout_s, echo=echo)
                    for i in range(runs)]
    finally:
        quiet.setLevel(level)
    out: dict[str, Any] = {"runs": done}
    if len(done) > 1:
        failovers = [r["failover_s"] for r in done if r["failover_s"] is not None]
        out["median"] = {
            "failover_s": statistics.median(failovers) if failovers else None,
            "ingest_per_s_per_controller": statistics.median(
                c["ingest_per_s"] for r in done for c in r["both"]["controllers"]),
            "survivor_ingest_per_s": statistics.median(
                r["survivor"]["controllers"][0]["ingest_per_s"] for r in done),
            "lost": sum(r["lost"] + r["undelivered"] for r in done)}
        m = out["median"]
        failover = f"{m['failover_s']:.2f} s" if m["failover_s"] is not None else "none"
        echo(f"median of {runs} runs: failover {failover}; ingest per controller "
             f"{m['ingest_per_s_per_controller']:,.0f} msg/s, the survivor alone "
             f"{m['survivor_ingest_per_s']:,.0f} msg/s; lost in all {m['lost']}")
    return out


def _regions(devices: int, regions: int) -> list[tuple[str, tuple[str, ...]]]:
    """(bridge user, its devices) per region, the devices dealt out in turn."""
    ids = [f"sim-{i:05d}" for i in range(devices)]
    return [(f"bridge-r{r + 1}", tuple(ids[r::regions])) for r in range(regions)]


def bench_fleet_scale(root: Path, devices: int, *, regions: int, interval_s: float,
                      duration_s: float, echo: Echo, ack_timeout_s: float = 60.0
                      ) -> dict[str, Any]:
    bindir = find_postgres_bin()
    if bindir is None:
        raise RuntimeError("the scale case needs PostgreSQL's server binaries (initdb, "
                           "pg_ctl): `make system-deps` installs them")
    echo(f"fleet past one machine: {devices:,} devices over {regions} regional brokers "
         f"bridged to a central one, 2 controllers on one PostgreSQL, 1 metrics message "
         f"per device per {interval_s:g} s, {duration_s:g} s, the leader killed halfway")
    plan = _regions(devices, regions)
    out: dict[str, Any] = {"devices": devices, "regions": regions, "interval_s": interval_s,
                           "offered_per_s": devices / interval_s, "ack_timeout_s": ack_timeout_s}
    postgres = Postgres(bindir)  # its own temp dir: as root it runs as `postgres`
    brokers: list[Broker] = []
    controllers: list[ControllerProcess] = []
    sims: list[Simulator] = []
    try:
        started = time.monotonic()
        postgres.start()
        url = postgres.create_database()
        central = Broker(root / "central", fleet=FLEET, regions=tuple(plan),
                         log_types=("error", "warning")).start()
        brokers.append(central)
        for user, ids in plan:
            brokers.append(Broker(root / user, fleet=FLEET, devices=ids,
                                  log_types=("error", "warning"), uplink=Uplink(
                                      "127.0.0.1", central.port, user,
                                      central.password(user))).start())
        out["provision_s"] = time.monotonic() - started
        for name in ("ctl-a", "ctl-b"):
            controllers.append(ControllerProcess(
                central, root / name, db=url, shared_group=GROUP,
                client_id=f"edge-fleet-{name}"))
        controllers[0].start()
        if not wait_until(controllers[0].leads, 30):
            raise RuntimeError(f"the first controller did not lead:\n{controllers[0].output()}")
        controllers[1].start()
        started = time.monotonic()
        for (_, ids), broker in zip(plan, brokers[1:], strict=True):
            sims.append(Simulator(broker.url, fleet=FLEET, devices=ids,
                                  password_file=broker.password_file,
                                  root=root / f"sim-{broker.port}",
                                  options=SimOptions(
                                      connect_rate=CONNECT_RATE / regions,
                                      link=LinkOptions(ack_timeout_s=ack_timeout_s))))
        out["build_s"] = time.monotonic() - started
        started = time.monotonic()
        for sim in sims:
            sim.start()
        for sim in sims:
            if not sim.wait_connected(60 + 2 * devices / CONNECT_RATE):
                raise RuntimeError(f"only {sim.connected()} of {len(sim.devices)} simulated "
                                   f"devices of a region connected (see {root})")
        out["connect_s"] = time.monotonic() - started
        for sim in sims:
            sim.produce(interval_s)
        time.sleep(interval_s)  # every device has sent once: the steady state
        out["both"] = _window(controllers, duration_s / 2)
        leader, survivor = controllers
        killed = time.monotonic()
        leader.kill()
        took = wait_until(survivor.leads, 60, 0.05)
        out["failover_s"] = time.monotonic() - killed if took else None
        out["survivor"] = _window([survivor], duration_s / 2)
        for sim in sims:
            sim.pause()
        started = time.monotonic()
        drained = all(sim.wait_drained(120 + devices / 50) for sim in sims)
        out["drain_s"] = time.monotonic() - started if drained else None
        out["undelivered"] = sum(sim.depth() for sim in sims)
        # The killed one's counter as it last said it, the survivor's to the end.
        out["duplicates"] = int(out["both"]["controllers"][0]["duplicates"]
                                + survivor.metric(DUPLICATES))
        out["loop_errors"] = sum(sim.counts()["loop_errors"] for sim in sims)
        expected: dict[str, tuple[str, int]] = {}
        for sim in sims:
            expected.update(sim.expected())
        out.update(tally(_stored(url), expected))
    finally:
        for sim in sims:
            sim.stop()
        for controller in controllers:
            controller.stop()
        for broker in reversed(brokers):
            broker.stop()
        postgres.remove()
    _print(echo, out)
    return out


def _window(controllers: list[ControllerProcess], seconds: float) -> dict[str, Any]:
    """Each controller's ingest rate (stored and duplicates, messages/s) and CPU (% of a
    core) over `seconds`."""
    procs = [psutil.Process(c.pid) for c in controllers]
    m0, c0 = [c.metrics() for c in controllers], [cpu_s(p) for p in procs]
    t0 = time.monotonic()
    time.sleep(seconds)
    m1, c1 = [c.metrics() for c in controllers], [cpu_s(p) for p in procs]
    t1 = time.monotonic()
    return {"seconds": t1 - t0, "controllers": [
        {"ingest_per_s": (received(after) - received(before)) / (t1 - t0),
         "cpu_percent": (k1 - k0) / (t1 - t0) * 100,
         "duplicates": after.get(DUPLICATES, 0.0)}
        for before, after, k0, k1 in zip(m0, m1, c0, c1, strict=True)]}


def _stored(url: str) -> dict[tuple[str, str], tuple[int, int]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        return {(device, boot): (int(count), int(high))
                for device, boot, count, high in db.execute(STORED).fetchall()}


def _print(echo: Echo, out: dict[str, Any]) -> None:
    echo(f"  provisioned (PostgreSQL, {out['regions'] + 1} brokers) in "
         f"{out['provision_s']:.1f} s; {out['devices']:,} devices built in "
         f"{out['build_s']:.1f} s, connected in {out['connect_s']:.1f} s")
    both = out["both"]["controllers"]
    echo(f"  two controllers, {out['both']['seconds']:.0f} s: ingest "
         + ", ".join(f"{c['ingest_per_s']:,.0f} msg/s at {c['cpu_percent']:.0f}% of a core"
                     for c in both)
         + f" (offered {out['offered_per_s']:,.0f}/s)")
    failover = out.get("failover_s")
    echo("  the leader killed: the other led after "
         + (f"{failover:.2f} s" if failover is not None else "NOT within 60 s"))
    alone = out["survivor"]["controllers"][0]
    echo(f"  the survivor alone, {out['survivor']['seconds']:.0f} s: ingest "
         f"{alone['ingest_per_s']:,.0f} msg/s at {alone['cpu_percent']:.0f}% of a core")
    echo(drain_line(out))
    where = {"devices": out["devices"], "regions": out["regions"]}
    report(echo, "fleet.scale_lost", out["lost"] + out["undelivered"], **where)
    # Stored twice: more rows than seqs given (the store's key makes it impossible; this
    # says so from the rows themselves, not from the schema).
    report(echo, "fleet.scale_duplicated", out["unknown"], **where)
    if failover is not None:
        report(echo, "fleet.failover_s", failover)
