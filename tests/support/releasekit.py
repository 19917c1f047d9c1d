"""Helpers for the release tests: a signed repository, GGUFs of a chosen size, and the
artifacts router in a live uvicorn that counts the bytes it serves and can be cut
mid-transfer and started again on the same port."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from gguf import GGUFWriter

from edge_agent.config import Settings, load_settings
from edge_agent.fleet.controller.releases.artifacts import artifacts_router
from edge_agent.fleet.controller.releases.repository import (
    ReleaseEntry,
    ReleaseRepository,
    manifest_for,
)
from edge_agent.fleet.controller.releases.signing_keys import KeyDir, keygen
from tests.conftest import free_port

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


def sized_gguf(path: Path, megabytes: float, *, seed: int = 0, arch: str = "llama") -> Path:
    """A valid GGUF of about `megabytes` MB: one tensor of random float32s (so nothing
    in the transfer can compress it)."""
    rows = max(1, int(megabytes * 1e6 / (256 * 4)))
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"sized-{megabytes}")
    writer.add_context_length(512)
    writer.add_embedding_length(256)
    writer.add_block_count(1)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    data = np.random.default_rng(seed).standard_normal((rows, 256), dtype=np.float32)
    writer.add_tensor("token_embd.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass
class Repo:
    keys: KeyDir
    repo: ReleaseRepository

    @property
    def root_file(self) -> Path:
        return self.repo.metadata / "root.json"

    def add(self, gguf: Path, name: str, version: str, **fields: Any) -> ReleaseEntry:
        return self.repo.add(gguf, manifest_for(gguf, name=name, version=version, **fields),
                             self.keys)


def make_repo(base: Path, **expiry_s: int) -> Repo:
    keygen(base / "keys")
    keys = KeyDir(base / "keys")
    return Repo(keys, ReleaseRepository.create(base / "state" / "releases", keys,
                                               expiry_s=expiry_s or None))


def mirror(src: Path, dest: Path) -> Path:
    """An exact copy of a repository tree (what an attacker who controls the server
    could change)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    return dest


@dataclass
class ByteCounter:
    """ASGI middleware: counts response body bytes; `cut_after` aborts the response once
    that many bytes went out in all (then calls `on_cut`)."""

    app: Any
    served: int = 0
    cut_after: int | None = None
    on_cut: Callable[[], None] = lambda: None
    requests: list[str] = field(default_factory=list)
    by_path: dict[str, int] = field(default_factory=dict)
    throttle_bps: int | None = None  # the server's own pace: little is left in flight
    down: bool = False  # between a cut and the restart: every connection is dropped

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.down:  # uvicorn takes up to 0.1 s to close its socket after a cut
            raise ConnectionAbortedError("the server is stopping")
        path = scope["path"]
        self.requests.append(f"{scope['method']} {path} "
                             f"{dict(scope['headers']).get(b'range', b'').decode()}")

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if self.cut_after is not None and self.served + len(body) > self.cut_after:
                    keep = self.cut_after - self.served
                    self.served += keep
                    self.by_path[path] = self.by_path.get(path, 0) + keep
                    self.cut_after = None
                    self.down = True
                    await send({"type": "http.response.body", "body": body[:keep],
                                "more_body": True})
                    self.on_cut()
                    raise ConnectionAbortedError("cut by the test")
                if self.throttle_bps and body:
                    await self._paced(path, message, send)
                    return
                self.served += len(body)
                self.by_path[path] = self.by_path.get(path, 0) + len(body)
            await send(message)

        await self.app(scope, receive, counting)

    async def _paced(self, path: str, message: Message, send: Send) -> None:
        body, step = message["body"], 65536
        assert self.throttle_bps
        for i in range(0, len(body), step):
            piece = body[i:i + step]
            last = i + step >= len(body)
            await send({"type": "http.response.body", "body": piece,
                        "more_body": message.get("more_body", False) if last else True})
            self.served += len(piece)
            self.by_path[path] = self.by_path.get(path, 0) + len(piece)
            await asyncio.sleep(len(piece) / self.throttle_bps)


class ArtifactServer:
    """The artifacts router over `root` at /releases/, on a fixed port (so it can be
    stopped and started again at the same URL)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        app = FastAPI()
        app.include_router(artifacts_router(root), prefix="/releases")
        self.counter = ByteCounter(app)
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/releases/"

    def start(self) -> ArtifactServer:
        self.counter.down = False
        config = uvicorn.Config(self.counter, host="127.0.0.1", port=self.port,
                                log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("artifact server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=30)
            self.server = self.thread = None

    def cut_at(self, nbytes: int) -> threading.Event:
        """Abort the transfer once `nbytes` were served and stop the server; the event is
        set when it has stopped."""
        stopped = threading.Event()

        def on_cut() -> None:
            assert self.server is not None
            self.server.should_exit = True
            thread = self.thread

            def wait() -> None:
                if thread is not None:
                    thread.join(timeout=30)
                self.server = self.thread = None
                stopped.set()

            threading.Thread(target=wait, daemon=True).start()

        self.counter.cut_after = nbytes
        self.counter.on_cut = on_cut
        return stopped


def device_settings(state: Path, root_file: Path, url: str, **extra: Any) -> Settings:
    return load_settings(None, state_dir=state, **{
        "fleet.tuf_root_file": str(root_file), "fleet.artifacts_url": url, **extra})


@contextmanager
def small_filesystem(mnt: Path, size: str) -> Iterator[Path]:
    """A real filesystem of `size` (a tmpfs, "8m") at `mnt`; the test is skipped where
    mounting is not permitted. Unmounted lazily: a store may still hold a file open."""
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
