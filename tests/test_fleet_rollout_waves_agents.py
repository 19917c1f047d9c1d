"""A rollout in waves to two real agents: `fleet rollout start --waves 1,100%` on the real
controller (`fleet serve` signing and publishing), a real Mosquitto, two `edge-agent
serve` with the real default model and their links on, clients streaming on both boxes
all along. Both boxes end ACTIVE, the second only after the first soaked, their evidence
rows exist (on the box and synced to the controller), and no client request fails.

The release is the default model with one letter of its name changed (the approach of
`test_fleet_rollout_e2e`), not gemma3:270m: another digest that loads and answers as
fast, which keeps this test well under a minute of CI.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.engine.catalog import ModelStore
from edge_agent.fleet.controller.store import SQLiteStore
from tests.brokers import FLEET, Mosquitto
from tests.conftest import DEFAULT_MODEL, clone_state, free_port
from tests.fleetkit import wait_until
from tests.test_fleet_rollout_e2e import ENV, PASSING, ROOT, _cli, _get, _variant

pytestmark = [pytest.mark.integration, pytest.mark.broker]

BOXES = ("store-w1", "store-w2")
RID = "rw-two"


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=BOXES).start()


@pytest.fixture
def central(broker: Mosquitto, model_cache: Path, tmp_path: Path
            ) -> Iterator[dict[str, Any]]:
    ctl, keys = tmp_path / "controller", tmp_path / "keys"
    _cli("fleet", "keygen", "--out", str(keys))
    _cli("fleet", "release", "init", "--state-dir", str(ctl), "--keys", str(keys))
    blob = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    (tmp_path / "gate.json").write_text(json.dumps(PASSING))
    _cli("fleet", "release", "add", str(_variant(blob, tmp_path / "v2.gguf", b"W")),
         "--name", DEFAULT_MODEL, "--version", "2", "--state-dir", str(ctl),
         "--keys", str(keys), "--gate", str(tmp_path / "gate.json"))
    port = free_port()
    config = tmp_path / "controller.toml"
    config.write_text(f'state_dir = "{ctl}"\ncommand_key_file = "{keys / "command.pem"}"\n'
                      "rollout_tick_s = 0.5\n"
                      f'[broker]\nurl = "{broker.url}"\nusername = "controller"\n'
                      f'password_file = "{broker.password_file("controller")}"\n'
                      f'[http]\nport = {port}\n')
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "fleet", "serve", "--config",
                             str(config)], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _get(f"http://127.0.0.1:{port}/healthz"), 60, 0.2)
        yield {"config": config, "keys": keys, "ctl": ctl,
               "releases": f"http://127.0.0.1:{port}/releases/",
               "api": f"http://127.0.0.1:{port}"}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _box(name: str, broker: Mosquitto, central: dict[str, Any], model_cache: Path,
         tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    state = clone_state(model_cache, tmp_path / f"state-{name}")
    root = tmp_path / f"root-{name}.json"
    shutil.copyfile(central["ctl"] / "releases" / "metadata" / "1.root.json", root)
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[fleet]\nenabled = true\nbroker = "{broker.url}"\nfleet_id = "{FLEET}"\n'
        f'device_id = "{name}"\nusername = "{name}"\n'
        f'password_file = "{broker.password_file(name)}"\n'
        f'command_key_file = "{central["keys"] / "command.pub.pem"}"\n'
        f'tuf_root_file = "{root}"\nartifacts_url = "{central["releases"]}"\n'
        "download_headroom_bytes = 0\nreconnect_min_s = 0.2\nreconnect_max_s = 1.0\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--config",
                             str(config), "--state-dir", str(state), "--port", str(port)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", state


def _digest(base: str) -> str:
    tags = httpx.get(f"{base}/api/tags", timeout=10).json()["models"]
    return str(next(m["digest"] for m in tags if m["name"] == DEFAULT_MODEL))


def _rollout(central: dict[str, Any]) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["fleet", "rollout", "status", RID, "--json",
                                       "--config", str(central["config"])])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def test_two_agents_in_waves_end_active_with_zero_failed_requests(
        broker: Mosquitto, central: dict[str, Any], model_cache: Path, tmp_path: Path
        ) -> None:
    boxes = {name: _box(name, broker, central, model_cache, tmp_path) for name in BOXES}
    failures: list[str] = []
    served = dict.fromkeys(BOXES, 0)
    stop = threading.Event()

    def client(name: str, base: str) -> None:  # each store's assistant, streaming
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{base}/api/chat", timeout=60, json={
                        "model": DEFAULT_MODEL, "options": {"num_predict": 8},
                        "messages": [{"role": "user", "content": "Count to five."}]}) as r:
                    lines = [json.loads(x) for x in r.iter_lines() if x]
                if r.status_code != 200 or not lines[-1].get("done") or "error" in lines[-1]:
                    failures.append(f"{name}: {r.status_code} {lines[-1] if lines else ''}")
                else:
                    served[name] += 1
            except httpx.HTTPError as exc:
                failures.append(f"{name}: {exc!r}")

    threads: list[threading.Thread] = []
    try:
        for name, (_, base, _) in boxes.items():
            assert wait_until(lambda b=base: _get(f"{b}/ready") is not None, 120, 0.2)
            assert wait_until(lambda n=name: (_get(f"{central['api']}/devices/{n}") or {})
                              .get("online"), 30, 0.2)
        old = {name: _digest(base) for name, (_, base, _) in boxes.items()}
        threads = [threading.Thread(target=client, args=(name, base))
                   for name, (_, base, _) in boxes.items()]
        for t in threads:
            t.start()
        started = CliRunner().invoke(main, [
            "fleet", "rollout", "start", f"{DEFAULT_MODEL}@2", "--id", RID, "--waves",
            "1,100%", "--soak", "2s", "--min-executed", "1", "--abort-above", "0%",
            "--device-timeout", "5m", "--config", str(central["config"])])
        assert started.exit_code == 0, started.output
        assert wait_until(lambda: _rollout(central)["state"] != "RUNNING", 150, 0.5), \
            _rollout(central)
        stop.set()
        for t in threads:
            t.join(60)
        report = _rollout(central)
        assert report["state"] == "COMPLETED", report
        assert report["states"] == {"ACTIVE": 2}
        assert failures == [] and all(n > 0 for n in served.values()), (failures, served)
        rows = {d["device"]: d for d in report["devices"]}
        first, second = sorted(BOXES, key=lambda n: rows[n]["wave"])
        assert (rows[first]["wave"], rows[second]["wave"]) == (1, 2)
        assert rows[second]["started_at"] >= rows[first]["active_at"] + 2.0  # soaked first
        for name, (_, base, state) in boxes.items():
            assert _digest(base) != old[name]
            history = json.loads(_cli("models", "history", DEFAULT_MODEL, "--json",
                                      "--state-dir", str(state)).stdout)
            evidence = [e for e in history["evidence"] if e["rollout_id"] == RID]
            assert [e["outcome"] for e in evidence] == ["ACTIVE"]
        store = SQLiteStore(central["ctl"] / "controller.db")
        try:
            assert wait_until(lambda: all(any(
                m["body"].get("event") == "rollout.evidence"
                and m["body"].get("rollout_id") == RID
                for m in store.messages(name, kind="rollout", limit=1000)) for name in BOXES),
                30, 0.5)
        finally:
            store.close()
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        for proc, _, _ in boxes.values():
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
