"""ModelOps and models.db: versions of a name, the active pointer and its history, rollback,
retention, copy, remove, the upgrade of a state dir that only has manifests, and a pointer
that survives a process killed mid-switch. Tiny GGUFs only: no model is loaded here."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_agent.config import ConfigError, load_settings
from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.models.entries import ManifestExtras
from edge_agent.errors import (
    Conflict,
    InvalidRequest,
    ModelFileError,
    ModelNotFound,
    ServiceUnavailable,
)
from tests.ggufgen import write_tiny_gguf

NAME = "m:1"


def _ggufs(tmp_path: Path, n: int) -> list[Path]:
    """`n` tiny GGUFs with different digests (their context lengths differ)."""
    return [write_tiny_gguf(tmp_path / f"v{i}.gguf", context_length=256 + i)
            for i in range(n)]


def _ops(tmp_path: Path, keep_previous: int = 1, **kwargs: object) -> ModelOps:
    return ModelOps(ModelStore(tmp_path / "state", keep_previous=keep_previous),
                    **kwargs)  # type: ignore[arg-type]


def _blob(ops: ModelOps, digest: str) -> Path:
    return ops.store.blobs / f"sha256-{digest}"


def test_a_new_file_under_a_name_is_a_new_version_that_becomes_active(tmp_path: Path
                                                                      ) -> None:
    a, b, c = _ggufs(tmp_path, 3)
    ops = _ops(tmp_path)
    first = ops.import_file(a, NAME, by="cli:ann")
    second = ops.import_file(b, NAME, by="cli:ann")
    assert first.digest != second.digest
    assert ops.show(NAME).digest == second.digest  # as Ollama: pulling replaces
    assert [(v.digest, v.active) for v in ops.versions(NAME)] == [
        (second.digest, True), (first.digest, False)]
    assert [m.name for m in ops.installed()] == [NAME]  # one row per name
    pending = ops.import_file(c, NAME, by="cli:ann", activate=False)
    assert ops.show(NAME).digest == second.digest
    assert [v.digest for v in ops.versions(NAME)][-1] == pending.digest
    since, by = ops.active_since(NAME)
    assert by == "cli:ann" and since <= time.time()
    actions = [(h.action, h.digest, h.previous) for h in ops.history(NAME)]
    assert actions[:3] == [("install", pending.digest, None),
                           ("activate", second.digest, first.digest),
                           ("install", second.digest, None)]
    assert {h.by for h in ops.history(NAME)} == {"cli:ann"}
    # The manifest mirror holds the active version.
    mirror = json.loads((tmp_path / "state" / "manifests" / "m%3A1.json").read_text())
    assert mirror["digest"] == second.digest


def test_activate_takes_a_unique_prefix_and_refuses_what_is_not_installed(tmp_path: Path
                                                                          ) -> None:
    a, b, c = _ggufs(tmp_path, 3)
    ops = _ops(tmp_path)
    old = ops.import_file(a, NAME, by="x")
    new = ops.import_file(b, NAME, by="x")
    other = ops.import_file(c, "other:1", by="x")
    assert ops.activate(NAME, old.digest[:12], by="cli:bob").digest == old.digest
    assert ops.store.get(NAME).digest == old.digest
    assert ops.activate(NAME, f"sha256:{new.digest}", by="rollout:r1").digest == new.digest
    assert ops.history(NAME)[0].by == "rollout:r1"
    count = len(ops.history(NAME))
    ops.activate(NAME, new.digest, by="again")  # already active: nothing recorded
    assert len(ops.history(NAME)) == count
    with pytest.raises(InvalidRequest, match="at least 12"):
        ops.activate(NAME, old.digest[:8], by="x")
    with pytest.raises(ModelNotFound, match="no installed version") as err:
        ops.activate(NAME, other.digest, by="x")  # installed, but for another name
    assert old.digest[:12] in err.value.message and err.value.param == "digest"
    with pytest.raises(ModelNotFound):
        ops.activate("nope:1", old.digest, by="x")
    with pytest.raises(InvalidRequest):
        ops.activate(NAME, "z" * 64, by="x")


def test_rollback_restores_the_previous_digest(tmp_path: Path) -> None:
    a, b = _ggufs(tmp_path, 2)
    ops = _ops(tmp_path)
    old = ops.import_file(a, NAME, by="x")
    with pytest.raises(Conflict, match="no earlier version"):
        ops.rollback(NAME, by="x")
    new = ops.import_file(b, NAME, by="x")
    back = ops.rollback(NAME, by="cli:ann")
    assert back.digest == old.digest == ops.show(NAME).digest
    last = ops.history(NAME)[0]
    assert (last.action, last.digest, last.previous, last.by) == (
        "rollback", old.digest, new.digest, "cli:ann")
    assert ops.rollback(NAME, by="x").digest == new.digest  # and forward again
    with pytest.raises(ModelNotFound):
        ops.rollback("nope:1", by="x")


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_retention_keeps_the_most_recently_active_and_pending_versions(
        tmp_path: Path, keep: int) -> None:
    files = _ggufs(tmp_path, 5)
    ops = _ops(tmp_path, keep_previous=keep)
    digests = [ops.import_file(f, NAME, by="x").digest for f in files[:4]]
    pending = ops.import_file(files[4], NAME, by="x", activate=False).digest
    kept = [v.digest for v in ops.versions(NAME)]
    assert kept == [digests[3], *digests[2::-1][:keep], pending]
    for d in digests[:3 - keep]:
        assert not _blob(ops, d).exists()
    removals = [h for h in ops.history(NAME) if h.action == "remove"]
    assert {h.digest for h in removals} == set(digests[:3 - keep])
    assert all("keep_previous" in h.detail for h in removals)
    assert _blob(ops, pending).exists()


def test_remove_a_version_or_a_name_and_blobs_only_when_unreferenced(tmp_path: Path
                                                                     ) -> None:
    a, b = _ggufs(tmp_path, 2)
    ops = _ops(tmp_path, default_model="keep:1")
    old = ops.import_file(a, NAME, by="x")
    new = ops.import_file(b, NAME, by="x")
    ops.copy(NAME, "keep:1", by="x")  # the default model shares the new blob
    with pytest.raises(Conflict, match="active version"):
        ops.remove(NAME, new.digest, by="x")
    assert ops.remove(NAME, old.digest[:12], by="cli:ann").digest == old.digest
    assert not _blob(ops, old.digest).exists()
    assert [v.digest for v in ops.versions(NAME)] == [new.digest]
    with pytest.raises(ModelNotFound):
        ops.remove(NAME, old.digest, by="x")
    with pytest.raises(InvalidRequest, match="default model"):
        ops.remove("keep:1", by="x")
    ops.remove(NAME, by="x")
    assert _blob(ops, new.digest).exists()  # keep:1 still uses it
    assert not ops.is_installed(NAME)
    assert not (tmp_path / "state" / "manifests" / "m%3A1.json").exists()
    with pytest.raises(ModelNotFound):
        ops.versions(NAME)
    assert ops.history(NAME)[0].action == "remove"  # the history outlives the name
    with pytest.raises(ModelNotFound):
        ops.remove("nope:1", by="x")


def test_copy_makes_a_second_name_for_the_same_digest(tmp_path: Path) -> None:
    a, b = _ggufs(tmp_path, 2)
    ops = _ops(tmp_path)
    src = ops.import_file(a, NAME, by="x")
    copy = ops.copy(NAME, "other", by="operator:ops")
    assert (copy.name, copy.digest) == ("other:latest", src.digest)
    assert ops.show("other").digest == src.digest
    assert [h.action for h in ops.history("other")] == ["activate", "copy"]
    assert ops.history("other")[1].detail == f"from {NAME}"
    # A copy over an installed name switches it, keeping its old version for a rollback.
    other = ops.import_file(b, "third:1", by="x")
    ops.copy(NAME, "third:1", by="x")
    assert ops.show("third:1").digest == src.digest
    assert ops.rollback("third:1", by="x").digest == other.digest
    ops.remove(NAME, by="x")
    assert ops.show("other").digest == src.digest and _blob(ops, src.digest).exists()
    with pytest.raises(ModelNotFound):
        ops.copy("nope:1", "x:1", by="x")
    with pytest.raises(InvalidRequest):
        ops.copy("other", "bad name!", by="x")


def test_install_verified_checks_the_digest_and_stays_inactive(tmp_path: Path) -> None:
    a, b = _ggufs(tmp_path, 2)
    ops = _ops(tmp_path)
    current = ops.import_file(a, NAME, by="x")
    good = ModelStore(tmp_path / "probe").import_file(b, "p:1")  # its digest and size
    with pytest.raises(ModelFileError, match="expected"):
        ops.install_verified(b, NAME, "0" * 64, by="rollout:r2")
    with pytest.raises(ModelFileError, match="bytes, expected"):
        ops.install_verified(b, NAME, good.digest, expected_size=good.size + 1, by="x")
    with pytest.raises(InvalidRequest):
        ops.install_verified(b, NAME, "abc", by="x")
    assert [v.digest for v in ops.versions(NAME)] == [current.digest]
    assert not list(ops.store.blobs.glob(".incoming-*"))
    staged = ops.install_verified(b, NAME, f"sha256:{good.digest}", expected_size=good.size,
                                  extras=ManifestExtras(family="tiny", license="MIT"),
                                  origin="rollout:r2", by="rollout:r2")
    assert (staged.family, staged.license, staged.origin) == ("tiny", "MIT", "rollout:r2")
    assert ops.show(NAME).digest == current.digest  # installed, not active
    assert ops.activate(NAME, staged.digest, by="rollout:r2").family == "tiny"


def test_verify_checks_every_version(tmp_path: Path) -> None:
    a, b = _ggufs(tmp_path, 2)
    ops = _ops(tmp_path)
    old = ops.import_file(a, NAME, by="x")
    ops.import_file(b, NAME, by="x")
    assert [r.error for r in ops.verify()] == [None, None]
    blob = _blob(ops, old.digest)
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x01")
    results = ops.verify(NAME)
    assert [(r.active, r.error is None) for r in results] == [(True, True), (False, False)]
    assert "digest" in (results[1].error or "")


def test_load_and_unload_need_a_loader(tmp_path: Path) -> None:
    (a,) = _ggufs(tmp_path, 1)
    ops = _ops(tmp_path)
    ops.import_file(a, NAME, by="x")
    with pytest.raises(ServiceUnavailable, match="needs the server"):
        asyncio.run(ops.load(NAME))
    with pytest.raises(ServiceUnavailable, match="needs the server"):
        asyncio.run(ops.unload(NAME))
    assert ops.loaded() == []
    ops.remove(NAME, by="x")  # offline: nothing to ask the loader


def test_a_state_dir_with_only_manifests_is_upgraded_once(tmp_path: Path) -> None:
    a, b = _ggufs(tmp_path, 2)
    old_state = tmp_path / "old"
    legacy = ModelStore(old_state)
    one, two = legacy.import_file(a, NAME), legacy.import_file(b, "two:1")
    legacy.close()
    (old_state / "models.db").unlink()  # as a box from before the database has it
    for extra in old_state.glob("models.db-*"):
        extra.unlink()
    (old_state / "manifests" / "junk.json").write_text("{not json")
    ops = ModelOps(ModelStore(old_state))
    assert [(m.name, m.digest) for m in ops.installed()] == [
        (NAME, one.digest), ("two:1", two.digest)]
    assert [(h.action, h.by) for h in ops.history(NAME)] == [("activate", "upgrade"),
                                                             ("install", "upgrade")]
    again = ModelOps(ModelStore(old_state))  # idempotent
    assert len(again.history(NAME)) == 2
    # A manifest written by an older tool after the upgrade is taken in on the next open.
    copy = one.model_copy(update={"name": "late:1"})
    (old_state / "manifests" / "late%3A1.json").write_text(copy.model_dump_json())
    assert ModelOps(ModelStore(old_state)).show("late:1").digest == one.digest


def test_an_empty_state_dir_is_not_written_by_reading(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    assert ops.installed() == [] and not ops.is_installed(NAME)
    with pytest.raises(ModelNotFound):
        ops.show(NAME)
    assert not (tmp_path / "state").exists()


def test_keep_previous_sits_beside_the_per_model_tables(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[models]\nkeep_previous = 3\n[models."gemma3:270m"]\nthreads = 1\n')
    s = load_settings(cfg)
    assert s.models.keep_previous == 3 and s.model_override("gemma3:270m").threads == 1
    assert load_settings(None).models.keep_previous == 1
    cfg.write_text("[models]\nkeep_previous = -1\n")
    with pytest.raises(ConfigError, match="models.keep_previous"):
        load_settings(cfg)
    cfg.write_text("[models]\nkeep_prevous = 2\n")
    with pytest.raises(ConfigError, match="neither keep_previous nor a table"):
        load_settings(cfg)


_SWITCHER = """
import sys
from pathlib import Path
from edge_agent.engine.models.catalog import ModelStore
store = ModelStore(Path(sys.argv[1]))
a, b = sys.argv[2], sys.argv[3]
store.activate("m:1", a, by="loop")
print("switching", flush=True)
while True:
    store.activate("m:1", b, by="loop")
    store.activate("m:1", a, by="loop")
