"""The release routes (`release_api`) in the controller's app: a release signed elsewhere,
its file uploaded by content, then its targets; everything a desk could get wrong, or a
hostile caller could send, refused in one shape with nothing half-published, and every
attempt on the audit trail."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tuf.api.metadata import Metadata, Targets

from edge_agent.fleet.controller.api import create_app
from edge_agent.fleet.controller.metrics import ControllerMetrics
from edge_agent.fleet.controller.releases.push import file_target, next_targets
from edge_agent.fleet.controller.releases.repository import manifest_for
from edge_agent.fleet.controller.releases.signing_keys import KeyDir
from edge_agent.fleet.controller.store import SQLiteStore
from tests.support.releasekit import Repo, make_repo, sized_gguf


class Desk:
    """A controller app whose keys dir holds no targets key (moved to the desk), and the
    desk's side: build, sign, upload, publish."""

    def __init__(self, tmp_path: Path) -> None:
        self.repo: Repo = make_repo(tmp_path)
        desk = tmp_path / "desk-keys"
        desk.mkdir()
        for name in ("targets.pem", "targets.pub.pem"):
            shutil.copy(self.repo.keys.path / name, desk / name)
        (self.repo.keys.path / "targets.pem").unlink()  # the controller cannot sign one
        self.keys = KeyDir(desk)
        self.store = SQLiteStore(tmp_path / "controller.db")
        self.tokens = {role: self.store.operators.create_operator(f"{role}-1", role, 1.0)[0]
                       for role in ("viewer", "operator")}
        self.http = TestClient(create_app(self.store, ControllerMetrics(self.store),
                                          state_dir=tmp_path / "state", loopback=False))
        self.tmp = tmp_path

    def auth(self, role: str = "operator") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def targets(self) -> Metadata[Targets]:
        return self.repo.repo._load().targets

    def release(self, name: str, version: str, *, seed: int = 0
                ) -> tuple[Path, Any]:
        gguf = sized_gguf(self.tmp / f"{name.replace(':', '-')}-{version}.gguf", 0.05,
                          seed=seed)
        return gguf, file_target(gguf, manifest_for(gguf, name=name, version=version))

    def upload(self, gguf: Path, sha256: str | None = None, role: str = "operator") -> Any:
        data = gguf.read_bytes()
        return self.http.put(f"/release-files/{sha256 or hashlib.sha256(data).hexdigest()}",
                             content=data, headers=self.auth(role))

    def publish(self, md: Metadata[Targets] | dict[str, Any], role: str = "operator") -> Any:
        body = md if isinstance(md, dict) else md.to_dict()
        return self.http.post("/releases", json={"targets": body}, headers=self.auth(role))

    def signed(self, entry: Any, **kw: Any) -> Metadata[Targets]:
        return next_targets(self.targets(), entry, self.keys.signer("targets"),
                            expires_s=kw.pop("expires_s", 86400))

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def desk(tmp_path: Path) -> Iterator[Desk]:
    made = Desk(tmp_path)
    yield made
    made.close()


def test_a_release_signed_at_the_desk_is_published_with_snapshot_and_timestamp_resigned(
        desk: Desk) -> None:
    before = desk.repo.repo.status()
    gguf, entry = desk.release("simmodel:1b", "2")
    first = desk.upload(gguf)
    assert first.status_code == 201 and first.json()["stored"] is True
    again = desk.upload(gguf)  # the same bytes: kept once
    assert again.status_code == 200 and again.json()["stored"] is False
    answer = desk.publish(desk.signed(entry))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["targets_version"] == before["targets"]["version"] + 1
    assert [(r["name"], r["version"], r["sha256"]) for r in body["releases"]] == [
        ("simmodel:1b", "2", entry.hashes["sha256"])]
    listed = desk.repo.repo.get("simmodel:1b", "2")
    assert listed.blob.read_bytes() == gguf.read_bytes()
    after = desk.repo.repo.status()
    for role in ("targets", "snapshot", "timestamp"):
        assert after[role]["version"] == before[role]["version"] + 1, role
    assert not any((desk.repo.repo.root / "incoming").iterdir())  # moved in, nothing left
    # What a box reads: the chain from root, as published.
    assert desk.targets().signed.targets[entry.path] == entry
    trail = [(a.operator, a.action, a.status, a.target) for a in desk.store.audit.actions()]
    assert trail == [("operator-1", "release.upload", 200, entry.hashes["sha256"]),
                     ("operator-1", "release.upload", 200, entry.hashes["sha256"]),
                     ("operator-1", "release.publish", 200, "simmodel:1b@2")]


