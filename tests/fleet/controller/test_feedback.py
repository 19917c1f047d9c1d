"""The controller counts the verdicts apps sent back on the boxes' answers: per box and
model over a window, from the service levels the stored `metrics` messages gave (each
counted once, however often delivered), on SQLite and PostgreSQL, through `GET /feedback`
and `fleet feedback`; and end to end, a verdict posted to a live box reaches the
controller's counts over a real broker."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from openai import OpenAI

from edge_agent.cli import main
from edge_agent.config import load_settings
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.store import PostgresStore, SQLiteStore
from tests.conftest import DEFAULT_MODEL, clone_state, free_port, start_server
from tests.support.brokers import FLEET, Mosquitto
from tests.support.fleetkit import Controller, wait_until

A, B = "store-a", "store-b"
BOOT = "b" * 32
DEV = "store-fb"


def metrics(device: str, seq: int, ts: float, models: dict[str, Any]) -> Inbound:
    return Inbound(FLEET, device, "metrics", BOOT, seq, "metrics", ts, {"models": models}, ts)


def fill(store: SQLiteStore | PostgresStore, now: float) -> None:
    store.ingest([
        metrics(A, 1, now - 7200, {"m:1": {"feedback": {"good": 9, "bad": 9}}}),  # too old
        metrics(A, 2, now - 60, {"m:1": {"feedback": {"good": 2, "bad": 1}},
                                 "m:2": {"feedback": {"good": 0, "bad": 0}}}),
        metrics(A, 3, now - 30, {"m:1": {"feedback": {"good": 1, "bad": 0}},
                                 "m:2": {"feedback": {"good": 0, "bad": 4}}}),
        metrics(B, 1, now - 30, {"m:1": {"feedback": {"good": "3", "bad": True}},  # unsound
                                 "m:3": {"requests": {"200": 1}}}),
        metrics(B, 2, now - 20, {"m:1": {"feedback": {"good": 5, "bad": -2}}}),
        Inbound(FLEET, B, "events", BOOT, 3, "audit", now - 10,
                {"models": {"m:1": {"feedback": {"good": 100}}}}, now),  # not metrics
    ])
    # The same message delivered again is stored once, and counted once.
    store.ingest([metrics(A, 3, now - 30, {"m:1": {"feedback": {"good": 1, "bad": 0}},
                                           "m:2": {"feedback": {"good": 0, "bad": 4}}})])


def expected() -> list[dict[str, Any]]:
    return [{"device": A, "fleet": FLEET, "model": "m:1", "good": 3, "bad": 1, "messages": 2},
            {"device": A, "fleet": FLEET, "model": "m:2", "good": 0, "bad": 4, "messages": 1},
            {"device": B, "fleet": FLEET, "model": "m:1", "good": 5, "bad": 0, "messages": 1}]


def test_feedback_is_summed_per_box_and_model_over_a_window(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "controller.db")
    now = time.time()
    fill(store, now)
    assert store.slo.feedback_sums(since=now - 3600) == expected()
    assert store.slo.feedback_sums(since=now - 3600, device=B) == expected()[2:]
    assert store.slo.feedback_sums(since=now - 3600, until=now - 45) == [
        {"device": A, "fleet": FLEET, "model": "m:1", "good": 2, "bad": 1, "messages": 1}]
    assert store.slo.feedback_sums(since=now - 86400)[0]["good"] == 12

    http = TestClient(create_app(store, ControllerMetrics(store), broker_connected=lambda: True))
    answer = http.get("/feedback", params={"since": now - 3600}).json()
    assert answer["feedback"] == expected() and answer["until"] is None
    assert http.get("/feedback").json()["feedback"][0]["good"] == 12  # the last day
    assert http.get("/feedback", params={"device": A, "since": now - 3600}
                    ).json()["feedback"] == expected()[:2]
    bad = http.get("/feedback", params={"device": "a b"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    assert http.get("/feedback", params={"since": "nan"}).status_code == 400
    store.close()

    runner = CliRunner()
    shown = runner.invoke(main, ["fleet", "feedback", "--since", "1h", "--json",
                                 "--state-dir", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output) == expected()
    table = runner.invoke(main, ["fleet", "feedback", "--device", A, "--since", "1h",
                                 "--state-dir", str(tmp_path)])
    assert table.exit_code == 0, table.output
    row = next(line.split() for line in table.output.splitlines() if line.startswith(A))
    assert row == [A, FLEET, "m:1", "3", "1", "25"]


def test_feedback_is_summed_alike_on_postgresql(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    try:
        now = time.time()
        fill(store, now)
        assert store.slo.feedback_sums(since=now - 3600) == expected()
    finally:
        store.close()


@pytest.fixture
def broker(mosquitto_factory: Callable[..., Mosquitto]) -> Mosquitto:
    return mosquitto_factory(devices=(DEV,)).start()


@pytest.fixture
def controller(broker: Mosquitto, tmp_path: Path) -> Iterator[Controller]:
    ctl = Controller(broker, tmp_path / "controller").start()
    yield ctl
    ctl.close()


@pytest.mark.integration
def test_a_verdict_on_a_box_reaches_the_controllers_counts(
        model_cache: Path, tmp_path: Path, broker: Mosquitto, controller: Controller) -> None:
    from edge_agent.governance.keys import KeyStore

    state = clone_state(model_cache, tmp_path / "state")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[tenants.shop]\nmodels = ["smollm2:*"]\n')
    key = KeyStore(state).create("shop")[0]
    settings = load_settings(cfg, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 256,
        "telemetry.hardware": False, "fleet.enabled": True, "fleet.broker": broker.url,
        "fleet.fleet_id": FLEET, "fleet.device_id": DEV, "fleet.username": DEV,
        "fleet.password_file": str(broker.password_file(DEV)),
        "fleet.reconnect_min_s": 0.1, "fleet.reconnect_max_s": 0.5,
        "fleet.metrics_interval_s": 1.0})
    live = start_server(settings)
    started = time.time()
    try:
        client = OpenAI(base_url=live.openai_url, api_key=key, max_retries=0)
        answers = [client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            for _ in range(2)]
        for answer, rating in zip(answers, ("good", "bad"), strict=True):
            r = httpx.post(f"{live.base_url}/edge/v1/feedback", timeout=30,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"request_id": answer.id, "rating": rating})
            assert r.status_code == 200, r.text

        def counted() -> list[dict[str, Any]]:
            return controller.store.slo.feedback_sums(since=started - 60, device=DEV)

        assert wait_until(lambda: counted() and counted()[0]["bad"] == 1, 30), counted()
        found = counted()
        assert [(f["device"], f["model"], f["good"], f["bad"]) for f in found] == [
            (DEV, DEFAULT_MODEL, 1, 1)]
    finally:
        live.stop()
