from __future__ import annotations

import struct
from pathlib import Path

import pytest

from edge_agent.engine.models.gguf_probe import precheck, probe
from edge_agent.errors import ModelFileError
from tests.ggufgen import write_tiny_gguf


def test_reads_metadata_of_a_valid_file(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=512, template="{{ x }}")
    info = probe(path)
    assert info.architecture == "llama"
    assert info.context_length == 512
    assert info.embedding_length == 8
    assert info.chat_template == "{{ x }}"
    assert info.parameter_count == 24
    assert info.quantization == "ALL_F32"


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 40])
    with pytest.raises(ModelFileError, match="invalid GGUF|truncated|implausible"):
        probe(cut)


def test_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"this is a text file, not a model" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        probe(bad)


def test_lying_counts_are_refused_before_any_parser_runs(tmp_path: Path) -> None:
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1) + b"\0" * 64)
    with pytest.raises(ModelFileError, match="implausible tensor count"):
        precheck(crafted)
    crafted.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2**50) + b"\0" * 64)
    with pytest.raises(ModelFileError, match="implausible metadata count"):
        precheck(crafted)
    crafted.write_bytes(b"GGUF" + struct.pack("<IQQ", 99, 1, 1) + b"\0" * 64)
    with pytest.raises(ModelFileError, match="version"):
        precheck(crafted)


def test_huge_string_length_costs_an_error_not_the_process(tmp_path: Path) -> None:
    # One key/value whose key length claims 2**62 bytes: a reader that trusts it would try
    # to allocate or map far past the file.
    crafted = tmp_path / "biglen.gguf"
    crafted.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 2**62)
                        + b"\0" * 200)
    with pytest.raises(ModelFileError):
        probe(crafted)
