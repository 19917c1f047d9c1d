"""Reads a GGUF header safely, before llama.cpp ever sees the file.

GGUF parsers (llama.cpp's loader and the Python `gguf` reader alike) have trusted length
fields they should not. So every file is first checked here with cheap, bounded reads of
the fixed header, then parsed by the `gguf` package in a child process with a time and
address-space limit: a crafted file costs an error message, never a hung or crashed daemon.
This module must never import llama_cpp.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from edge_agent.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
# The smallest possible tensor-info and key/value records; counts above size/these are lies.
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_CHILD_TIMEOUT_S = 60
_CHILD_ADDRESS_SPACE = 4 * 1024**3


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    name: str
    context_length: int | None
    embedding_length: int | None
    block_count: int | None
    chat_template: str | None
    quantization: str
    parameter_count: int
    tensor_count: int
    has_fim: bool
    head_count: int | None = None
    head_count_kv: int | None = None
    key_length: int | None = None
    value_length: int | None = None

    def kv_bytes_per_token(self) -> int:
        """Upper bound of f16 K+V bytes per cached token (sliding-window layers use less)."""
        if not (self.embedding_length and self.block_count):
            return 0
        heads = self.head_count or 1
        kv_heads = self.head_count_kv or heads
        k = self.key_length or self.embedding_length // heads
        v = self.value_length or k
        return 2 * self.block_count * kv_heads * (k + v)

    @property
    def parameter_size(self) -> str:
        n = self.parameter_count
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= scale:
                return f"{n / scale:.3g}{unit}"
        return str(n)


def precheck(path: Path) -> None:
    """Bounded checks of the fixed header; raises ModelFileError on anything implausible."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(24)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read ({exc.strerror})") from exc
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise ModelFileError(f"{path}: unsupported GGUF version {version}")
    if n_tensors == 0 or n_tensors > size // _MIN_TENSOR_INFO_BYTES:
        raise ModelFileError(f"{path}: implausible tensor count {n_tensors} for {size} bytes")
    if n_kv > size // _MIN_KV_BYTES:
        raise ModelFileError(f"{path}: implausible metadata count {n_kv} for {size} bytes")


def probe(path: Path) -> GGUFInfo:
    """Validate `path` as GGUF and read what the catalog needs, in a limited child process."""
    precheck(path)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "edge_agent.engine.gguf_probe", str(path)],
            capture_output=True,
            timeout=_CHILD_TIMEOUT_S,
            preexec_fn=_limit_child,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelFileError(f"{path}: GGUF header took over {_CHILD_TIMEOUT_S}s to read") from exc
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"reader exited with {done.returncode}"
        raise ModelFileError(f"{path}: invalid GGUF ({reason})")
    return GGUFInfo(**json.loads(done.stdout))


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_ADDRESS_SPACE, _CHILD_ADDRESS_SPACE))
    resource.setrlimit(resource.RLIMIT_CPU, (_CHILD_TIMEOUT_S, _CHILD_TIMEOUT_S))


def _read(path: Path) -> GGUFInfo:
    """Runs in the child: full parse with the `gguf` package plus range checks."""
    from gguf import GGUFReader, LlamaFileType

    size = os.path.getsize(path)
    reader = GGUFReader(path, "r")

    def field(key: str) -> object | None:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = str(field("general.architecture") or "")
    if not arch:
        raise ValueError("general.architecture is missing")
    if field("tokenizer.ggml.tokens") is None:
        raise ValueError("tokenizer.ggml.tokens is missing")
    params = 0
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"tensor {t.name} runs past the end of the file (truncated?)")
        params += int(t.n_elements)
    file_type = field("general.file_type")
    try:
        quant = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")  # type: ignore[call-overload]
    except (TypeError, ValueError):
        quant = "unknown"

    def as_int(key: str) -> int | None:
        v = field(key)
        return int(v) if isinstance(v, (int, float)) else None

    template = field("tokenizer.chat_template")
    return GGUFInfo(
        architecture=arch,
        name=str(field("general.name") or ""),
        context_length=as_int(f"{arch}.context_length"),
        embedding_length=as_int(f"{arch}.embedding_length"),
        block_count=as_int(f"{arch}.block_count"),
        chat_template=str(template) if template else None,
        quantization=quant,
        parameter_count=params,
        tensor_count=len(reader.tensors),
        has_fim=field("tokenizer.ggml.fim_pre_token_id") is not None,
        head_count=as_int(f"{arch}.attention.head_count"),
        head_count_kv=as_int(f"{arch}.attention.head_count_kv"),
        key_length=as_int(f"{arch}.attention.key_length"),
        value_length=as_int(f"{arch}.attention.value_length"),
    )


if __name__ == "__main__":
    info = _read(Path(sys.argv[1]))
    sys.stdout.write(json.dumps(asdict(info)))
