from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.engine.models.catalog import ModelStore
from edge_agent.errors import ModelFileError, ModelNotFound
from edge_agent.names import ModelName
from tests.conftest import DEFAULT_MODEL, clone_state
from tests.ggufgen import write_tiny_gguf


def test_catalog_lists_both_shipped_models() -> None:
    entries = ModelStore(Path("/nonexistent")).catalog()
    assert entries["smollm2:135m"].sha256.startswith("b179c952")
    assert entries["gemma3:270m"].chat_template  # a base model: the catalog supplies it


def test_names_follow_ollama() -> None:
    assert ModelName.parse("smollm2") == "smollm2:latest"
    assert ModelName.parse("smollm2:135m") == "smollm2:135m"


def test_pulled_default_model_is_verified_and_carries_its_own_template(model_cache: Path
                                                                        ) -> None:
    store = ModelStore(model_cache)
    model = store.get(DEFAULT_MODEL)
    assert model.template_source == "gguf" and "<|im_start|>" in (model.chat_template or "")
    assert model.blob_path(model_cache).name == f"sha256-{model.digest}"
    assert model.context_length == 8192 and model.embedding_length == 576
    store.verify(model)


def test_corrupted_blob_is_refused(model_cache: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "manifests").mkdir()
    (state / "blobs").mkdir()
    src = ModelStore(model_cache).get(DEFAULT_MODEL)
    (state / "manifests").joinpath("smollm2%3A135m.json").write_text(src.model_dump_json())
    blob = src.blob_path(state)
    data = bytearray(src.blob_path(model_cache).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the weights
    blob.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="digest"):
        ModelStore(state).verify(src)
    blob.write_bytes(bytes(data[:1000]))
    with pytest.raises(ModelFileError, match="bytes, expected"):
        ModelStore(state).verify(src)
    blob.unlink()
    with pytest.raises(ModelFileError, match="missing"):
        ModelStore(state).verify(src)


def test_import_reads_metadata_and_refuses_bad_files(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=1024)
    model = store.import_file(tiny, "tiny:test")
    assert (model.architecture, model.context_length, model.template_source) == (
        "llama", 1024, "none")
    assert store.get("tiny:test").digest == model.digest
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny.read_bytes()[:-30])
    with pytest.raises(ModelFileError):
        store.import_file(bad, "bad:test")
    assert not store.is_installed("bad:test")
    assert not list((tmp_path / "state" / "blobs").glob(".incoming-*"))


def test_remove_keeps_a_blob_another_name_still_uses(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    a = store.import_file(tiny, "a:1")
    store.import_file(tiny, "b:1")
    store.remove("a:1")
    assert a.blob_path(store.state_dir).exists()
    store.remove("b:1")
    assert not a.blob_path(store.state_dir).exists()
    with pytest.raises(ModelNotFound):
        store.get("a:1")


def test_clone_state_shares_blobs(model_cache: Path, tmp_path: Path) -> None:
    state = clone_state(model_cache, tmp_path / "s")
    assert ModelStore(state).get(DEFAULT_MODEL).name == DEFAULT_MODEL


def test_a_moved_import_takes_the_file_by_rename_and_still_hashes_what_it_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`move`: one file on the disk, not two; a digest that does not match is refused
    (the file goes); a sound file the store cannot record comes back; across two
    filesystems (EXDEV) it is copied as before."""
    import errno
    import hashlib
    import os

    from edge_agent.engine.models import catalog

    store = ModelStore(tmp_path / "state")
    src = write_tiny_gguf(tmp_path / "dl.gguf")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    inode = src.stat().st_ino
    m = store.import_file(src, "tiny:1", by="test", expected_digest=digest, move=True)
    blob = m.blob_path(store.state_dir).stat()
    assert not src.exists() and blob.st_ino == inode
    assert blob.st_mode & 0o777 == 0o600  # as a copy's staging file
    assert store.verify(m).architecture == "llama"

    bad = write_tiny_gguf(tmp_path / "bad.gguf", name="other")
    with pytest.raises(ModelFileError, match="sha256"):
        store.import_file(bad, "tiny:2", by="test", expected_digest=digest, move=True)
    assert not bad.exists() and not list(store.blobs.glob(".incoming-*"))

    sound = write_tiny_gguf(tmp_path / "sound.gguf", name="sound")

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "models.db: I/O error")

    with monkeypatch.context() as patch:
        patch.setattr(ModelStore, "_commit", broken)
        with pytest.raises(OSError, match="I/O error"):
            store.import_file(sound, "tiny:3", by="test", move=True)
    assert sound.exists() and not list(store.blobs.glob(".incoming-*"))

    real_replace = os.replace

    def cross_device(a: object, b: object) -> None:
        if Path(str(a)) == sound:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(catalog.os, "replace", cross_device)
    copied = store.import_file(sound, "tiny:3", by="test", move=True)
    assert sound.exists()  # copied: the caller removes its own file
    assert copied.blob_path(store.state_dir).stat().st_ino != sound.stat().st_ino
