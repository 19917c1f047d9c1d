"""The prompt cache's disk tier: shared prefixes (a system prompt every request of a store's
assistant starts with) kept across restarts, so the first request after a restart or a
model switch does not compute them again.

One file per prefix, in a folder per model (`<state_dir>/prompt-cache/<sha256>/`, removed
with the model), owner-only, written whole by rename. A file is a header line of JSON (the
`CacheShape` it was computed under, its tokens, the state's length and sha256) and the
state's bytes. At load a file is used only when its shape is the loading model's (digest,
llama.cpp build, context, KV type, flash attention) and its bytes hash to the header's:
anything else is refused, counted and deleted, never handed to llama.cpp. The folder is
bounded in bytes (`[runtime] prompt_cache_disk_mib`); the files least recently written or
used go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from edge_agent.engine.scheduling.prompt_cache import CacheShape
from edge_agent.files import atomic_write

log = logging.getLogger(__name__)

MAGIC = b"edge-agent prompt cache 1\n"
SUFFIX = ".kv"


class PromptDisk:
    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root = root
        self.limit_bytes = limit_bytes

    def _files(self) -> list[tuple[float, int, Path]]:
        """Every state file: (when last written or used, size, path)."""
        out: list[tuple[float, int, Path]] = []
        try:
            paths = [p for d in self.root.iterdir() if d.is_dir()
                     for p in d.iterdir() if p.suffix == SUFFIX]
        except OSError:
            return out
        for p in paths:
            try:
                st = p.stat()
            except OSError:  # removed meanwhile
                continue
            out.append((max(st.st_mtime, st.st_atime), st.st_size, p))
        return out

    def usage(self) -> tuple[int, int]:
        """(bytes, files) on disk now."""
        files = self._files()
        return sum(size for _, size, _ in files), len(files)

    @staticmethod
    def file_name(shape: CacheShape, tokens: list[int]) -> str:
        digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24]
        return f"{shape.key}-{digest}{SUFFIX}"

    def save(self, shape: CacheShape, tokens: list[int], state: bytes) -> bool:
        """Writes one prefix's state; False where it is there already or cannot fit."""
        if len(state) + 4096 > self.limit_bytes:
            return False
        folder = self.root / shape.model
        path = folder / self.file_name(shape, tokens)
        if path.exists():
            return False
        header = {"shape": asdict(shape), "tokens": tokens, "size": len(state),
                  "sha256": hashlib.sha256(state).hexdigest()}
        try:
            self._make_room(len(state))
            self.root.mkdir(mode=0o700, exist_ok=True)
            folder.mkdir(mode=0o700, exist_ok=True)
            atomic_write(path, MAGIC + json.dumps(header).encode() + b"\n" + state)
        except OSError as exc:  # a full disk costs the next start its warm prompt, no more
            log.warning("could not keep a prompt's state on disk: %s", exc)
            return False
        return True

    def _make_room(self, size: int) -> None:
        files = self._files()
        total = sum(n for _, n, _ in files)
        for _, n, p in sorted(files):
            if total + size <= self.limit_bytes:
                break
            p.unlink(missing_ok=True)
            total -= n

    def load(self, shape: CacheShape) -> tuple[list[tuple[list[int], bytes]], int]:
        """Every file of `shape`'s model that is valid for `shape`, as (tokens, state); and
        how many were refused (another shape, damaged: deleted)."""
        folder = self.root / shape.model
        out: list[tuple[list[int], bytes]] = []
        refused = 0
        try:
            paths = sorted(p for p in folder.iterdir() if p.suffix == SUFFIX)
        except OSError:
            return out, 0
        for path in paths:
            reason = None
            try:
                tokens, state = self._read(path, shape)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                reason = str(exc) or type(exc).__name__
            if reason is not None:
                log.info("a cached prompt state was not used (%s): %s", reason, path.name)
                refused += 1
                path.unlink(missing_ok=True)
                continue
            os.utime(path)  # used: the last to go
            out.append((tokens, state))
        return out, refused

    @staticmethod
    def _read(path: Path, shape: CacheShape) -> tuple[list[int], bytes]:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not a prompt cache file")
        end = data.index(b"\n", len(MAGIC))
        header = json.loads(data[len(MAGIC) : end])
        if CacheShape(**header["shape"]) != shape:
            raise ValueError("computed under another model, build or settings")
        state = data[end + 1 :]
        if len(state) != header["size"] or \
                hashlib.sha256(state).hexdigest() != header["sha256"]:
            raise ValueError("damaged: its bytes do not match its header")
        tokens = header["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError("its tokens are not a list of token ids")
        return tokens, state

    def remove_model(self, digest: str) -> None:
        shutil.rmtree(self.root / digest, ignore_errors=True)
