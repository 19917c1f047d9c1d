"""Agent releases in waves over simulated boxes, driven by the real `fleet serve` (`edge-agent
bench agent-rollout` at a small scale): each box restarts into the new version at its
switch and says so in its next birth; the boxes scripted to fail come back on their version
and end ROLLED_BACK by themselves; a threshold above the failing share completes, one below
it aborts; the controller's view of which box runs which agent is right after each."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.bench.fleet.agent_rollout import failing, run_agent_rollout_bench
from edge_agent.bench.fleet.rollout_waves import sim_devices

pytestmark = [pytest.mark.broker]


def test_failing_boxes_spread_over_the_fleet() -> None:
    devices = sim_devices(1000)
    assert len(failing(devices, 0.01)) == 10 and "sim-0000" in failing(devices, 0.01)
    assert failing(devices, 0) == set()


def test_an_agent_release_in_waves_over_simulated_boxes(tmp_path: Path) -> None:
    lines: list[str] = []
    # A threshold no wave of so small a fleet crosses by chance, for the completing one.
    result = run_agent_rollout_bench(boxes=120, runs=1, fail_share=0.025, soak_s=0.2,
                                     echo=lines.append, work=tmp_path, complete_above=0.5)
    run = result["runs"][0]
    good, halted = run["complete"], run["abort"]
    assert result["failing"] == 3
    assert good["state"] == "COMPLETED", lines
    assert good["states"] == {"ACTIVE": 117, "ROLLED_BACK": 3}, lines
    assert good["view"] == {"0.2.0": 117, "0.1.0": 3} and good["view_right"], lines
    assert halted["state"] == "ABORTED" and halted["aborted_in_wave"] is not None, lines
    assert halted["view_right"], lines
    # No box of a wave after the aborting one got the release.
    assert max(halted["waves_reached"]) == halted["aborted_in_wave"], halted
    assert any("view_right" in line or "matches" in line for line in lines)
