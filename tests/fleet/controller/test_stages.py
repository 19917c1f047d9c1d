"""A release's stage and its materials, on a real release repository and controller app:
a production release is published only with every material (refused naming what is
missing, at `release add`, at a desk's `POST /releases`), its materials travel in the
signed targets metadata (read back through python-tuf's updater from the root), a rollout
is refused where the release lacks them or where its devices are outside the fleets its
stage may go to, and a release published before stages reads as an experiment."""

from __future__ import annotations

import hashlib
import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from fastapi.testclient import TestClient
from tuf.api.exceptions import DownloadHTTPError
from tuf.ngclient import FetcherInterface, Updater

from edge_agent.cli import main
from edge_agent.cli.fleet.release import STAGE_CHOICES
from edge_agent.config.controller import Ring
from edge_agent.errors import InvalidRequest
from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases import repository
from edge_agent.fleet.controller.releases.evaluation import results_summary, samples_summary
from edge_agent.fleet.controller.releases.push import file_target, next_targets
from edge_agent.fleet.controller.releases.repository import Upload, manifest_for
from edge_agent.fleet.controller.rings import Rings
from edge_agent.fleet.controller.store import SQLiteStore
from edge_agent.fleet.protocol.manifest import ReleaseManifest, target_path
from edge_agent.fleet.protocol.materials import STAGES
from tests.ggufgen import write_tiny_gguf
from tests.support.releasekit import Repo, make_repo

NAME = "simmodel:1b"
BOOT = "c" * 32
SAMPLES = [{"kind": ["openai", "tools"], "messages": []}, {"kind": "ollama", "prompt": "hi"},
           {"kind": ["openai", "schema"], "messages": []}]
