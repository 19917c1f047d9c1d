"""Reads a GGUF header safely, before llama.cpp ever sees the file.

GGUF parsers (llama.cpp's loader and the Python `gguf` reader alike) trust length fields
they should not: a 49-byte file claiming a 2**63-item array kept the `gguf` reader busy
for most of a minute. So the header is read here, with `struct`, through a window of
bounded reads, and every declared length and count must fit in what is left of the file
before it is believed. The walk runs twice: in the caller, skipping values, so a lying
file is refused in milliseconds without a process being started; then in a child process
with a time and address-space limit, which also reads the values the catalog needs. Only
regular files are opened (a FIFO would block a reader forever). A crafted file costs an
error message, never a hung or crashed daemon. The `gguf` package supplies only its type
tables. This module must never import llama_cpp.
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import stat
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from edge_agent.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24
# The smallest possible tensor-info and key/value records; counts above size/these are lies.
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_MIN_KV_BYTES = 8 + 1 + 4 + 1
# Value types: fixed sizes by type id; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_BYTES = {t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}
_STRING, _ARRAY = 8, 9
_MAX_KEY_BYTES = 65535  # the GGUF spec's bound on a key
_MAX_WANTED_STRING_BYTES = 1 << 24  # a chat template or a name; real ones are kilobytes
_MAX_TENSOR_NAME_BYTES = 4096  # llama.cpp allows 63 (GGML_MAX_NAME); this bounds a lie
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Real files hold tens of keys and at most a few thousand tensors; both are kept in sets.
_MAX_KEYS = 1 << 16
_MAX_TENSORS = 1 << 20
# Strings the header may hold in all (arrays of strings are walked one by one). The largest
# vocabularies plus merges are ~10^6; a file far beyond that is built to stall a reader.
_MAX_STRINGS = 1 << 23
_WINDOW = 1 << 20
_CHILD_TIMEOUT_S = 60
_CHILD_ADDRESS_SPACE = 4 * 1024**3
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


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


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, refused unless it is a regular file.

    A FIFO, device or socket would block a reader forever or stream without end, so the
    type is checked before opening (stat) and again on what was opened (fstat), which
    closes the window in which the path could be swapped. O_NONBLOCK keeps even that open
    from waiting on a FIFO's writer.
    """
    try:
        _require_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _require_regular(path: Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "special file")
    raise ModelFileError(f"{path}: not a regular file (a {kind})")


