"""The controller's figure of `edge-agent bench rollout`: a rollout in waves over simulated
boxes — the fleet simulator (`fleet.sim.rollout.LinkFleet`: the agent's own link code per
box, its command gate checking every signature, its outbox waiting for the controller's
acks), each box answering with the scripted path RECEIVED … GATING → ACTIVE — driven by
the real `fleet serve` (its rollout engine signs and publishes every command) through
`fleet rollout start`, on the private broker of the bench.

Measured from `fleet rollout start` to the rollout's COMPLETED: the wall time, the
controller process's CPU (user + system, psutil), and the messages it handled — stored
from the boxes (`edge_fleet_messages_ingested_total`), births and deaths, the commands it
sent (`edge_fleet_rollout_commands_total`) and the acks it published — as a rate.
Must never: import from tests/, leave the simulator running.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from edge_agent.bench.targets import report
from edge_agent.fleet.protocol.signing import load_public
from edge_agent.fleet.sim.rollout import LinkFleet
from edge_agent.fleet.sim.testbed import Broker, ControllerProcess

Echo = Callable[[str], None]
WAVES = "1,10%,50%,100%"
# Series summed for the message rate: what came in, what went out.
INBOUND = ("edge_fleet_messages_ingested_total", "edge_fleet_messages_duplicate_total",
           "edge_fleet_status_messages_total")
OUTBOUND = ("edge_fleet_rollout_commands_total", "edge_fleet_acks_sent_total")


def sim_devices(count: int) -> tuple[str, ...]:
    return tuple(f"sim-{i:04d}" for i in range(count))


def _rollout(config: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "edge_agent", "fleet", "rollout", *args,
                           "--config", str(config), "--json"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"fleet rollout {args[0]} failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout))


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _counted(controller: ControllerProcess, names: Sequence[str]) -> float:
    found = controller.metrics()
    return sum(found.get(n, 0.0) for n in names)


def run_waves(controller: ControllerProcess, broker: Broker, config: Path, keys: Path,
              ref: str, devices: Sequence[str], work: Path, *, runs: int, soak_s: float,
              echo: Echo) -> dict[str, Any]:
    """`runs` rollouts of `ref` in waves over `devices` (simulated, in `broker`'s passwd),
    one after the other; the figures of each and their medians."""
    pid = controller.pid
    if pid is None:
        raise RuntimeError("the controller is not running")
    echo(f"rollout in waves {WAVES} over {len(devices)} simulated boxes (the link's own code, "
         f"scripted outcomes), soak {soak_s:g} s, driven by fleet serve")
    fleet = LinkFleet(broker.url, fleet=broker.fleet, password_file=broker.password_file,
                      public_key=load_public(keys / "command.pub.pem"), devices=devices,
                      root=work / "sim", step_s=0.05)
    rows: list[dict[str, Any]] = []
    try:
        fleet.connect()
        deadline = time.monotonic() + 60
        while not all(controller.device(d).get("online") for d in (devices[0], devices[-1])):
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated boxes did not reach the controller")
            time.sleep(0.2)
        rows = [_one(controller, pid, config, ref, f"bench-waves-{i + 1}", soak_s,
                     len(devices), echo) for i in range(runs)]
    finally:
        fleet.close()
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("wall_s", "cpu_s", "messages", "msgs_per_s", "core_percent")}
    echo(f"  median of {len(rows)}: {med['wall_s']:.1f} s, controller CPU {med['cpu_s']:.2f} s "
         f"({med['core_percent']:.1f}% of one core), {med['messages']:.0f} messages "
         f"({med['msgs_per_s']:.0f}/s)")
    report(echo, "rollout.waves_cpu_ms_per_box", 1000 * med["cpu_s"] / len(devices),
           devices=len(devices))
    return {"devices": len(devices), "waves": WAVES, "soak_s": soak_s, "runs": rows,
            "median": med}


def _one(controller: ControllerProcess, pid: int, config: Path, ref: str, rid: str,
         soak_s: float, boxes: int, echo: Echo) -> dict[str, Any]:
    cpu0, msgs0 = _cpu_s(pid), _counted(controller, INBOUND + OUTBOUND)
    t0 = time.monotonic()
    _rollout(config, "start", ref, "--id", rid, "--devices", "sim-*", "--waves", WAVES,
             "--soak", f"{soak_s:g}s")
    final = _settle(controller, rid, "COMPLETED")
    wall = time.monotonic() - t0
    cpu = _cpu_s(pid) - cpu0
    messages = _counted(controller, INBOUND + OUTBOUND) - msgs0
    if final.get("states") != {"ACTIVE": boxes}:
        raise RuntimeError(f"rollout {rid} ended with {final.get('states')}")
    row = {"rollout_id": rid, "wall_s": wall, "cpu_s": cpu, "core_percent": 100 * cpu / wall,
           "messages": messages, "msgs_per_s": messages / wall}
    echo(f"  {rid}: COMPLETED in {wall:.1f} s, controller CPU {cpu:.2f} s "
         f"({row['core_percent']:.1f}% of one core), {messages:.0f} messages "
         f"({row['msgs_per_s']:.0f}/s)")
    return row


def _settle(controller: ControllerProcess, rid: str, state: str, timeout: float = 300.0
            ) -> dict[str, Any]:
    """Polls the controller's read API (what `fleet rollout status --json` shows)."""
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(f"{controller.url}/rollouts/{rid}", timeout=30).json()
        if status["state"] == state and status.get("settled"):
            return status
        if status["state"] not in ("RUNNING", "PAUSED", state) or time.monotonic() > deadline:
            raise RuntimeError(f"rollout {rid} is {status['state']}, not {state}: "
                               f"{status.get('states')}")
        time.sleep(0.5)
