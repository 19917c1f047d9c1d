"""`model.verify` on a real model store: a release's version found by what installed it (the
store's origin) or by what a rollout recorded, its blob checked for presence, sha256 and
GGUF header; a version the box lacks is an answer, not an error; args off the schema are
refused `malformed`; and the same through a real broker, link and controller ingest."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edge_agent.engine.modelops import ModelOps
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.fleet.device.link.command_gate import Handler
from edge_agent.fleet.device.release.source import release_origin
from edge_agent.fleet.device.rollout.model_verify import model_verify_handler
from edge_agent.fleet.device.rollout.store import RolloutStore
from edge_agent.fleet.protocol.command import Command
from edge_agent.fleet.protocol.command_types import ModelVerified
from edge_agent.fleet.protocol.refusals import MALFORMED, CommandRefused
from edge_agent.fleet.protocol.rollout_states import (
    ACTIVATING,
    ACTIVE,
    CANCELLED,
    DOWNLOADING,
    GATING,
    STAGED,
    VERIFYING,
)
from edge_agent.names import ModelName
from tests.ggufgen import write_tiny_gguf
from tests.support.brokers import Mosquitto
from tests.support.commandbox import CommandBox

NAME = "gemma3:270m"


def _command(args: dict[str, Any]) -> Command:
    now = time.time()
    return Command("c" * 32, "f1", "store-1", "model.verify", 1, now, now + 60, args,
                   "store-1", b"")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Box:
    """A box's model store with the history a rollback target has: version 1 installed by
    its release and then replaced by version 2's rollout (which recorded 2's digest), and
    version 3's bytes installed by hand before its rollout found them "already installed"."""

    state: Path
    ops: ModelOps
    rollouts: RolloutStore
    digests: dict[str, str]
    handler: Handler

    def verify(self, **args: Any) -> dict[str, Any]:
        answer = self.handler(_command(args))
        ModelVerified.model_validate(answer)  # the registered shape
        return answer

    def blob(self, version: str) -> Path:
        return self.state / "blobs" / f"sha256-{self.digests[version]}"


def _rollout(store: RolloutStore, rollout_id: str, version: str, digest: str,
             *states: str) -> None:
    """A rollout's row as the runner leaves it: the release's digest recorded at its
    lookup, then its states."""
    store.create(rollout_id, ModelName.parse(NAME), version)
    store.update(rollout_id, target_digest=digest)
    for state in states:
        store.transition(rollout_id, state)


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    state = tmp_path / "state"
    ops = ModelOps(ModelStore(state, keep_previous=2))
    rollouts = RolloutStore(state / "rollouts.db")
    files = {v: write_tiny_gguf(tmp_path / f"v{v}.gguf", context_length=256 + int(v),
                                floats=64) for v in ("1", "2", "3")}
    digests = {v: _sha256(f) for v, f in files.items()}
    for version in ("1", "2"):  # as `release.source.install` does, then the switch
        ops.install_verified(files[version], NAME, digests[version], by="rollout:r",
                             origin=release_origin(ModelName.parse(NAME), version),
                             activate=True)
    _rollout(rollouts, "r2", "2", digests["2"], DOWNLOADING, VERIFYING, STAGED,
             ACTIVATING, GATING, ACTIVE)
    ops.import_file(files["3"], NAME, by="cli:ann", activate=False)
    _rollout(rollouts, "r3", "3", digests["3"], STAGED, CANCELLED)  # "already installed"
    assert ops.active_digest(NAME) == digests["2"]
    yield Box(state, ops, rollouts, digests,
              model_verify_handler(ops, recorded=rollouts.release_digest))
    rollouts.close()
    ops.close()


def test_the_rollback_target_is_present_verified_and_loads(box: Box) -> None:
    size = box.blob("1").stat().st_size
    sound = {"present": True, "verified": True, "loads": True, "size_bytes": size,
             "detail": ""}
    assert box.verify(name=NAME, version=1) == {
        "name": NAME, "version": "1", "digest": f"sha256:{box.digests['1']}", **sound}
    assert box.verify(name=NAME, digest=f"sha256:{box.digests['1']}") == {
        "name": NAME, "digest": f"sha256:{box.digests['1']}", **sound}
    # The name is read as everywhere a name enters (blanks around it go).
    assert box.verify(name=f" {NAME}", version="1")["verified"] is True


def test_a_version_only_a_rollout_recorded_is_found_by_its_digest(box: Box) -> None:
    """Version 3's bytes came in by hand (origin `import:`), so only its rollout's record
    says they are release 3's."""
    answer = box.verify(name=NAME, version="3")
    assert (answer["digest"], answer["present"], answer["verified"], answer["loads"]) == (
        f"sha256:{box.digests['3']}", True, True, True)
    assert box.verify(name=NAME, version="2")["digest"] == f"sha256:{box.digests['2']}"
    without = model_verify_handler(box.ops)(_command({"name": NAME, "version": "3"}))
    assert (without["present"], without["detail"]) == (
        False, f"no version 3 of {NAME} on this box")


