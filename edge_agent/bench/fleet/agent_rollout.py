"""`edge-agent bench agent-rollout`: agent releases in waves over a simulated fleet, driven
by the real `fleet serve` through `fleet rollout start --agent`, on a private broker.

Each simulated box is the agent's own link code (`fleet.sim.rollout.LinkFleet`): its
command gate checks every signature, its outbox waits for the controller's acks, and an
agent release restarts it at the switch — it goes away and comes back with a birth naming
the new version. A share of the boxes (`--fail`, 1% by default, every 1/share-th box) is
scripted to fail: it restarts into the new version, never passes its gate, and comes back
on the version it ran (ROLLED_BACK, as the base entry of a real box puts it back).

Each run publishes two agent releases and rolls them out in waves (`WAVES`):

- one with an abort threshold above the failing share: it COMPLETES, the failing boxes
  ROLLED_BACK by themselves, every other box ACTIVE;
- one with a threshold a quarter of it: the wave in which the failing share first crosses it is
  the one that aborts, and no box of a later wave is sent the release.

After each, the controller's view of versions (`/devices`: each box's agent version as its
last birth said) is read and compared with what the boxes run. Figures: wall time to the
end, per wave; the boxes rolled back; the aborting wave and the boxes that never got the
release; whether the view was right (and how long after the end it took to be).
Must never: import from tests/, leave the simulator, the controller or the broker running.
"""

from __future__ import annotations

import collections
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from edge_agent.bench.fleet.rollout_waves import sim_devices
from edge_agent.bench.targets import report
from edge_agent.fleet.protocol.signing import load_public
from edge_agent.fleet.sim.rollout import LinkFleet
from edge_agent.fleet.sim.testbed import Broker, ControllerProcess, raise_nofile, wait_until

Echo = Callable[[str], None]
FLEET = "bench"
WAVES = "1%,10%,50%,100%"
BASE_VERSION = "0.1.0"