"""


def test_the_pointer_survives_a_kill_9_mid_switch(tmp_path: Path) -> None:
    a, b = _ggufs(tmp_path, 2)
    state = tmp_path / "state"
    store = ModelStore(state)
    digests = {store.import_file(a, NAME).digest, store.import_file(b, NAME).digest}
    store.close()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = random.Random(7)
    switches = []
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", _SWITCHER, str(state), *digests],
                                 stdout=subprocess.PIPE, env=env)
        assert child.stdout is not None and child.stdout.readline() == b"switching\n"
        time.sleep(rng.uniform(0.02, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait()
        db = sqlite3.connect(state / "models.db")
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.close()
        reopened = ModelStore(state)
        active = reopened.get(NAME).digest
        assert active in digests
        assert {v.digest for v in reopened.versions(NAME)} == digests  # nothing lost
        mirror = json.loads((state / "manifests" / "m%3A1.json").read_text())
        assert mirror["digest"] == active  # a stale mirror is put right on opening
        assert not list((state / "manifests").glob(".manifest-*"))
        switches.append(len(reopened.history(NAME)))
        reopened.close()
    assert switches == sorted(switches) and switches[-1] > switches[0]


def test_modelops_imports_neither_the_scheduler_nor_llama_cpp() -> None:
    """The fleet link imports ModelOps in processes that never load a model."""
    code = ("import sys, edge_agent.engine.modelops; "
            "print(sorted(m for m in sys.modules if m in ('llama_cpp', "
            "'edge_agent.engine.scheduling.scheduler', 'edge_agent.engine.runtime.llama', "
            "'edge_agent.engine.registry')))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_doctor_checks_the_versions_kept_beside_the_active_one(tmp_path: Path) -> None:
    from edge_agent.doctor import run_checks

    a, b = _ggufs(tmp_path, 2)
    ops = _ops(tmp_path)
    old = ops.import_file(a, NAME, by="x")
    ops.import_file(b, NAME, by="x")
    settings = load_settings(None, state_dir=tmp_path / "state")
    kept = f"model {NAME}@{old.digest[:12]}"
    checks = {c.name: c for c in run_checks(settings)}
    assert checks[f"model {NAME}"].status == "ok" and checks[kept].status == "ok"
    assert "kept for rollback" in checks[kept].detail
    blob = _blob(ops, old.digest)
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x01")
    checks = {c.name: c for c in run_checks(settings)}
    assert checks[kept].status == "warn" and "digest" in checks[kept].detail