def test_a_version_the_box_lacks_is_an_answer_not_an_error(box: Box) -> None:
    assert box.verify(name=NAME, version="9") == {
        "name": NAME, "version": "9", "digest": None, "present": False, "verified": False,
        "loads": False, "size_bytes": None, "detail": f"no version 9 of {NAME} on this box"}
    other = "ab" * 32
    assert box.verify(name=NAME, digest=f"sha256:{other}")["detail"] == \
        f"no version sha256:{other[:12]}… of {NAME} on this box"
    assert box.verify(name="other:1", version="1")["detail"] == \
        "no version 1 of other:1 on this box"
    # Removed since (retention, an operator): the rollout's record still names the digest.
    box.ops.remove(NAME, box.digests["3"], by="cli:ann")
    gone = box.verify(name=NAME, version="3")
    assert (gone["present"], gone["digest"], gone["detail"]) == (
        False, f"sha256:{box.digests['3']}",
        f"no version 3 of {NAME} on this box (its digest sha256:{box.digests['3'][:12]} "
        "is not installed)")


def test_a_deleted_blob_is_not_present_and_named(box: Box) -> None:
    blob = box.blob("1")
    blob.unlink()
    answer = box.verify(name=NAME, version="1")
    assert (answer["present"], answer["verified"], answer["loads"]) == (False, False, False)
    assert answer["detail"] == f"the blob {blob.name} is missing"
    assert answer["size_bytes"] == box.ops.versions(NAME)[-1].model.size  # as installed


def test_changed_bytes_are_not_verified_and_a_broken_header_does_not_load(box: Box) -> None:
    blob = box.blob("1")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # a weight: the header still reads
    blob.write_bytes(data)
    answer = box.verify(name=NAME, version="1")
    assert (answer["present"], answer["verified"], answer["loads"]) == (True, False, True)
    assert answer["detail"].startswith("sha256 differs: the blob hashes to "), answer
    assert answer["detail"].endswith(f", not {box.digests['1'][:12]}")

    blob.write_bytes(b"\0" * len(data))  # the same size, no GGUF at all
    answer = box.verify(name=NAME, version="1")
    assert (answer["present"], answer["verified"], answer["loads"]) == (True, False, False)
    assert answer["detail"].startswith("sha256 differs: ") and \
        "; GGUF header: not a GGUF file" in answer["detail"], answer

    blob.write_bytes(bytes(data[:100]))  # cut short
    answer = box.verify(name=NAME, version="1")
    assert (answer["present"], answer["verified"], answer["loads"]) == (True, False, False)
    assert answer["detail"].startswith(f"the blob is 100 bytes, {len(data)} expected; "
                                       "GGUF header: "), answer
    # Nothing changed: the store still lists the version, the pointer did not move.
    assert box.ops.active_digest(NAME) == box.digests["2"]
    assert box.digests["1"] in {v.digest for v in box.ops.versions(NAME)}


@pytest.mark.parametrize("args", [
    {"name": NAME},
    {"name": NAME, "version": 1, "digest": "sha256:" + "ab" * 32},
    {"name": NAME, "digest": "sha256:abc"},
    {"name": NAME, "digest": "ab" * 32},
    {"name": NAME, "version": None},
    {"name": NAME, "version": "1 2"},
    {"name": "Bad Name!", "version": 1},
    {"version": 1},
    {"name": NAME, "version": 1, "deep": True},
])
def test_args_off_the_schema_are_refused(box: Box, args: dict[str, Any]) -> None:
    with pytest.raises(CommandRefused) as refused:
        box.handler(_command(args))
    assert refused.value.reason == MALFORMED


@pytest.mark.broker
def test_through_a_broker_the_controller_gets_each_answer(
        box: Box, tmp_path: Path, mosquitto_factory: Callable[..., Mosquitto]) -> None:
    box_id = "store-verify"
    broker = mosquitto_factory(devices=(box_id,)).start()
    remote = CommandBox(broker, tmp_path / "link", box_id, {"model.verify": box.handler})
    try:
        box.blob("3").write_bytes(b"\0" * box.blob("3").stat().st_size)
        sent = [remote.command("model.verify", {"name": NAME, "version": "1"}),
                remote.command("model.verify", {"name": NAME, "version": 3}),
                remote.command("model.verify", {"name": NAME, "version": "9"}),
                remote.command("model.verify", {"name": NAME})]
        for command in sent:
            remote.send(command)
        sound, broken, missing, bad = (remote.result(c) for c in sent)
        assert sound["status"] == "ok", sound
        assert {k: sound["result"][k] for k in ("present", "verified", "loads", "detail")} \
            == {"present": True, "verified": True, "loads": True, "detail": ""}
        assert broken["status"] == "ok", broken
        assert (broken["result"]["verified"], broken["result"]["loads"]) == (False, False)
        assert missing["status"] == "ok", missing
        assert (missing["result"]["present"], missing["result"]["detail"]) == (
            False, f"no version 9 of {NAME} on this box")
        assert (bad["status"], bad["reason"]) == ("refused", MALFORMED), bad
    finally:
        remote.close()
