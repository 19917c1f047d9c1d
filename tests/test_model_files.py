"""Hostile model files: special files are refused before they are opened for reading, and
lying GGUF headers are refused in milliseconds, quietly, before any parser trusts a count."""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.engine.models import gguf_probe
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.engine.models.gguf_probe import precheck, probe
from edge_agent.errors import ModelFileError
from tests.ggufgen import write_tiny_gguf

GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(n_tensors: int = 1, n_kv: int = 1, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _array_kv(count: int, item_type: int = GGUF_UINT32, key: bytes = b"a") -> bytes:
    return _string(key) + struct.pack("<IIQ", GGUF_ARRAY, item_type, count)


def _finishes(fn: Callable[[], object], seconds: float) -> BaseException | None:
    """Run fn in a thread; fail the test if it is still running after `seconds`."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still running after {seconds}s"
    return outcome[0]


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "model.gguf"
    os.mkfifo(path)
    yield path
    try:  # release a reader the old code left blocked in open()
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


# -- special files ---------------------------------------------------------------------------
def test_importing_a_fifo_is_refused_without_waiting(fifo: Path, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    err = _finishes(lambda: store.import_file(fifo, "fifo:1"), 5)
    assert isinstance(err, ModelFileError)
    assert "not a regular file (a FIFO)" in err.message
    assert not store.is_installed("fifo:1")


def test_cli_import_of_a_fifo_is_a_one_line_failed_check(fifo: Path, tmp_path: Path) -> None:
    def run() -> None:
        result = CliRunner().invoke(main, ["models", "import", str(fifo), "--name", "f:1",
                                           "--state-dir", str(tmp_path / "s")])
        assert result.exit_code == 1, result.output
        assert result.output.strip() == f"edge-agent: {fifo}: not a regular file (a FIFO)"

    assert _finishes(run, 5) is None


@pytest.mark.parametrize(("make", "kind"), [
    (lambda tmp: Path("/dev/null"), "character device"),
    (lambda tmp: tmp, "directory"),
])
def test_other_special_files_are_refused(make: Callable[[Path], Path], kind: str,
                                         tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=f"not a regular file \\(a {kind}\\)"):
        probe(make(tmp_path))


def test_a_socket_is_refused(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "s.gguf"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(ModelFileError, match="a socket"):
            ModelStore(tmp_path / "state").import_file(path, "sock:1")


# -- lying headers -------------------------------------------------------------------------
def _refused_fast(path: Path, match: str, capfd: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    err = _finishes(lambda: probe(path), 10)
    elapsed = time.perf_counter() - start
    assert isinstance(err, ModelFileError), err
    assert match in err.message
    assert elapsed < 1.0, f"{elapsed:.2f}s to refuse"
    out, errout = capfd.readouterr()
    assert out == "" and errout == ""


def test_the_49_byte_file_claiming_2_63_items(tmp_path: Path,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    crafted = tmp_path / "big.gguf"
    crafted.write_bytes(_header() + _array_kv(2**63))
    assert crafted.stat().st_size == 49
    _refused_fast(crafted, "implausible", capfd)


LIES = {
    "2**63 items": (_array_kv(2**63), "claims 9223372036854775808 items"),
    "10M items": (_array_kv(10_000_000), "claims 10000000 items"),
    "2**40 strings": (_array_kv(2**40, GGUF_STRING), "claims 1099511627776 strings"),
    "string in array": (_array_kv(3, GGUF_STRING) + struct.pack("<Q", 2**62),
                        "runs past the end"),
    "string value": (_string(b"k") + struct.pack("<IQ", GGUF_STRING, 2**62),
                     "claims 4611686018427387904 bytes"),
    "key": (struct.pack("<Q", 2**62), "key claims"),
    "nested array": (_array_kv(2, GGUF_ARRAY), "holds arrays"),
    "value type": (_string(b"k") + struct.pack("<I", 77), "unknown value type 77"),
    "item type": (_array_kv(1, 99), "unknown item type 99"),
}


@pytest.mark.parametrize(("body", "match"), LIES.values(), ids=LIES.keys())
def test_counts_and_lengths_longer_than_the_file_are_refused_in_milliseconds(
        body: bytes, match: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(_header() + body + b"\0" * 200)
    _refused_fast(crafted, match, capfd)


def _tiny_with(tmp_path: Path, patch: Callable[[bytearray], None]) -> Path:
    data = bytearray(write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes())
    patch(data)
    out = tmp_path / "patched.gguf"
    out.write_bytes(bytes(data))
    return out


def test_tensor_records_are_checked(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    name = b"token_embd.weight"

    def at(data: bytearray) -> int:  # just past the tensor's name: n_dims, dims, type, offset
        return data.index(_string(name)) + len(_string(name))

    def dims5(d: bytearray) -> None:
        d[at(d):at(d) + 4] = struct.pack("<I", 5)

    def huge(d: bytearray) -> None:
        d[at(d) + 4:at(d) + 12] = struct.pack("<Q", 2**40)

    def bad_type(d: bytearray) -> None:
        d[at(d) + 20:at(d) + 24] = struct.pack("<I", 9999)

    def far(d: bytearray) -> None:
        d[at(d) + 24:at(d) + 32] = struct.pack("<Q", 2**60)

    for patch, match in ((dims5, "5 dimensions"), (huge, "runs past the end"),
                         (bad_type, "unknown type 9999"), (far, "runs past the end")):
        _refused_fast(_tiny_with(tmp_path, patch), match, capfd)


def test_required_keys_and_duplicates(tmp_path: Path, capfd: pytest.CaptureFixture[str]
                                      ) -> None:
    def rename(old: bytes, new: bytes) -> Callable[[bytearray], None]:
        def patch(d: bytearray) -> None:
            i = d.index(_string(old))
            d[i:i + len(_string(old))] = _string(new)
        return patch

    cases = ((rename(b"general.architecture", b"general.architecturX"), "architecture is missing"),
             (rename(b"tokenizer.ggml.tokens", b"tokenizer.ggml.tokenX"), "tokens is missing"),
             (rename(b"general.file_type", b"llama.block_count"),
              "duplicate key 'llama.block_count'"))
    for patch, match in cases:
        _refused_fast(_tiny_with(tmp_path, patch), match, capfd)


def test_too_many_strings_in_all_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gguf_probe, "_MAX_STRINGS", 2)
    _refused_fast(write_tiny_gguf(tmp_path / "tiny.gguf"), "more than 2 strings", capfd)


def test_a_valid_file_still_reads_the_same(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=77, template="{{ t }}")
    precheck(path)
    info = probe(path)
    assert (info.architecture, info.context_length, info.chat_template, info.tensor_count,
            info.parameter_count, info.quantization) == ("llama", 77, "{{ t }}", 1, 24, "ALL_F32")


def test_a_refused_import_copies_nothing(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    crafted = tmp_path / "c.gguf"
    crafted.write_bytes(_header() + _array_kv(2**63) + b"\0" * 4096)
    with pytest.raises(ModelFileError, match=f"^{crafted}: array 'a' claims"):
        store.import_file(crafted, "c:1")
    blobs = tmp_path / "state" / "blobs"
    assert not blobs.exists() or not list(blobs.iterdir())