RESULTS = {"accuracy": 0.93, "tool_calls_valid": 1.0, "samples": 3}


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return make_repo(tmp_path)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    samples = tmp_path / "eval.jsonl"
    samples.write_text("".join(json.dumps(s) + "\n" for s in SAMPLES) + "\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULTS))
    return {"gguf": write_tiny_gguf(tmp_path / "m.gguf"), "samples": samples,
            "results": results}


def _add(state: Path, files: dict[str, Path], version: str, *more: str) -> Result:
    return CliRunner().invoke(main, [
        "fleet", "release", "add", str(files["gguf"]), "--name", NAME, "--version", version,
        "--state-dir", str(state), *more])


def _production(files: dict[str, Path], *, leave_out: str = "") -> list[str]:
    """`release add`'s options for a production release, less the one named."""
    given = {"--license": "Apache-2.0", "--eval-samples": str(files["samples"]),
             "--eval-results": str(files["results"]), "--build": "llama.cpp b4500 Q4_K_M",
             "--route": "local", "--degradation": "simmodel:1b@1",
             "--rollback-target": "1", "--review-by": "2027-03-01"}
    given.pop(leave_out, None)
    return ["--stage", "production", *(x for kv in given.items() for x in kv)]


def test_the_stage_lists_agree() -> None:
    assert STAGES == ("experiment", "internal", "production")
    assert typing.get_args(Ring) == STAGES == STAGE_CHOICES


def test_a_production_release_without_its_materials_is_not_published(
        repo: Repo, files: dict[str, Path], tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert _add(state, files, "1").exit_code == 0  # an experiment: nothing asked of it
    result = _add(state, files, "2", *_production(files, leave_out="--rollback-target"))
    assert result.exit_code == 1, result.output
    assert f"{NAME}@2: a production release needs: rollback_target" in result.stderr
    result = _add(state, files, "2", "--stage", "production", "--license", "MIT")
    assert result.exit_code == 1
    assert ("a production release needs: eval_samples, eval_results, build, route, "
            "degradation, rollback_target, review_by") in result.stderr
    result = _add(state, files, "2", *_production(files), "--rollback-target", "9")
    assert result.exit_code == 1
    assert f"its rollback target 9 is not a published version of {NAME}" in result.stderr
    assert [(e.manifest.version, e.manifest.stage) for e in repo.repo.releases()] == [
        ("1", "experiment")]  # nothing of the refused ones


def test_a_production_release_carries_its_materials_in_the_signed_targets(
        repo: Repo, files: dict[str, Path], tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert _add(state, files, "1").exit_code == 0
    result = _add(state, files, "2", *_production(files), "--json")
    assert result.exit_code == 0, result.output
    custom = _verified_custom(repo, target_path(NAME, "2"), tmp_path / "tuf")
    assert custom["stage"] == "production" and custom["license"] == "Apache-2.0"
    materials = ReleaseManifest.from_custom(custom).materials
    samples = files["samples"].read_bytes()
    assert materials.eval_samples is not None
    assert materials.eval_samples.model_dump() == samples_summary(samples).model_dump()
    assert (materials.eval_samples.count, materials.eval_samples.kinds) == (
        3, ["ollama", "openai", "schema", "tools"])
    assert materials.eval_results is not None and materials.eval_results.metrics == RESULTS
    assert (materials.build, materials.route, materials.degradation,
            materials.rollback_target, materials.review_by) == (
        "llama.cpp b4500 Q4_K_M", "local", "simmodel:1b@1", "1", "2027-03-01")
    shown = CliRunner().invoke(main, ["fleet", "release", "show", f"{NAME}@2",
                                      "--state-dir", str(state)])
    assert "production" in shown.stdout and "3 (ollama, openai, schema, tools)" in shown.stdout


def test_evaluation_files_that_do_not_read_are_refused_naming_the_line() -> None:
    with pytest.raises(InvalidRequest, match="line 2: an object whose `kind`"):
        samples_summary(b'{"kind": "openai"}\n{"kind": "vision"}\n')
    with pytest.raises(InvalidRequest, match="no sample"):
        samples_summary(b"\n\n")
    nested = results_summary(b'{"runs": [{"accuracy": 0.9}]}', json_file=True)
    assert nested.metrics == {} and len(nested.sha256) == 64  # carried as its digest


def test_a_desk_cannot_push_a_production_release_without_its_materials(
        repo: Repo, tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "controller.db")
    try:
        token, _ = store.operators.create_operator("olivia", "operator", 1.0)
        http = TestClient(create_app(store, ControllerMetrics(store),
                                     state_dir=tmp_path / "state"))
        gguf = write_tiny_gguf(tmp_path / "m.gguf")
        manifest = manifest_for(gguf, name=NAME, version="2", license="MIT",
                                stage="production")
        entry = file_target(gguf, manifest)
        _upload(repo, gguf)
        md = next_targets(repo.repo._load().targets, entry, repo.keys.signer("targets"),
                          expires_s=86400)
        answer = http.post("/releases", json={"targets": md.to_dict()},
                           headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == (
            f"{NAME}@2: a production release needs: eval_samples, eval_results, build, "
            "route, degradation, rollback_target, review_by")
        assert repo.repo.releases() == []
    finally:
        store.close()


def test_a_release_published_before_stages_reads_as_an_experiment(
        repo: Repo, tmp_path: Path) -> None:
    old = _publish_as_before_stages(repo, tmp_path, "1")
    assert "stage" not in old and "materials" not in old  # as signed then
    entry = repo.repo.get(NAME, "1")
    assert entry.manifest.stage == "experiment"
    assert entry.manifest.materials.model_dump() == dict.fromkeys(
        ("eval_samples", "eval_results", "build", "route", "degradation",
         "rollback_target", "review_by"))
    custom = _verified_custom(repo, target_path(NAME, "1"), tmp_path / "tuf")
    assert ReleaseManifest.from_custom(custom).stage == "experiment"


# -- rollouts -------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    made = SQLiteStore(tmp_path / "state" / "controller.db")
    for fleet, device in (("lab", "lab-0"), ("shops", "shop-0"), ("shops", "shop-1")):
        made.birth(fleet, device, {"bdseq": 1, "boot_id": BOOT}, 1.0)
    yield made
    made.close()


def _api(store: SQLiteStore, tmp_path: Path) -> tuple[TestClient, dict[str, str]]:
    token, _ = store.operators.create_operator("alice", "operator", 1.0)
    app = create_app(store, ControllerMetrics(store), state_dir=tmp_path / "state",
                     rings=Rings({"lab": "experiment", "staff": "internal"},
                                 unlisted="production"))
    return TestClient(app), {"Authorization": f"Bearer {token}"}


def test_an_experiment_goes_only_to_the_fleets_of_its_ring(
        repo: Repo, files: dict[str, Path], store: SQLiteStore, tmp_path: Path) -> None:
    repo.add(files["gguf"], NAME, "1")
    http, auth = _api(store, tmp_path)
    refused = http.post("/rollouts", json={"release": f"{NAME}@1", "waves": "100%"},
                        headers=auth)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == (
        f"{NAME}@1 is an experiment release: it goes only to fleets of the experiment ring "
        "([stages] in the controller's settings); --devices 'all' reaches 2 device(s) "
        "outside them: shop-0 (fleet shops: production), shop-1 (fleet shops: production)")
    assert store.rollouts.rollouts() == []
    trail = store.audit.actions(operator="alice")
    assert [(a.action, a.status) for a in trail] == [("rollout.start", 409)]
    # The same words from the CLI on the controller host, its settings' [stages].
    config = tmp_path / "controller.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n[stages]\n'
                      'fleets = { lab = "experiment" }\nunlisted = "production"\n')
    result = CliRunner().invoke(main, ["fleet", "rollout", "start", f"{NAME}@1", "--waves",
                                       "100%", "--devices", "shop-*", "--config", str(config)])
    assert result.exit_code == 1
    assert "--devices 'shop-*' reaches 2 device(s) outside them: shop-0" in result.stderr
    started = http.post("/rollouts", json={"release": f"{NAME}@1", "waves": "100%",
                                           "devices": "fleet:lab"}, headers=auth)
    assert started.status_code == 201, started.text
    assert started.json()["devices_total"] == 1


def test_a_production_release_goes_anywhere_once_its_materials_are_complete(
        repo: Repo, files: dict[str, Path], store: SQLiteStore, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    assert _add(state, files, "1").exit_code == 0
    assert _add(state, files, "2", *_production(files)).exit_code == 0
    with monkeypatch.context() as before_the_rule:  # as an older controller published it
        before_the_rule.setattr(repository, "refusal", lambda *_: None)
        assert _add(state, files, "3", *_production(files, leave_out="--review-by"),
                    ).exit_code == 0
    http, auth = _api(store, tmp_path)
    refused = http.post("/rollouts", json={"release": f"{NAME}@3", "waves": "100%"},
                        headers=auth)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == f"{NAME}@3: a production release needs: review_by"
    started = http.post("/rollouts", json={"release": f"{NAME}@2", "waves": "100%"},
                        headers=auth)
    assert started.status_code == 201, started.text
    assert started.json()["devices_total"] == 3


# -- helpers --------------------------------------------------------------------------------


def _upload(repo: Repo, gguf: Path) -> None:
    data = gguf.read_bytes()
    up = Upload(repo.repo, hashlib.sha256(data).hexdigest(), len(data))
    up.write(data)
    up.finish()


def _publish_as_before_stages(repo: Repo, tmp_path: Path, version: str) -> dict[str, Any]:
    """A release signed as before stages existed: its manifest without either field."""
    gguf = write_tiny_gguf(tmp_path / f"old-{version}.gguf")
    entry = file_target(gguf, manifest_for(gguf, name=NAME, version=version))
    custom = entry.unrecognized_fields["custom"]
    del custom["stage"], custom["materials"]
    _upload(repo, gguf)
    md = next_targets(repo.repo._load().targets, entry, repo.keys.signer("targets"),
                      expires_s=86400)
    repo.repo.publish_signed(md, repo.keys)
    return dict(custom)


class _Files(FetcherInterface):
    """python-tuf's downloads read from the repository's folder, as a box would get them
    from its server."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _fetch(self, url: str) -> Iterator[bytes]:
        path = self.root / url.removeprefix("http://releases.test/")
        if not path.is_file():
            raise DownloadHTTPError(f"{url}: 404", 404)
        return iter([path.read_bytes()])


def _verified_custom(repo: Repo, path: str, work: Path) -> dict[str, Any]:
    """A target's `custom` as a box gets it: verified from the root, through timestamp,
    snapshot and targets (python-tuf's `Updater`)."""
    work.mkdir(exist_ok=True)
    updater = Updater(metadata_dir=str(work),
                      metadata_base_url="http://releases.test/metadata/",
                      fetcher=_Files(repo.repo.root), bootstrap=repo.root_file.read_bytes())
    updater.refresh()
    info = updater.get_targetinfo(path)
    assert info is not None, path
    return dict(info.custom)
