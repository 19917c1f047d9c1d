"""`edge-agent bench rollout --runs 1 --json` end to end (private broker, `fleet serve`,
`edge-agent serve` with the real default model, then 20 simulated boxes in waves): every
figure is there and finite. The figures themselves are never asserted: this machine's load
is not the bench's business."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.fleet.sim.testbed import find_mosquitto
from tests.conftest import clone_state

pytestmark = [pytest.mark.integration, pytest.mark.broker]
ROOT = Path(__file__).resolve().parent.parent


def test_bench_rollout_reports_every_figure(model_cache: Path, tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    state = clone_state(model_cache, tmp_path / "state")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "512",
           "EDGE_AGENT_TELEMETRY__HARDWARE": "false"}
    # Its own process group: a bench stopped at the timeout takes its broker, controller
    # and box with it.
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "bench", "--state-dir",
                             str(state), "rollout", "--runs", "1", "--before", "2",
                             "--boxes", "20", "--soak", "0.5", "--json"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(stdout)
    summary = result["summary"]
    for key in ("to_active_s", "longest_gap_ms", "ttft_p99_during_ms", "download_vs_curl"):
        assert math.isfinite(summary[key]), key
    assert summary["to_active_s"] > 0 and summary["download_vs_curl"] > 0
    assert set(summary["states_s"]) >= {"DOWNLOADING", "VERIFYING", "ACTIVATING", "GATING"}
    assert result["rollouts"][0]["failed_requests"] == 0
    waves = summary["waves"]  # the controller's cost of a rollout over 20 simulated boxes
    assert waves["devices"] == 20
    assert waves["controller_cpu_s"] > 0 and waves["msgs_per_s"] > 0
    assert result["waves"]["runs"][0]["messages"] >= 20 * 8  # a command, 7 states, each box
    assert "rollout.download_vs_curl" not in stdout  # the report goes to stderr
    assert "download to the last byte" in stderr