def _cli(*args: str) -> dict[str, Any] | list[Any] | str:
    done = subprocess.run([sys.executable, "-m", "edge_agent", *args], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"edge-agent {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    try:
        return json.loads(done.stdout)  # type: ignore[no-any-return]
    except ValueError:
        return done.stdout


def _wheelhouse(where: Path, version: str) -> Path:
    """What `add-agent` reads of a wheelhouse: the wheels' names (the simulated boxes
    download nothing)."""
    where.mkdir(parents=True)
    for name in (f"edge_agent_appliance-{version}-py3-none-any.whl",
                 "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"):
        (where / name).write_bytes(name.encode())
    return where


def failing(devices: Sequence[str], share: float) -> set[str]:
    """Every 1/share-th device (1%: sim-0000, sim-0100, …): spread over the waves."""
    if not share:
        return set()
    step = max(1, round(1 / share))
    return {d for i, d in enumerate(devices) if i % step == 0}


def run_agent_rollout_bench(*, boxes: int, runs: int, fail_share: float, soak_s: float,
                            echo: Echo, work: Path | None = None,
                            complete_above: float | None = None) -> dict[str, Any]:
    """`complete_above`: the completing rollout's abort threshold (default five times the
    failing share, at least 5%: the first wave, 1% of the fleet, is a sample, and 3 of its
    100 boxes fail about one time in twelve at a 1% share); the aborting one's is a
    quarter of the share."""
    complete_above = complete_above if complete_above is not None else \
        max(5 * fail_share, 0.05)
    raise_nofile(boxes + 1024)
    # Every simulated box restarts at its switch: its link's "lost the broker" line, once
    # per box, is the simulation working, not news.
    logging.getLogger("edge_agent.fleet.device.link.owner").setLevel(logging.ERROR)
    devices = sim_devices(boxes)
    bad = failing(devices, fail_share)
    echo(f"edge-agent bench agent-rollout: {boxes} simulated boxes, {len(bad)} scripted to "
         f"fail ({fail_share:.1%}), waves {WAVES}, soak {soak_s:g} s, {runs} run(s)")
    with tempfile.TemporaryDirectory(prefix="edge-bench-agent-", dir=work) as tmp:
        root = Path(tmp)
        keys, box_root = root / "keys", root / "box"
        ctl = box_root / "controller"
        _cli("fleet", "keygen", "--out", str(keys))
        _cli("fleet", "release", "init", "--state-dir", str(ctl), "--keys", str(keys))
        for i in range(runs):
            for version in (f"0.2.{i}", f"0.3.{i}"):
                _cli("fleet", "release", "add-agent", version, "--wheelhouse",
                     str(_wheelhouse(root / f"house-{version}", version)),
                     "--state-dir", str(ctl), "--keys", str(keys))
        broker = Broker(box_root, fleet=FLEET, devices=devices, passwd_tool=False,
                        log_types=("error", "warning")).start()
        config = box_root / "controller.toml"
        config.write_text(f'state_dir = "{ctl}"\ncommand_signing_key_file = '
                          f'"{keys / "command.pem"}"\n[broker]\nurl = "{broker.url}"\n'
                          f'username = "controller"\n'
                          f'password_file = "{broker.password_file("controller")}"\n')
        controller = ControllerProcess(broker, box_root)
        fleet = LinkFleet(broker.url, fleet=FLEET, password_file=broker.password_file,
                          public_key=load_public(keys / "command.pub.pem"), devices=devices,
                          root=root / "sim", outcomes=dict.fromkeys(bad, "rolled_back"),
                          step_s=0.05, agent_version=BASE_VERSION, restart_s=0.5)
        rows: list[dict[str, Any]] = []
        try:
            controller.start()
            fleet.connect(timeout=max(60.0, boxes / 50))
            if not wait_until(lambda: _view(controller) == {BASE_VERSION: boxes},
                              max(60.0, boxes / 50), 1.0):
                raise RuntimeError(f"the controller sees {_view(controller)}, not "
                                   f"{boxes} boxes on {BASE_VERSION}")
            for i in range(runs):
                good = _one(controller, config, fleet, f"0.2.{i}", f"ag-good-{i + 1}",
                            abort_above=complete_above, soak_s=soak_s, echo=echo)
                halted = _one(controller, config, fleet, f"0.3.{i}", f"ag-abort-{i + 1}",
                              abort_above=fail_share / 4, soak_s=soak_s, echo=echo)
                rows.append({"complete": good, "abort": halted})
        finally:
            fleet.close()
            controller.stop()
            broker.stop()
    complete = [r["complete"] for r in rows]
    wall = sorted(r["wall_s"] for r in complete)[len(complete) // 2]
    echo(f"summary: {boxes} boxes, median {wall:.1f} s to COMPLETED; rolled back "
         f"{[r['rolled_back'] for r in complete]} (scripted {len(bad)}); aborting waves "
         f"{[r['abort']['aborted_in_wave'] for r in rows]}; views right "
         f"{[r['complete']['view_right'] and r['abort']['view_right'] for r in rows]}")
    report(echo, "agent_rollout.view_right",
           float(all(r["complete"]["view_right"] and r["abort"]["view_right"] for r in rows)),
           devices=boxes)
    return {"devices": boxes, "failing": len(bad), "waves": WAVES, "runs": rows,
            "median_complete_s": wall}


def _view(controller: ControllerProcess) -> dict[str, int]:
    """The controller's count of boxes by agent version (what `fleet devices agents`
    shows)."""
    devices = httpx.get(f"{controller.url}/devices", timeout=120).json()["devices"]
    return dict(collections.Counter(str(d["agent_version"]) for d in devices))


def _one(controller: ControllerProcess, config: Path, fleet: LinkFleet, version: str,
         rid: str, *, abort_above: float, soak_s: float, echo: Echo) -> dict[str, Any]:
    t0 = time.monotonic()
    _cli("fleet", "rollout", "start", "--agent", version, "--id", rid, "--devices", "sim-*",
         "--waves", WAVES, "--abort-above", f"{abort_above:.2%}", "--min-executed", "10",
         "--soak", f"{soak_s:g}s", "--config", str(config), "--json")
    status = _settled(controller, rid)
    wall = time.monotonic() - t0
    states = status.get("states") or {}
    waves = status.get("waves_detail") or []
    reached = [w["wave"] for w in waves if sum((w.get("phases") or {}).values()) and
               any(p != "pending" for p in (w.get("phases") or {}))]
    expected = dict(collections.Counter(fleet.versions.values()))
    took = time.monotonic()
    right = wait_until(lambda: _view(controller) == expected, 120, 1.0)
    lag = time.monotonic() - took
    not_sent = sum(1 for d in status.get("devices", []) if d.get("state") in (None, "PENDING"))
    row = {"rollout_id": rid, "version": version, "state": status["state"], "wall_s": wall,
           "states": states, "rolled_back": states.get("ROLLED_BACK", 0),
           "aborted_in_wave": status.get("wave") if status["state"] == "ABORTED" else None,
           "waves_reached": reached, "never_sent": not_sent, "view": expected,
           "view_right": right, "view_lag_s": lag, "reason": status.get("reason")}
    echo(f"  {rid} ({version}, abort above {abort_above:.1%}): {status['state']} in "
         f"{wall:.1f} s, {states}" + (f", aborted in wave {row['aborted_in_wave']}, "
                                      f"{not_sent} boxes never sent it"
                                      if row["aborted_in_wave"] else "")
         + f"; controller's view {'right' if right else 'WRONG'} {lag:.1f} s after: "
         f"{expected}")
    return row


def _settled(controller: ControllerProcess, rid: str, timeout: float = 3600.0
             ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = httpx.get(f"{controller.url}/rollouts/{rid}",
                                           timeout=120).json()
        if status["state"] in ("COMPLETED", "ABORTED") and status.get("settled"):
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout {rid} is {status['state']}: {status.get('states')}")
        time.sleep(1.0)
