"""A model rollout end to end, with every real part: the controller's signed repository
(`fleet keygen`, `fleet release init|add`), `fleet serve` serving it and ingesting, a real
Mosquitto, and `edge-agent serve` with the real default model and its link on. The central
team starts a rollout with `fleet send`; the box looks the release up through TUF,
downloads it from the controller, installs it, switches while clients stream, runs the
gate and reports every state. A release whose golden prompt fails rolls back by itself.
"""

from __future__ import annotations

import json
import os
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

from edge_agent.engine.catalog import ModelStore
from tests.brokers import FLEET, Mosquitto
from tests.conftest import DEFAULT_MODEL, clone_state, free_port
from tests.fleetkit import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.broker]

DEV = "store-ro"
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "512",
       "EDGE_AGENT_TELEMETRY__HARDWARE": "false", "EDGE_AGENT_RUNTIME__THREADS": "1"}
PASSING = {"prompts": [{"id": "hello", "prompt": "Hello", "max_tokens": 4,
                        "expect": {"max_output_tokens": 4}}],
           "tokens_per_s_floor": None}
FAILING = {"prompts": [{"id": "marker", "prompt": "Say hi", "max_tokens": 4,
                        "expect": {"contains": ["zebra-quartz-7731"]}}],
           "tokens_per_s_floor": None}


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "edge_agent", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def _variant(blob: Path, dest: Path, letter: bytes) -> Path:
    """The default model with one letter of its general.name changed: another digest that
    loads and answers as fast."""
    shutil.copyfile(blob, dest)
    with dest.open("r+b") as fh:
        head = fh.read(1 << 16)
        at = head.index(b"general.name") + len(b"general.name") + 4 + 8
        fh.seek(at)
        fh.write(letter)
    return dest


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV,)).start()


