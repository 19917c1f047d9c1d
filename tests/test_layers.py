"""The layer rule (pyproject's import-linter contracts) holds, and a break of it fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=where, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "edge_agent", tmp_path / "edge_agent",
                    ignore=shutil.ignore_patterns("__pycache__", "catalog_models"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_code_keeps_every_contract() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    # the engine reaching up into the request path
    ("engine/prompt.py", "import edge_agent.gateway.limits", "engine/governance/ledger"),
    # a store reaching into the HTTP layer
    ("ledger/store.py", "import edge_agent.api.errors", "know nothing of the request path"),
    # the engine reading tenants' policy itself (a sibling, but not the engine's business)
    ("engine/registry.py", "import edge_agent.governance.tenants", "imports only config"),
    # two packages of the wiring layer tied together
    ("doctor.py", "import edge_agent.bench.run", "cli -> app"),
    # the fleet link reaching the scheduler, here through the registry (indirect counts)
    ("fleet/protocol/topics.py", "import edge_agent.engine.registry", "never the scheduler"),
    # the wire reaching into one side of it
    ("fleet/protocol/envelope.py", "import edge_agent.fleet.device.link.outbox",
     "sim -> controller | device -> protocol"),
    # the controller borrowing a fact from the box's modules instead of the protocol
    ("fleet/controller/waves.py", "import edge_agent.fleet.device.rollout.store",
     "sim -> controller | device -> protocol"),
    # the box using the simulator
    ("fleet/device/link/link.py", "import edge_agent.fleet.sim.testbed",
     "sim -> controller | device -> protocol"),
    # the serving path pulling in the simulator
    ("server.py", "import edge_agent.fleet.sim.testbed", "never imports the fleet simulator"),
    # a store reporting to the fleet itself
    ("telemetry/metrics.py", "import edge_agent.fleet.protocol.topics",
     "know nothing of the request"),
    # the bottom importing the top
    ("config/__init__.py", "import edge_agent.cli", "cli -> app"),
])
def test_a_broken_contract_fails(copy: Path, module: str, line: str, contract: str) -> None:
    path = copy / "edge_agent" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    result = _lint(copy)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts")[-1]
    assert contract in broken, result.stdout