def test_an_upload_that_is_not_what_it_claims_is_refused_and_nothing_is_kept(
        desk: Desk) -> None:
    gguf, _ = desk.release("simmodel:1b", "2")
    wrong = desk.upload(gguf, sha256="0" * 64)
    assert wrong.status_code == 400 and "sha256 is" in wrong.json()["error"]
    notgguf = desk.tmp / "notes.txt"
    notgguf.write_bytes(b"hello, not a model\n" * 100)
    refused = desk.upload(notgguf)
    assert refused.status_code == 400 and "not a release file" in refused.json()["error"]
    bad_name = desk.http.put("/release-files/ABC", content=b"x", headers=desk.auth())
    assert bad_name.status_code == 400 and "is not a sha256" in bad_name.json()["error"]
    viewer = desk.upload(gguf, role="viewer")
    assert viewer.status_code == 403 and set(viewer.json()) == {"error"}
    assert list((desk.repo.repo.root / "incoming").iterdir()) == []
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    trail = [(a.action, a.status) for a in desk.store.audit.actions()]
    assert trail == [("release.upload", 400)] * 3 + [(f"PUT /release-files/{sha}", 403)]


def test_targets_the_repository_cannot_take_are_refused_naming_why(desk: Desk) -> None:
    gguf, entry = desk.release("simmodel:1b", "2")
    assert desk.upload(gguf).status_code == 201
    version = desk.targets().signed.version

    def refused(md: Metadata[Targets] | dict[str, Any], status: int, words: str) -> None:
        answer = desk.publish(md)
        assert answer.status_code == status, answer.text
        assert set(answer.json()) == {"error"} and words in answer.json()["error"], answer.text
        assert desk.targets().signed.version == version  # nothing published

    # Signed by a key root does not trust for targets (the snapshot key, say).
    forged = desk.signed(entry)
    forged.signatures.clear()
    forged.sign(desk.repo.keys.signer("snapshot"))
    refused(forged, 400, "not signed by the targets key(s) of root v1")
    # Signed, then changed: the signature no longer covers it.
    tampered = desk.signed(entry)
    tampered.signed.targets[entry.path].length += 1
    refused(tampered, 400, "not signed by the targets key(s)")
    # Not the next version: another push came first.
    stale = desk.signed(entry)
    stale.signed.version += 1
    stale.signatures.clear()
    stale.sign(desk.keys.signer("targets"))
    refused(stale, 409, f"the repository's next is {version + 1}")
    refused(desk.signed(entry, expires_s=-60), 400, "expired already")
    # A file never uploaded.
    other, other_entry = desk.release("simmodel:1b", "3", seed=1)
    refused(desk.signed(other_entry), 400, "was not uploaded: PUT /release-files/")
    # Not metadata at all, or the wrong role.
    refused({"signed": {"_type": "targets"}, "signatures": []}, 400, "not TUF targets")
    refused({"signed": [], "signatures": "x"}, 400, "not TUF targets")
    snapshot = json.loads((desk.repo.repo.metadata / "1.snapshot.json").read_text())
    refused(snapshot, 400, "")
    assert desk.http.post("/releases", content=b"{", headers={
        **desk.auth(), "content-type": "application/json"}).status_code == 400
    # Everything published stays as it was.
    assert desk.publish(desk.signed(entry)).status_code == 200
    version += 1
    dropped = next_targets(desk.targets(), other_entry, desk.keys.signer("targets"),
                           expires_s=86400)
    del dropped.signed.targets[entry.path]
    dropped.signatures.clear()
    dropped.sign(desk.keys.signer("targets"))
    assert desk.upload(other).status_code == 201
    refused(dropped, 409, "a release never changes")
    changed = desk.signed(other_entry)
    changed.signed.targets[entry.path].unrecognized_fields["custom"]["tier"] = "stable"
    changed.signatures.clear()
    changed.sign(desk.keys.signer("targets"))
    refused(changed, 409, "change or drop the release simmodel/1b/2")
    nothing = desk.signed(other_entry)
    del nothing.signed.targets[other_entry.path]
    nothing.signatures.clear()
    nothing.sign(desk.keys.signer("targets"))
    refused(nothing, 400, "add no release")
    assert desk.publish(desk.signed(other_entry), role="viewer").status_code == 403
    statuses = [a.status for a in desk.store.audit.actions() if a.action == "release.publish"]
    assert 500 not in statuses and statuses.count(200) == 1


def test_without_its_snapshot_and_timestamp_keys_the_controller_publishes_nothing(
        desk: Desk) -> None:
    gguf, entry = desk.release("simmodel:1b", "2")
    assert desk.upload(gguf).status_code == 201
    (desk.repo.keys.path / "timestamp.pem").unlink()
    answer = desk.publish(desk.signed(entry))
    assert answer.status_code == 503 and "cannot re-sign snapshot and timestamp" in \
        answer.json()["error"]
    assert entry.path not in desk.targets().signed.targets


def test_an_upload_past_the_free_space_or_without_a_length_is_refused_before_it_is_read(
        desk: Desk) -> None:
    sha = "a" * 64
    huge = desk.http.put(f"/release-files/{sha}", headers={
        **desk.auth(), "content-length": str(200 << 30)}, content=b"")
    assert huge.status_code == 413, huge.text
    assert "do not fit" in huge.json()["error"] or "at most" in huge.json()["error"]
    over = desk.http.put(f"/release-files/{sha}", headers={
        **desk.auth(), "content-length": str(300 << 30)}, content=b"")
    assert over.status_code == 413 and "at most" in over.json()["error"]