@pytest.fixture
def central(broker: Mosquitto, model_cache: Path, tmp_path: Path
            ) -> Iterator[dict[str, Any]]:
    """The central team's side: keys, a repository with releases 2 (passing gate) and 3
    (failing gate) of the default model, and `fleet serve` serving and ingesting."""
    ctl, keys = tmp_path / "controller", tmp_path / "keys"
    _cli("fleet", "keygen", "--out", str(keys))
    _cli("fleet", "release", "init", "--state-dir", str(ctl), "--keys", str(keys))
    blob = ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)
    for version, letter, gate in (("2", b"T", PASSING), ("3", b"U", FAILING)):
        (tmp_path / f"gate{version}.json").write_text(json.dumps(gate))
        _cli("fleet", "release", "add", str(_variant(blob, tmp_path / f"v{version}.gguf",
                                                     letter)),
             "--name", DEFAULT_MODEL, "--version", version, "--state-dir", str(ctl),
             "--keys", str(keys), "--gate", str(tmp_path / f"gate{version}.json"))
    port = free_port()
    config = tmp_path / "controller.toml"
    config.write_text(f'state_dir = "{ctl}"\ncommand_key_file = "{keys / "command.pem"}"\n'
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


def _get(url: str) -> Any:
    try:
        r = httpx.get(url, timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _rollout_states(central: dict[str, Any], rollout_id: str) -> list[str]:
    """The states the controller has stored for one rollout, in order."""
    from edge_agent.fleet.controller.store import SQLiteStore

    store = SQLiteStore(central["ctl"] / "controller.db")
    try:
        rows = store.messages(DEV, kind="rollout", limit=10_000)
    finally:
        store.close()
    bodies = sorted((m["body"] for m in rows if m["body"].get("rollout_id") == rollout_id
                     and m["body"].get("event") == "rollout.transition"),
                    key=lambda b: b["ts"])
    return [b["to"] for b in bodies]


def test_a_rollout_goes_active_with_zero_failed_requests_and_a_bad_one_rolls_back(
        broker: Mosquitto, central: dict[str, Any], model_cache: Path, tmp_path: Path
        ) -> None:
    state = clone_state(model_cache, tmp_path / "state")
    root = tmp_path / "provisioned-root.json"  # what the technician put on the box
    shutil.copyfile(central["ctl"] / "releases" / "metadata" / "1.root.json", root)
    config = tmp_path / "box.toml"
    config.write_text(
        f'[fleet]\nenabled = true\nbroker = "{broker.url}"\nfleet_id = "{FLEET}"\n'
        f'device_id = "{DEV}"\nusername = "{DEV}"\n'
        f'password_file = "{broker.password_file(DEV)}"\n'
        f'command_key_file = "{central["keys"] / "command.pub.pem"}"\n'
        f'tuf_root_file = "{root}"\nartifacts_url = "{central["releases"]}"\n'
        "download_headroom_bytes = 0\nreconnect_min_s = 0.2\nreconnect_max_s = 1.0\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    box = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--config",
                            str(config), "--state-dir", str(state), "--port", str(port)],
                           env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def client() -> None:  # a store's assistant, streaming all along
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{base}/api/chat", timeout=60, json={
                        "model": DEFAULT_MODEL, "options": {"num_predict": 8},
                        "messages": [{"role": "user", "content": "Count to five."}]}) as r:
                    lines = [json.loads(x) for x in r.iter_lines() if x]
                if r.status_code != 200 or not lines[-1].get("done") or "error" in lines[-1]:
                    failures.append(f"{r.status_code} {lines[-1] if lines else ''}")
                else:
                    served[0] += 1
            except httpx.HTTPError as exc:
                failures.append(repr(exc))

    try:
        assert wait_until(lambda: _get(f"{base}/ready") is not None, 120, 0.2)
        assert wait_until(lambda: (_get(f"{central['api']}/devices/{DEV}") or {})
                          .get("online"), 30, 0.2)
        old = _digest(base)
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        sent = _cli("fleet", "send", DEV, "rollout.start", "--config", str(central["config"]),
                    "--arg", "rollout_id=r1", "--arg", f"name={DEFAULT_MODEL}",
                    "--arg", "version=2", "--json")
        assert json.loads(sent.stdout)["results"][0]["result"]["accepted"] is True
        assert wait_until(lambda: "ACTIVE" in _rollout_states(central, "r1"), 180, 0.5), \
            _rollout_states(central, "r1")
        stop.set()
        for t in threads:
            t.join(60)
        assert failures == [] and served[0] > 0
        assert _rollout_states(central, "r1") == [
            "RECEIVED", "DOWNLOADING", "VERIFYING", "STAGED", "ACTIVATING", "GATING", "ACTIVE"]
        new = _digest(base)
        assert new != old

        _cli("fleet", "send", DEV, "rollout.start", "--config", str(central["config"]),
             "--arg", "rollout_id=r2", "--arg", f"name={DEFAULT_MODEL}", "--arg", "version=3")
        assert wait_until(lambda: "ROLLED_BACK" in _rollout_states(central, "r2"), 180, 0.5), \
            _rollout_states(central, "r2")
        assert _digest(base) == new  # version 2 serves again, by itself

        history = json.loads(_cli("models", "history", DEFAULT_MODEL, "--json",
                                  "--state-dir", str(state)).stdout)
        outcomes = {e["rollout_id"]: e for e in history["evidence"]}
        assert outcomes["r1"]["outcome"] == "ACTIVE"
        assert outcomes["r2"]["outcome"] == "ROLLED_BACK"
        assert "marker" in json.dumps(outcomes["r2"]["checks"])  # the failing check named
    finally:
        stop.set()
        box.send_signal(signal.SIGTERM)
        try:
            box.wait(30)
        except subprocess.TimeoutExpired:
            box.kill()


def _digest(base: str) -> str:
    tags = httpx.get(f"{base}/api/tags", timeout=10).json()["models"]
    return str(next(m["digest"] for m in tags if m["name"] == DEFAULT_MODEL))
