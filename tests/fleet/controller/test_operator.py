"""The central team's view of one real box: `edge-agent serve` with its link on, the real
controller storing what it syncs, and `fleet send` / `fleet devices` from the CLI.

What is synced arrives (metrics, ledger summaries, events), nothing of a prompt does (not in
the controller's store, not in anything a broker-side subscriber sees), and a signed
command goes out and its result comes back to the operator's terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, clone_state, free_port
from tests.support.brokers import FLEET, Mosquitto, MQTTClient
from tests.support.fleetkit import Controller, Signer, wait_until

DEV = "store-op"
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "512",
       "EDGE_AGENT_TELEMETRY__HARDWARE": "false", "EDGE_AGENT_RUNTIME__THREADS": "1",
       "EDGE_AGENT_RETENTION__CONTENT_HOURS": "1"}
MARKER = "zebra-quartz-7731"
EMAIL = "jane.roe@example.org"
IBAN = "DE89370400440532013000"


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV,)).start()


@pytest.fixture
def controller(broker: Mosquitto, tmp_path: Path) -> Iterator[Controller]:
    ctl = Controller(broker, tmp_path / "controller").start()
    yield ctl
    ctl.close()


def _fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edge_agent", "fleet", *args], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
@pytest.mark.broker
def test_a_box_syncs_no_prompt_text_and_answers_a_signed_command(
        broker: Mosquitto, controller: Controller, model_cache: Path, tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    state = clone_state(model_cache, tmp_path / "state")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[fleet]\nenabled = true\nbroker = "{broker.url}"\nfleet_id = "{FLEET}"\n'
        f'device_id = "{DEV}"\nusername = "{DEV}"\n'
        f'password_file = "{broker.password_file(DEV)}"\n'
        f'command_public_key_file = "{signer.public_path}"\n'
        "metrics_interval_s = 1\nledger_interval_s = 1\n"
        "reconnect_min_s = 0.2\nreconnect_max_s = 1.0\n")
    capture = MQTTClient(broker, "controller", client_id="capture")
    capture.connect()
    capture.subscribe("edge/v1/#")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--config",
                             str(config), "--state-dir", str(state), "--port", str(port)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _ready(base), 120, 0.2), "the agent did not start"
        prompt = f"My email is {EMAIL}, my IBAN {IBAN}; remember {MARKER}."
        for _ in range(2):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": DEFAULT_MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": prompt}]})
            assert r.status_code == 200
        assert wait_until(lambda: _ledger_requests(controller) >= 2, 30, 0.2), \
            "no ledger summary covering the two requests reached the controller"
        assert wait_until(lambda: controller.count(DEV, "metrics") >= 1, 30, 0.2)
        metrics = controller.store.latest_metrics(DEV)
        assert metrics is not None and DEFAULT_MODEL in json.dumps(metrics)

        ctl = ["--state-dir", str(controller.settings.state_dir), "--broker", broker.url,
               "--username", "controller", "--password-file",
               str(broker.password_file("controller"))]
        sent = _fleet("send", DEV, "ping", "--key", str(signer.private_path), "--wait", "20",
                      "--json", *ctl)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        out = json.loads(sent.stdout)
        assert [(r["device"], r["status"]) for r in out["results"]] == [(DEV, "ok")]
        assert out["results"][0]["result"]["pong"] is True and out["missing"] == []
        forged = _fleet("send", DEV, "ping", "--key", str(Signer(tmp_path / "other")
                                                           .private_path), "--wait", "10",
                        *ctl)
        assert forged.returncode == 1 and "bad_signature" in forged.stdout

        devices = _fleet("devices", "--json", "--state-dir", str(controller.settings.state_dir))
        row = next(d for d in json.loads(devices.stdout) if d["device"] == DEV)
        assert row["online"]

        # Nothing of the prompts left the box: not in the store, not on the wire.
        time.sleep(1.5)  # one more sync interval, so every kind has had its chance
        wire = b"".join(p for _, p, _ in capture.received())
        assert b"store-op" in wire  # the capture did see the box's traffic
        db = b"".join(f.read_bytes()
                      for f in Path(controller.settings.state_dir).glob("controller.db*"))
        for secret in (MARKER, EMAIL, IBAN, "remember"):
            assert secret.encode() not in wire, secret
            assert secret.encode() not in db, secret
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        capture.close()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def _ledger_requests(controller: Controller) -> int:
    return sum(int(m["body"].get("requests", 0))
               for m in controller.store.messages(DEV, kind="ledger", limit=1000))