_FILE_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
               (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def precheck(path: Path) -> None:
    """Bounded walk of the whole GGUF header; raises ModelFileError on anything implausible."""
    with os.fdopen(open_regular(path), "rb") as fh:
        precheck_open(fh, path)


def precheck_open(fh: BinaryIO, label: Path) -> None:
    """The same walk over a file already opened (by `open_regular`), values skipped unread.

    Each string length, array length, key and tensor count must fit in what remains of the
    file, so a lie costs milliseconds. Legitimate files pass in well under a second: only
    arrays of strings are walked item by item, and their total is bounded (`_MAX_STRINGS`).
    """
    _walk(fh, label, frozenset())


def _walk(fh: BinaryIO, label: Path, wanted: frozenset[bytes]) -> _Header:
    try:
        return _header(fh, wanted)
    except _Refused as exc:
        raise ModelFileError(f"{label}: {exc}") from None
    except OSError as exc:
        raise ModelFileError(f"{label}: cannot read ({exc.strerror})") from exc


def _header(fh: BinaryIO, wanted: frozenset[bytes]) -> _Header:
    header = _Header(fh, os.fstat(fh.fileno()).st_size, wanted)
    header.walk()
    return header


class _Refused(Exception):
    """A header that cannot be what it claims; the message says which field lied."""


class _Header:
    """A cursor over the header, read through a window so no read is sized by the file.

    Keeps the keys it met, the values of the `wanted` ones (scalars and strings), and the
    tensors' element total.
    """

    def __init__(self, fh: BinaryIO, size: int, wanted: frozenset[bytes]) -> None:
        self.fh, self.size, self.wanted = fh, size, wanted
        self.buf, self.base, self.pos = b"", 0, 0
        self.strings = 0
        self.alignment = 32
        self.keys: set[bytes] = set()
        self.values: dict[str, object] = {}
        self.parameters = 0
        self.tensor_count = 0

    def walk(self) -> None:
        head = self._bytes(_HEADER_BYTES, "header")
        if head[:4] != GGUF_MAGIC:
            raise _Refused("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version not in (2, 3):
            raise _Refused(f"unsupported GGUF version {version}")
        left = self.size - self.pos
        if n_tensors == 0 or n_tensors > min(left // _MIN_TENSOR_INFO_BYTES, _MAX_TENSORS):
            raise _Refused(f"implausible tensor count {n_tensors} for {self.size} bytes")
        if n_kv > min(left // _MIN_KV_BYTES, _MAX_KEYS):
            raise _Refused(f"implausible metadata count {n_kv} for {self.size} bytes")
        for _ in range(n_kv):
            self._key_value()
        for required in (b"general.architecture", b"tokenizer.ggml.tokens"):
            if required not in self.keys:
                raise _Refused(f"{required.decode()} is missing")
        self._tensors(n_tensors)

    def _key_value(self) -> None:
        key = self._bytes(self._length(_MAX_KEY_BYTES, "key"), "key")
        if key in self.keys:
            raise _Refused(f"duplicate key {_shown(key)}")
        self.keys.add(key)
        vtype = self._u32()
        if key == b"general.alignment":
            self._alignment(vtype)
        elif key in self.wanted and vtype in _SCALAR_FORMATS:
            raw = self._bytes(_SCALAR_BYTES[vtype], key)
            self.values[key.decode()] = struct.unpack(_SCALAR_FORMATS[vtype], raw)[0]
        elif key in self.wanted and vtype == _STRING:
            n = self._length(_MAX_WANTED_STRING_BYTES, key)
            self.values[key.decode()] = self._read(n).decode("utf-8", "replace")
        else:
            self._skip_value(vtype, key)

    def _tensors(self, count: int) -> None:
        """Tensor infos, then each tensor's bytes must lie inside the file."""
        infos, names = [], set()
        for _ in range(count):
            name, offset, elements, nbytes = self._tensor_info()
            if name in names:
                raise _Refused(f"duplicate tensor {_shown(name)}")
            names.add(name)
            infos.append((name, offset, nbytes))
            self.parameters += elements
        data = -(-self.pos // self.alignment) * self.alignment
        for name, offset, nbytes in infos:
            if data + offset + nbytes > self.size:
                raise _Refused(f"tensor {_shown(name)} runs past the end of the file "
                               "(truncated?)")
        self.tensor_count = count

    def _tensor_info(self) -> tuple[bytes, int, int, int]:
        name = self._bytes(self._length(_MAX_TENSOR_NAME_BYTES, "tensor name"), "tensor name")
        n_dims = self._u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise _Refused(f"tensor {_shown(name)} has {n_dims} dimensions")
        dims = [self._u64() for _ in range(n_dims)]
        ttype, offset = self._u32(), self._u64()
        try:
            block, type_size = _quant_sizes()[ttype]
        except KeyError:
            raise _Refused(f"tensor {_shown(name)} has unknown type {ttype}") from None
        if dims[0] % block:
            raise _Refused(f"tensor {_shown(name)}: a row of {dims[0]} is not whole "
                           f"{block}-blocks")
        elements = math.prod(dims)
        return name, offset, elements, elements // block * type_size

    # -- values ----------------------------------------------------------------------------
    def _skip_value(self, vtype: int, key: bytes) -> None:
        if vtype in _SCALAR_BYTES:
            self._skip(_SCALAR_BYTES[vtype], key)
        elif vtype == _STRING:
            self._skip(self._length(self.size, key), key)
        elif vtype == _ARRAY:
            self._skip_array(key)
        else:
            raise _Refused(f"key {_shown(key)} has unknown value type {vtype}")

    def _skip_array(self, key: bytes) -> None:
        itype, count = self._u32(), self._u64()
        left = self.size - self.pos
        if itype in _SCALAR_BYTES:
            if count * _SCALAR_BYTES[itype] > left:
                raise _Refused(f"array {_shown(key)} claims {count} items; "
                               f"{left} bytes are left")
            self._skip(count * _SCALAR_BYTES[itype], key)
        elif itype == _STRING:
            if count * 8 > left:
                raise _Refused(f"array {_shown(key)} claims {count} strings; "
                               f"{left} bytes are left")
            self.strings += count
            if self.strings > _MAX_STRINGS:
                raise _Refused(f"more than {_MAX_STRINGS} strings in the header")
            self._skip_strings(count, key)
        elif itype == _ARRAY:
            raise _Refused(f"array {_shown(key)} holds arrays (llama.cpp reads none)")
        else:
            raise _Refused(f"array {_shown(key)} has unknown item type {itype}")

    def _skip_strings(self, count: int, key: bytes) -> None:
        """The one loop over items: each string's length, checked, then skipped unread."""
        unpack, size = _U64.unpack_from, self.size
        for _ in range(count):
            i = self.pos - self.base
            if i < 0 or i + 8 > len(self.buf):
                i = self._fill(8, key)
            (n,) = unpack(self.buf, i)
            self.pos += 8 + n
            if self.pos > size:
                raise _Refused(f"a string in {_shown(key)} runs past the end of the file")

    def _alignment(self, vtype: int) -> None:
        if vtype != 4:
            raise _Refused("general.alignment is not a uint32")
        value = self._u32()
        if value == 0 or value & (value - 1):
            raise _Refused(f"general.alignment {value} is not a power of two")
        self.alignment = value

    # -- reading ---------------------------------------------------------------------------
    def _length(self, bound: int, what: str | bytes) -> int:
        n = self._u64()
        if n > bound or n > self.size - self.pos:
            raise _Refused(f"{_what(what)} claims {n} bytes; "
                           f"{min(bound, self.size - self.pos)} at most fit")
        return n

    def _skip(self, n: int, what: str | bytes) -> None:
        if n > self.size - self.pos:
            raise _Refused(f"{_what(what)} runs past the end of the file (truncated?)")
        self.pos += n

    def _u32(self) -> int:
        return int(_U32.unpack(self._bytes(4, "header"))[0])

    def _u64(self) -> int:
        return int(_U64.unpack(self._bytes(8, "header"))[0])

    def _bytes(self, n: int, what: str | bytes) -> bytes:
        i = self.pos - self.base
        if i < 0 or i + n > len(self.buf):
            i = self._fill(n, what)
        self.pos += n
        return self.buf[i:i + n]

    def _read(self, n: int) -> bytes:
        """A wanted string: n was checked against the bytes left and its own bound."""
        if n <= _WINDOW:
            return self._bytes(n, "string")
        self.fh.seek(self.pos)
        data = self.fh.read(n)
        if len(data) < n:
            raise _Refused("the file shrank while it was read")
        self.pos += n
        return data

    def _fill(self, n: int, what: str | bytes) -> int:
        """Read the window at `pos`; n is small (a length, a key, a name, a wanted string)."""
        if n > self.size - self.pos:
            raise _Refused(f"{_what(what)} runs past the end of the file (truncated?)")
        self.fh.seek(self.pos)
        self.buf, self.base = self.fh.read(max(n, _WINDOW)), self.pos
        if len(self.buf) < n:
            raise _Refused("the file shrank while it was read")
        return 0


@functools.cache
def _quant_sizes() -> dict[int, tuple[int, int]]:
    """(block size, bytes per block) by ggml type id, from the same package the reader uses."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}


def _what(what: str | bytes) -> str:
    return what if isinstance(what, str) else f"value of {_shown(what)}"


def _shown(raw: bytes) -> str:
    """A key or tensor name for a message: quoted, cut short, control characters escaped."""
    return repr(raw[:64].decode("utf-8", "replace"))


def probe(path: Path, label: Path | None = None) -> GGUFInfo:
    """Validate `path` as GGUF and read what the catalog needs, in a limited child process.

    `label` names the file in messages when `path` is a staged copy of it.
    """
    label = label or path
    with os.fdopen(open_regular(path), "rb") as fh:
        precheck_open(fh, label)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "edge_agent.engine.models.gguf_probe", str(path)],
            capture_output=True,
            timeout=_CHILD_TIMEOUT_S,
            preexec_fn=_limit_child,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelFileError(f"{label}: GGUF header took over {_CHILD_TIMEOUT_S}s to read"
                             ) from exc
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"reader exited with {done.returncode}"
        raise ModelFileError(f"{label}: invalid GGUF ({reason})")
    return GGUFInfo(**json.loads(done.stdout))


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_ADDRESS_SPACE, _CHILD_ADDRESS_SPACE))
    resource.setrlimit(resource.RLIMIT_CPU, (_CHILD_TIMEOUT_S, _CHILD_TIMEOUT_S))


def _read(path: Path) -> GGUFInfo:
    """Runs in the child: the same bounded walk, keeping the values the catalog needs."""
    from gguf.constants import LlamaFileType

    with os.fdopen(open_regular(path), "rb") as fh:
        arch = _header(fh, frozenset({b"general.architecture"})).values.get(
            "general.architecture")
        if not isinstance(arch, str) or not arch:
            raise _Refused("general.architecture is not a name")
        per_arch = ("context_length", "embedding_length", "block_count",
                    "attention.head_count", "attention.head_count_kv",
                    "attention.key_length", "attention.value_length")
        wanted = {f"{arch}.{k}" for k in per_arch} | {
            "general.architecture", "general.name", "general.file_type",
            "tokenizer.chat_template"}
        header = _header(fh, frozenset(k.encode() for k in wanted))
    values = header.values
    try:
        quant = LlamaFileType(int(values["general.file_type"])).name  # type: ignore[call-overload]
        quant = quant.removeprefix("MOSTLY_")
    except (KeyError, TypeError, ValueError):
        quant = "unknown"

    def as_int(key: str) -> int | None:
        v = values.get(f"{arch}.{key}")
        return int(v) if isinstance(v, (int, float)) else None

    template = values.get("tokenizer.chat_template")
    return GGUFInfo(
        architecture=arch,
        name=str(values.get("general.name") or ""),
        context_length=as_int("context_length"),
        embedding_length=as_int("embedding_length"),
        block_count=as_int("block_count"),
        chat_template=str(template) if template else None,
        quantization=quant,
        parameter_count=header.parameters,
        tensor_count=header.tensor_count,
        has_fim=b"tokenizer.ggml.fim_pre_token_id" in header.keys,
        head_count=as_int("attention.head_count"),
        head_count_kv=as_int("attention.head_count_kv"),
        key_length=as_int("attention.key_length"),
        value_length=as_int("attention.value_length"),
    )


def _main(path: str) -> int:
    """The child's entry: JSON on stdout, or one line on stderr that the parent quotes."""
    try:
        info = _read(Path(path))
    except _Refused as exc:
        return _report(str(exc))
    except ModelFileError as exc:
        return _report(exc.message)
    except Exception as exc:  # any failure is the file's, reported in one line
        return _report(f"{type(exc).__name__}: {exc}")
    sys.stdout.write(json.dumps(asdict(info)))
    return 0


def _report(reason: str) -> int:
    sys.stderr.write(reason.replace("\n", " ") + "\n")
    return 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
