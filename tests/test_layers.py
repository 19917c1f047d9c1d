"""The layer rule (pyproject's import-linter contracts) holds, and a break of it fails."""

from __future__ import annotations

import ast
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
    ("doctor.py", "import edge_agent.bench.serving.run", "cli -> app"),
    # the fleet link reaching the scheduler, here through the registry (indirect counts)
    ("fleet/protocol/topics.py", "import edge_agent.engine.registry", "never the scheduler"),
    # the fleet building grammars itself, reaching past ModelOps into constrained decoding
    ("fleet/device/link/handlers.py", "import edge_agent.engine.constrained.json_grammar",
     "never the scheduler"),
    # a lower room of the engine reaching up: constrained decoding into the scheduler
    ("engine/constrained/json_grammar.py", "import edge_agent.engine.scheduling.admission",
     "the engine's rooms"),
    # the scheduler reading the model store (below it, but not its business)
    ("engine/scheduling/admission.py", "import edge_agent.engine.models.entries",
     "never touch the model store"),
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
    # the OpenAI dialect's serving reaching up into its routes
    ("api/openai/serving.py", "import edge_agent.api.openai.routes",
     "the OpenAI dialect's rooms"),
    # the batch runner taking an HTTP request again (a direct import is enough)
    ("api/openai/batch_runner.py", "import starlette.requests",
     "OpenAI serving, the Batch API's resources"),
    # the controller's rollout queries reaching the engine that sits above the store
    ("fleet/controller/rollout_queries.py", "import edge_agent.fleet.controller.rollouts.driver",
     "never reach rollouts/"),
    # one kind of release borrowing from the other instead of from activation
    ("fleet/device/rollout/capacity_release.py",
     "import edge_agent.fleet.device.rollout.model_release", "share only activation"),
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


def circles(package: Path) -> list[list[str]]:
    """The package's import circles: modules that reach themselves through their imports,
    those under `if TYPE_CHECKING:` included (a circle a type hides still ties the modules
    together). Each circle once, as its sorted module names."""
    modules = {".".join(p.relative_to(package.parent).with_suffix("").parts)
               .removesuffix(".__init__"): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    whole = f"{node.module}.{alias.name}"
                    target = whole if whole in modules else node.module
                    if target in modules:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
    reach = {m: _reached(graph, m) for m in graph}
    found: list[list[str]] = []
    for name in sorted(graph):
        # What `name` reaches and what reaches it back: its circle (itself alone: none).
        circle = sorted(m for m in reach[name] if name in reach[m])
        if len(circle) > 1 and circle not in found:
            found.append(circle)
    return found


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    reach, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()] - reach:
            reach.add(nxt)
            todo.append(nxt)
    return reach


def test_the_package_has_no_import_circles() -> None:
    assert circles(ROOT / "edge_agent") == []


def test_an_import_circle_is_found(copy: Path) -> None:
    # The store's shared type importing the store back, as it once sat inside it.
    path = copy / "edge_agent" / "fleet" / "controller" / "transaction.py"
    path.write_text(path.read_text() + "\nif TYPE_CHECKING:\n"
                    "    from edge_agent.fleet.controller.sql import SQLStore\n")
    found = circles(copy / "edge_agent")
    assert any({"edge_agent.fleet.controller.sql", "edge_agent.fleet.controller.transaction"}
               <= set(c) for c in found), found


def test_the_engines_request_types_name_no_request_path_policy() -> None:
    """How the request path treats a request (`gateway.controls.Controls`) travels beside
    the engine's request types, never on them: nothing below the request path can act on
    a tier, a deadline or an end user it was handed."""
    from edge_agent.engine.request import EmbeddingRequest, GenerationRequest
    from edge_agent.gateway.controls import Controls

    policy = set(fields_of(Controls)) - {"draft"}  # draft tokens: asked of the model too
    for kind in (GenerationRequest, EmbeddingRequest):
        assert not policy & set(fields_of(kind)), kind.__name__


def fields_of(kind: type) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(kind)]
