"""The periodic review of production models on both stores, from a real signed release
repository and metrics shaped as boxes send them: a production release whose version has a
newer one, whose boxes serve task kinds its evaluation never saw, that got slower than the
baseline recorded at its rollout, whose rollback target a box no longer has, and whose
review date passed, is flagged for each, through `GET /review`, `fleet review` (exit 1)
and the console's page; one in order has no finding."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.inbound import Inbound
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases.evaluation import samples_summary
from edge_agent.fleet.controller.rollout_records import NewRollout
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.controller.waves import Policy, parse_waves
from tests.fleet.controller.test_slo import metrics_body
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import make_repo

NAME, BOOT = "shop:1b", "d" * 32
DAY = 86400.0


def _materials(tmp_path: Path, kinds: list[str], review_by: str) -> dict[str, Any]:
    lines = b"".join(json.dumps({"kind": k}).encode() + b"\n" for k in kinds)
    return {"eval_samples": samples_summary(lines).model_dump(),
            "eval_results": {"sha256": "0" * 64, "metrics": {"accuracy": 0.9}},
            "build": "llama.cpp b4500 Q4_K_M", "route": "local",
            "degradation": f"{NAME}@1", "rollback_target": "1", "review_by": review_by}


def _interval(device: str, seq: int, end: float, ttft: float,
              kinds: dict[str, int]) -> Inbound:
    body = metrics_body(end, ttft_p95=ttft, model=NAME)
    body["models"][NAME]["kinds"] = kinds
    return Inbound("f1", device, "metrics", BOOT, seq, "metrics", end, body, end)


def _verify_answer(store: ControllerStore, device: str, digest: str, answer: dict[str, Any],
                   now: float) -> None:
    cid = uuid.uuid4().hex
    store.record_command({"id": cid, "fleet": "f1", "device": device, "type": "model.verify",
                          "seq": 1, "issued_at": now, "expires_at": now + 300,
                          "args": {"name": NAME, "digest": digest}}, now)
    store.command_result(device, {"id": cid, "type": "model.verify", "status": "ok",
                                  "result": {"name": NAME, "digest": digest, **answer}}, now)


def test_a_production_model_is_flagged_for_each_thing_due(store: ControllerStore,
                                                         tmp_path: Path) -> None:
    now = time.time()
    repo = make_repo(tmp_path)
    gguf = write_tiny_gguf(tmp_path / "model.gguf")
    first = f"sha256:{repo.add(gguf, NAME, '1').sha256}"
    repo.add(gguf, NAME, "2", license="Apache-2.0", stage="production",
             materials=_materials(tmp_path, ["openai"], "2026-01-01"))
    repo.add(gguf, NAME, "3")  # newer, an experiment
    # Its rollout completed ten days ago on two boxes.
    done = now - 10 * DAY
    store.ingest([_interval(d, 1, done - 60, 100.0, {}) for d in ("d1", "d2")])
    store.rollouts.create_rollout(NewRollout(
        "ro-2", NAME, "2", "all", Policy(parse_waves("100%")),
        {"d1": ("f1", 1), "d2": ("f1", 1)}), done - 120)
    with store._tx() as db:  # type: ignore[attr-defined]
        db.run("UPDATE rollouts SET state = 'COMPLETED', live = 0 WHERE id = 'ro-2'")
        db.run("UPDATE rollout_devices SET state = 'ACTIVE', started_at = ?, finished_at = ? "
               "WHERE rollout_id = 'ro-2'", [done - 100, done])
    seq = 10
    for k in range(1, 11):  # its baseline: 30 minutes after, 100 ms, OpenAI only
        for d in ("d1", "d2"):
            seq += 1
            store.ingest([_interval(d, seq, done + 120 * k, 100.0, {"openai": 11})])
    for k in range(1, 11):  # the last day: 150 ms, and half Ollama with tools
        for d in ("d1", "d2"):
            seq += 1
            store.ingest([_interval(d, seq, now - 600 * k, 150.0,
                                    {"openai": 5, "ollama": 6, "tools": 6})])
    _verify_answer(store, "d1", first, {"present": True, "verified": True, "loads": True,
                                        "detail": ""}, now)
    _verify_answer(store, "d2", first, {"present": False, "verified": False, "loads": False,
                                        "detail": f"no version 1 of {NAME} on this box"}, now)

    http = TestClient(create_app(store, ControllerMetrics(store), state_dir=tmp_path / "state"))
    found = http.get("/review").json()["models"]
    assert [m["name"] for m in found] == [NAME]
    m = found[0]
    assert (m["version"], m["rollout"], m["newer"], m["overdue"]) == ("2", "ro-2", ["3"], True)
    assert m["covered"] == ["openai"]
    assert m["kinds"]["tools"] == round(6 / 11, 4) and set(m["uncovered"]) == {"ollama", "tools"}
    assert m["baseline"]["ttft_p95"] == 100.0 and m["recent"]["ttft_p95"] == 150.0
    assert m["drift"]["ttft_p95"] == 1.5
    assert [a["device"] for a in m["verified"]] == ["d1", "d2"]
    flags = "\n".join(m["flags"])
    for said in ("a newer version is published: 3", "of its requests are ollama",
                 "of its requests are tools", "TTFT p95 +50% against its baseline",
                 f"rollback target 1 is missing or broken on 1 of 2 box(es) asked: d2: no "
                 f"version 1 of {NAME} on this box", "its review was due on 2026-01-01"):
        assert said in flags, flags
    # The baseline was recorded: metrics purged since leave it as it was.
    with store._tx() as db:  # type: ignore[attr-defined]
        db.run("DELETE FROM slo_minutes")
    again = http.get("/review").json()["models"][0]
    assert again["baseline"]["ttft_p95"] == 100.0

    page = http.get("/console/review")
    assert page.status_code == 200 and "rollback target 1 is missing" in page.text


def test_a_model_in_order_has_no_finding_and_the_cli_exits_0(tmp_path: Path) -> None:
    from edge_agent.fleet.controller.store import SQLiteStore

    state = tmp_path / "state"
    repo = make_repo(tmp_path)
    gguf = write_tiny_gguf(tmp_path / "model.gguf")
    first = f"sha256:{repo.add(gguf, NAME, '1').sha256}"
    repo.add(gguf, NAME, "2", license="Apache-2.0", stage="production",
             materials=_materials(tmp_path, ["openai", "ollama", "schema", "tools",
                                             "long_context"], "2099-01-01"))
    store = SQLiteStore(state / "controller.db")
    now = time.time()
    _verify_answer(store, "d1", first, {"present": True, "verified": True, "loads": True,
                                        "detail": ""}, now)
    store.close()
    runner = CliRunner()
    shown = runner.invoke(main, ["fleet", "review", "--state-dir", str(state)])
    # Published, never rolled out: that is the one finding.
    assert shown.exit_code == 1 and "not rolled out" in shown.output, shown.output
    assert "rollback target 1: 1 of 1 box(es) asked have it intact" in shown.output
    as_json = json.loads(runner.invoke(main, ["fleet", "review", "--json", "--state-dir",
                                              str(state)]).stdout)
    assert as_json["models"][0]["flags"] == [
        "not rolled out: no completed rollout of this release"]
