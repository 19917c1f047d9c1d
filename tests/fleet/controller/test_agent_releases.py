"""Agent releases on the controller: `fleet release add-agent` from a wheelhouse (its
manifest read from the wheels' names), listed apart from the models, and rolled out with
`fleet rollout start --agent VERSION` under the reserved name, through the API and the
CLI, with the refusals an operator meets."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from edge_agent.cli import main
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases.repository import ReleaseRepository, releases_dir
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.protocol.agent_release import AGENT_NAME
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import make_repo

WHEELS = ("edge_agent_appliance-0.2.0-py3-none-any.whl",
          "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl",
          "numpy-2.1.0-cp311-cp311-manylinux_2_17_x86_64.whl")


def wheelhouse(where: Path, names: tuple[str, ...] = WHEELS) -> Path:
    where.mkdir()
    for name in names:
        (where / name).write_bytes(name.encode() * 10)
    return where


def run(state: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["fleet", *args, "--state-dir", str(state)])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def state(tmp_path: Path) -> Path:
    make_repo(tmp_path).add(write_tiny_gguf(tmp_path / "m.gguf"), "simmodel:1b", "2")
    return tmp_path / "state"


@pytest.fixture
def store(state: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(state / "controller.db")
    for i in range(3):
        made.birth("f1", f"d{i}", {"bdseq": 1, "boot_id": "c" * 32}, 1.0)
    yield made
    made.close()


def test_a_wheelhouse_becomes_a_signed_agent_release_apart_from_the_models(
        state: Path, tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "house")
    code, out, err = run(state, "release", "add-agent", "0.2.0", "--wheelhouse", str(house),
                         "--build", "cpu:avx2", "--keys", str(tmp_path / "keys"), "--json")
    assert code == 0, err
    entry = json.loads(out)
    m = entry["manifest"]
    assert (m["kind"], m["version"], m["edge_agent"], m["llama_cpp_python"], m["build"],
            m["python"], m["abi"], m["platform"]) == (
        "agent", "0.2.0", "0.2.0", "0.3.36", "cpu:avx2", "cp311", "cp311", "linux_x86_64")
    assert m["requirement"] == "edge-agent-appliance[default-model]==0.2.0"
    assert entry["target"] == "agent/0.2.0/wheelhouse.tar"
    with tarfile.open(entry["blob"]) as tar:  # the wheels, flat, as the role copies them
        assert sorted(tar.getnames()) == sorted(WHEELS)
    repo = ReleaseRepository(releases_dir(state))
    assert [e.manifest.version for e in repo.agents()] == ["0.2.0"]
    assert [e.manifest.name for e in repo.releases()] == ["simmodel:1b"]  # models alone
    code, out, _ = run(state, "release", "agents")
    assert code == 0 and "0.2.0" in out and "cp311-cp311-linux_x86_64" in out
    code, _, err = run(state, "release", "add-agent", "0.2.0", "--wheelhouse", str(house),
                       "--keys", str(tmp_path / "keys"))
    assert code == 1 and "release edge-agent@0.2.0 exists" in err


@pytest.mark.parametrize(("names", "version", "said"), [
    (WHEELS, "0.3.0", "its edge-agent-appliance wheel is version 0.2.0, not 0.3.0"),
    (WHEELS[:1], "0.2.0", "no llama-cpp-python wheel"),
    (WHEELS[1:], "0.2.0", "no edge-agent-appliance wheel"),
])
def test_a_wheelhouse_that_is_not_the_release_is_refused_naming_what(
        state: Path, tmp_path: Path, names: tuple[str, ...], version: str, said: str) -> None:
    house = wheelhouse(tmp_path / "house", names)
    code, _, err = run(state, "release", "add-agent", version, "--wheelhouse", str(house),
                       "--keys", str(tmp_path / "keys"))
    assert code != 0 and said in err, err


def test_an_agent_rollout_starts_under_the_reserved_name(
        state: Path, tmp_path: Path, store: SQLiteStore) -> None:
    house = wheelhouse(tmp_path / "house")
    assert run(state, "release", "add-agent", "0.2.0", "--wheelhouse", str(house),
               "--keys", str(tmp_path / "keys"))[0] == 0
    api = TestClient(create_app(store, ControllerMetrics(store), state_dir=state))
    token, _ = store.operators.create_operator("alice", "operator", 1.0)
    auth = {"Authorization": f"Bearer {token}"}
    missing = api.post("/rollouts", json={"agent": "0.9.0", "waves": "1,100%"}, headers=auth)
    assert missing.status_code == 404 and "no agent release 0.9.0" in missing.text
    both = api.post("/rollouts", json={"agent": "0.2.0", "release": "simmodel:1b@2",
                                       "waves": "100%"}, headers=auth)
    assert both.status_code == 400 and "one of the two" in both.text
    made = api.post("/rollouts", json={"agent": "0.2.0", "waves": "1,100%", "id": "ag-1"},
                    headers=auth)
    assert made.status_code == 201, made.text
    record = made.json()
    assert (record["name"], record["version"], record["devices_total"]) == (
        AGENT_NAME, "0.2.0", 3)
    # One agent rollout at a time, as one per model name.
    code, _, err = run(state, "rollout", "start", "--agent", "0.2.0", "--waves", "100%")
    assert code == 1 and "one live rollout per model name" in err, err
    code, _, err = run(state, "rollout", "start", "--waves", "100%")
    assert code == 2 and "NAME@VERSION or --agent VERSION" in err
    code, _, err = run(state, "rollout", "start", "edge-agent@0.2.0", "--waves", "100%")
    assert code != 0 and "--agent 0.2.0" in err, err


def test_no_model_may_be_published_under_the_agents_name(state: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "x.gguf")
    code, _, err = run(state, "release", "add", str(gguf), "--name", "edge-agent",
                       "--version", "1", "--keys", str(tmp_path / "keys"))
    assert code != 0 and "the name agent releases roll out under" in err, err
